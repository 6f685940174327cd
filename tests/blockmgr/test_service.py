"""The gRPC edge: raw-proto bad input, health, reflection, and the real process entry point."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.testing.procs import ServiceProcess
from pagedserve.v1 import blockmgr_pb2 as pb
from pagedserve.v1 import blockmgr_pb2_grpc as pb_grpc
from services.blockmgr.api import convert, convert_results
from services.blockmgr.api.types import (
    EVENTS_LIVE_HEADER,
    Admit,
    AttentionKindName,
    KVEventKind,
    OpStatus,
    PoolSpec,
)
from services.blockmgr.client import GrpcClient
from services.blockmgr.pool.groups import MAX_KV_CACHE_GROUPS
from tests.blockmgr.helpers import ThreadedServer
from tests.hypothesis_budget import examples

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    s = ThreadedServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(server: ThreadedServer) -> Iterator[pb_grpc.BlockManagerStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.BlockManagerStub(channel)


def _code(fn, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=5)
    return info.value.code(), info.value.details()


TOKENS: dict[str, str] = {}  # pool id -> owner token from Register


def _register(stub, pool_id: str) -> int:
    req = pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=16, block_size=4)
    resp = stub.Register(req, timeout=5)
    TOKENS[pool_id] = resp.owner_token
    return resp.pool.epoch


def _step(pool_id: str, epoch: int, ops=()) -> pb.StepRequest:
    return pb.StepRequest(pool_id=pool_id, epoch=epoch, ops=ops, owner_token=TOKENS[pool_id])


def test_operation_without_a_kind_is_invalid_argument(stub):
    epoch = _register(stub, "raw-1")
    code, details = _code(stub.Step, _step("raw-1", epoch, [pb.Operation()]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ops[0]" in details


def test_unknown_eviction_policy_enum_is_invalid_argument(stub):
    code, details = _code(
        stub.Register,
        pb.RegisterPoolRequest(pool_id="raw-2", num_blocks=8, block_size=4, eviction_policy=77),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "eviction_policy" in details


@pytest.mark.parametrize(
    ("field", "value"), [("num_blocks", -1), ("num_blocks", 2**31), ("block_size", 0)]
)
def test_register_out_of_range_is_invalid_argument_naming_the_field(stub, field, value):
    req = pb.RegisterPoolRequest(pool_id="raw-3", num_blocks=8, block_size=4)
    setattr(req, field, value)
    code, details = _code(stub.Register, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details


@pytest.mark.parametrize(
    ("group", "field"),
    [
        (pb.KVCacheGroup(kind=9, sliding_window=8), "groups[0].kind"),
        (pb.KVCacheGroup(kind=pb.ATTENTION_KIND_SLIDING), "groups[0].sliding_window"),
        (pb.KVCacheGroup(sliding_window=8), "groups[0].sliding_window"),  # UNSPECIFIED = FULL
        (pb.KVCacheGroup(kind=pb.ATTENTION_KIND_SLIDING, sliding_window=8, layers=[-1]), "layers"),
    ],
)
def test_bad_kv_cache_groups_are_invalid_argument_naming_the_field(stub, group, field):
    req = pb.RegisterPoolRequest(pool_id="raw-4", num_blocks=8, block_size=4, groups=[group])
    code, details = _code(stub.Register, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details


def test_an_unspecified_attention_kind_is_echoed_as_full(stub):
    req = pb.RegisterPoolRequest(
        pool_id="raw-5", num_blocks=8, block_size=4, groups=[pb.KVCacheGroup(layers=[0, 1])]
    )
    resp = stub.Register(req, timeout=5)
    (group,) = resp.pool.groups
    assert (group.kind, group.sliding_window, list(group.layers)) == (
        pb.ATTENTION_KIND_FULL,
        0,
        [0, 1],
    )
    info = stub.Info(pb.BlockManagerInfoRequest(pool_id="raw-5"), timeout=5)
    assert (
        info.max_kv_cache_groups == MAX_KV_CACHE_GROUPS and info.pools[0].groups == resp.pool.groups
    )
    stub.Unregister(
        pb.UnregisterPoolRequest(
            pool_id="raw-5", epoch=resp.pool.epoch, owner_token=resp.owner_token
        ),
        timeout=5,
    )


def test_every_attention_kind_has_a_proto_value():
    assert set(convert.ATTENTION_TO_PB) == set(AttentionKindName)
    assert len(pb.AttentionKind.keys()) == len(AttentionKindName) + 1  # + UNSPECIFIED


def test_every_rpc_maps_unknown_pool_to_not_found(stub):
    calls = [
        (stub.Info, pb.BlockManagerInfoRequest(pool_id="nope")),
        (stub.Step, pb.StepRequest(pool_id="nope", epoch=1)),
        (stub.Restore, pb.RestoreRequest(pool_id="nope", epoch=1)),
        (stub.Stats, pb.PoolStatsRequest(pool_id="nope")),
    ]
    for fn, req in calls:
        assert _code(fn, req)[0] == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamEvents(pb.StreamEventsRequest(pool_id="nope"), timeout=5))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_subscribed_event_stream_says_so_in_its_headers_before_any_event(stub):
    """A silent stream is live: consumers (the gateway's router) learn it from the headers."""
    _register(stub, "raw-events")
    stale = pb.StreamEventsRequest(pool_id="raw-events", start_after_seq=2**63)  # no replay
    call = stub.StreamEvents(stale, timeout=5)
    headers = dict(call.initial_metadata())
    assert headers.get(EVENTS_LIVE_HEADER) == "live"
    call.cancel()


def test_stale_epoch_and_double_free_are_failed_precondition(stub):
    epoch = _register(stub, "raw-4")
    assert _code(stub.Step, _step("raw-4", epoch + 1))[0] == (grpc.StatusCode.FAILED_PRECONDITION)
    admit = pb.Operation(admit=pb.AdmitOp(seq_id=1, num_prompt_tokens=3, max_new_tokens=3))
    free = pb.Operation(free=pb.FreeOp(seq_ids=[1]))
    stub.Step(_step("raw-4", epoch, [admit, free]), timeout=5)
    code, details = _code(stub.Step, _step("raw-4", epoch, [free]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already freed" in details


def test_resource_exhaustion_is_reported_per_operation_not_as_an_rpc_error(stub):
    epoch = _register(stub, "raw-5")
    big = pb.Operation(admit=pb.AdmitOp(seq_id=1, num_prompt_tokens=1000, max_new_tokens=1000))
    resp = stub.Step(_step("raw-5", epoch, [big]), timeout=5)
    assert resp.results[0].admit.status == pb.OP_STATUS_RESOURCE_EXHAUSTED
    assert resp.counters.num_free_blocks == 15


def test_health_is_serving_for_the_server_and_the_service(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "pagedserve.v1.BlockManager"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_block_manager_service(server):
    with grpc.insecure_channel(server.address) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(refl.ServerReflectionInfo(iter([req]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert "pagedserve.v1.BlockManager" in names
        assert "grpc.health.v1.Health" in names


def test_process_serves_then_shuts_down_gracefully_on_sigterm():
    proc = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    try:
        assert all(r["service"] == "blockmgr" for r in proc.lines if r["event"] != "raw")
        client = GrpcClient(proc.address)
        epoch = client.register("proc", PoolSpec(8, 4)).epoch
        (r,) = client.step("proc", epoch, [Admit(1, 5, 5)]).results
        assert r.status is OpStatus.OK
        client.close()
    finally:
        assert proc.stop() == 0
    assert "blockmgr_stopped" in proc.events()


def test_cli_rejects_a_bad_port_with_usage_error():
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "blockmgr", "--port", "70000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--port" in proc.stderr


@pytest.mark.parametrize(
    ("domain", "proto", "prefix"),
    [(OpStatus, pb.OpStatus, "OP_STATUS_"), (KVEventKind, pb.KVEventKind, "KV_EVENT_KIND_")],
)
def test_domain_enums_carry_the_proto_values(domain, proto, prefix):
    """The conversion hands domain enum values to the proto unmapped: they must agree."""
    for member in domain:
        assert proto.Value(prefix + member.name) == member.value
    assert len(proto.keys()) == len(domain) + 1  # + UNSPECIFIED


def test_conversion_round_trips_groups_first_live_blocks_and_event_groups():
    from services.blockmgr.api.types import (
        BlockCopy,
        EvictionPolicyName,
        GrowResult,
        KVCacheGroup,
        KVEvent,
        PoolInfo,
        ServiceInfo,
    )

    group = KVCacheGroup(AttentionKindName.SLIDING, 4096, (1, 3))
    pool = PoolInfo.of("p", 7, PoolSpec(16, 4, True, EvictionPolicyName.LFU, groups=(group,)))
    info = ServiceInfo("x", "1", "sha256-chain-v1", 32, (EvictionPolicyName.LRU,), (pool,), 1)
    assert convert.info_from_pb(convert.info_to_pb(info)) == info
    grow = GrowResult((OpStatus.OK, OpStatus.SKIPPED), ((3,), ()), (BlockCopy(0, 1, 2, 3),), (2, 0))
    assert convert_results.result_from_pb(convert_results.result_to_pb(grow)) == grow
    events = [KVEvent(5, 7, KVEventKind.STORED, (bytes(32),), group=1)]
    assert convert.events_from_pb(convert.events_to_pb("p", events)) == events
    # A server predating groups: no groups means one full-attention group, 0 groups served.
    old = pb.BlockManagerInfo(pools=[pb.PoolInfo(pool_id="p", num_blocks=8, block_size=4)])
    parsed = convert.info_from_pb(old)
    assert parsed.max_kv_cache_groups == 0 and parsed.pools[0].groups == (KVCacheGroup(),)


_INT32 = st.integers(-(2**31), 2**31 - 1)


@settings(
    max_examples=examples(40),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    groups=st.lists(
        st.builds(
            pb.KVCacheGroup,
            kind=_INT32,
            sliding_window=st.integers(-(2**63), 2**63 - 1),
            layers=st.lists(_INT32, max_size=4),
        ),
        max_size=3,
    )
)
def test_any_kv_cache_groups_get_an_answer_never_an_internal_error(stub, groups):
    req = pb.RegisterPoolRequest(pool_id="raw-fuzz", num_blocks=8, block_size=4, groups=groups)
    try:
        resp = stub.Register(req, timeout=5)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
        return
    assert len(resp.pool.groups) == 1
    stub.Unregister(
        pb.UnregisterPoolRequest(
            pool_id="raw-fuzz", epoch=resp.pool.epoch, owner_token=resp.owner_token
        ),
        timeout=5,
    )
