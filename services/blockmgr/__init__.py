"""The KV block manager: reference-counted block allocation, prefix hashing, copy-on-write and
eviction for one or more pools, behind a swappable gRPC contract (``protos/.../blockmgr.proto``).

Pure core: :mod:`.pool`, :mod:`.kv_manager`, :mod:`.kv_groups` (KV-cache groups, sliding
windows), :mod:`.core` (no gRPC). Edge: :mod:`.convert`, :mod:`.servicer`, :mod:`.server`.
Executor-side: :mod:`.client`.
"""
