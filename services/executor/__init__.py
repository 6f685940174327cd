"""The executor: requests' state, the scheduler loop, the model over a paged KV cache, and
sampling, in three rooms: ``core/`` decides, ``model/`` computes, ``service/`` connects (see
docs/architecture.md). Submodules are imported explicitly; nothing heavy is imported here.
"""
