"""The generated stubs always match protos/ (they are regenerated when a .proto changes)."""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

import grpc_tools
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from pagedserve import _protogen

ROOT = Path(__file__).resolve().parents[1]


def _compiled(proto: Path) -> descriptor_pb2.FileDescriptorProto:
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(
            [
                "protoc",
                f"-I{ROOT / 'protos'}",
                f"-I{include}",
                f"--descriptor_set_out={out}",
                str(proto),
            ]
        )
        assert rc == 0
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = [f for f in fds.file if f.name == str(proto.relative_to(ROOT / "protos"))]
    for message in fd.message_type:  # generated modules embed descriptors without json names
        _strip_json_names(message)
    return fd


def _strip_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _strip_json_names(nested)


def test_every_proto_is_in_the_versioned_package():
    protos = _protogen.proto_files()
    assert protos
    for proto in protos:
        assert _compiled(proto).package == "pagedserve.v1"


def test_generated_stubs_match_the_protos():
    for proto in _protogen.proto_files():
        module = importlib.import_module(f"pagedserve.v1.{proto.stem}_pb2")
        generated = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert generated == _compiled(proto), f"stubs of {proto.name} drifted; run make protos"


def test_a_touched_proto_makes_its_stubs_stale():
    proto = _protogen.proto_files()[0]
    stub = ROOT / "pagedserve" / "v1" / f"{proto.stem}_pb2.py"
    _protogen.ensure_stubs()
    assert _protogen.stale() == []
    mtime = stub.stat().st_mtime
    os.utime(stub, (mtime - 3600, mtime - 3600))
    os.utime(proto, None)
    assert proto in _protogen.stale()
    _protogen.ensure_stubs()
    assert _protogen.stale() == []
