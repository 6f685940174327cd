"""Every Step operation is named once (``OP_NAMES``); its protobuf message and its trace
record are derived from its dataclass's fields, so they must round-trip field for field."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.v1 import blockmgr_pb2 as pb
from services.blockmgr.api.convert import ops_from_pb, ops_to_pb
from services.blockmgr.api.types import (
    OP_NAMES,
    Admit,
    Commit,
    Fork,
    Free,
    Grow,
    Operation,
    SwapIn,
    SwapOut,
    Uncache,
)
from services.blockmgr.trace.record import _op_from_json, _op_json

H1, H2 = bytes(range(32)), bytes(range(1, 33))
EXAMPLES: list[Operation] = [
    Admit(7, 40, 9, (H1, H2), 2, 3, 30.5),
    Grow((1, 2), (4, 0), (3, 0)),
    Fork(1, 9),
    Free((3, 4)),
    Commit(5, 2, (H1,)),
    SwapOut((6,)),
    SwapIn((6, 8)),
    Uncache((3,), (1, 2), (0,)),
]


def test_every_operation_has_an_example_with_every_field_set() -> None:
    assert {type(op) for op in EXAMPLES} == set(OP_NAMES)
    for op in EXAMPLES:  # no field left at a default that would hide a dropped field
        for f in dataclasses.fields(op):
            assert getattr(op, f.name) not in ((), 0, b""), (type(op).__name__, f.name)


def test_every_operation_has_a_proto_message_with_the_same_fields() -> None:
    for cls, name in OP_NAMES.items():
        message = pb.Operation.DESCRIPTOR.fields_by_name[name].message_type
        assert [f.name for f in message.fields] == [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("op", EXAMPLES, ids=lambda op: type(op).__name__)
def test_operations_round_trip_through_protobuf(op: Operation) -> None:
    wire = pb.StepRequest(ops=ops_to_pb([op])).SerializeToString()
    assert ops_from_pb(pb.StepRequest.FromString(wire).ops) == [op]


@pytest.mark.parametrize("op", EXAMPLES, ids=lambda op: type(op).__name__)
def test_operations_round_trip_through_trace_records(op: Operation) -> None:
    assert _op_from_json(_op_json(op)) == op


def test_records_written_before_a_field_existed_take_its_default() -> None:
    old_admit = {"admit": [7, 40, 9, [], 2]}  # before retention_priority
    assert _op_from_json(old_admit) == Admit(7, 40, 9, (), 2, 0)
    assert _op_from_json({"free": [3, 4]}) == Free((3, 4))
