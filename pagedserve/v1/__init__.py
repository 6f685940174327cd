"""Generated protobuf/gRPC stubs for ``pagedserve.v1`` (built from ``protos/``, not committed)."""

from pagedserve._protogen import ensure_stubs

ensure_stubs()
