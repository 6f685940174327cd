"""Generate the Python stubs of ``protos/`` into ``pagedserve/v1/``.

The stubs are build outputs, never committed: ``make protos`` runs this module, and
``pagedserve.v1`` calls :func:`ensure_stubs` on import, so a fresh clone works with any
entry point. Generation is atomic (temp file + rename), so concurrent processes that
import the package at the same moment cannot observe a half-written module.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "pagedserve" / "v1").glob("*.proto"))


def _outputs(proto: Path) -> list[Path]:
    rel = proto.relative_to(PROTO_ROOT).with_suffix("")
    return [OUT_ROOT / f"{rel}{suffix}" for suffix in SUFFIXES]


def stale() -> list[Path]:
    """Protos whose stubs are missing or older than the .proto file."""
    out = []
    for proto in proto_files():
        mtime = proto.stat().st_mtime
        for target in _outputs(proto):
            if not target.exists() or target.stat().st_mtime < mtime:
                out.append(proto)
                break
    return out


def generate(protos: list[Path] | None = None) -> None:
    """Run grpc_tools.protoc for ``protos`` (default: all) and install the outputs atomically."""
    import grpc_tools
    from grpc_tools import protoc

    protos = proto_files() if protos is None else protos
    if not protos:
        return
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(dir=OUT_ROOT / "pagedserve") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {[p.name for p in protos]}")
        for proto in protos:
            rel = proto.relative_to(PROTO_ROOT).with_suffix("")
            for suffix in SUFFIXES:
                src = Path(tmp) / f"{rel}{suffix}"
                dst = OUT_ROOT / f"{rel}{suffix}"
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)


def ensure_stubs() -> None:
    todo = stale()
    if todo:
        generate(todo)


if __name__ == "__main__":
    generate()
    print(f"generated stubs for {len(proto_files())} protos", file=sys.stderr)
