"""The executor: model weights, the paged KV cache, batched forward passes and (later) the
scheduler loop and sampling. Submodules are imported explicitly; nothing heavy is imported here.
"""
