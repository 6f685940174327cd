"""Every RPC of the three services, fed raw bytes and mutated requests (hypothesis, seeded).

Pass: no UNKNOWN and no INTERNAL for anything a client sent, no crash, no hang (every call
has a deadline and streams are cancelled after a few messages or a second), every service
still SERVING and no KV block left in use afterwards. ``make test`` runs a sample per RPC;
the long run (2,000 cases per RPC) is ``pytest -m soak tests/test_fuzz.py``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2 as V_COMMON
from smg_grpc_proto.generated import vllm_engine_pb2 as V

from pagedserve.testing.procs import ServiceProcess, executor_args, gateway_args, wait_serving
from pagedserve.v1 import blockmgr_pb2 as B
from pagedserve.v1 import executor_pb2 as E
from pagedserve.v1 import generation_pb2 as G
from services.blockmgr.client import GrpcClient
from services.common.auth import INTERNAL_TOKEN_HEADER
from services.common.healthcheck import check

TOKEN = "fuzz-token"
POOL = "fuzzed-executor"
SAMPLE = int(os.environ.get("PAGEDSERVE_FUZZ_CASES", "40"))
SOAK = 2000
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
STREAM_OPEN_S = 1.0  # a server stream still open this long was accepted

# method path -> (kind, a valid request to mutate, metadata)
BM, EX, GW = "pagedserve.v1.BlockManager", "pagedserve.v1.Executor", "pagedserve.v1.Generation"
GW_ADAPTERS = "pagedserve.v1.Adapters"
SMG = "vllm.grpc.engine.VllmEngine"
VALID_PARAMS = E.ExecutorSamplingParams(
    n=1, temperature=0, top_p=1, max_tokens=4, repetition_penalty=1
)
RPCS: dict[str, tuple[str, bytes, str]] = {
    f"/{GW}/Generate": (
        "unary_stream",
        G.GenerateRequest(
            prompt="Hello", sampling_params=G.SamplingParams(max_tokens=3)
        ).SerializeToString(),
        "gw",
    ),
    f"/{GW}/Tokenize": ("unary_unary", G.TokenizeRequest(text="Hi").SerializeToString(), "gw"),
    f"/{GW}/Detokenize": (
        "unary_unary",
        G.DetokenizeRequest(token_ids=[5, 6]).SerializeToString(),
        "gw",
    ),
    f"/{GW}/GetModelInfo": ("unary_unary", b"", "gw"),
    f"/{GW}/Embed": ("unary_unary", G.EmbedRequest(text="Hi").SerializeToString(), "gw"),
    f"/{GW_ADAPTERS}/LoadAdapter": (
        "unary_unary",
        G.LoadLoraAdapterRequest(lora_name="a", lora_path="/tmp").SerializeToString(),
        "gw",
    ),
    f"/{GW_ADAPTERS}/UnloadAdapter": (
        "unary_unary",
        G.UnloadLoraAdapterRequest(lora_name="a").SerializeToString(),
        "gw",
    ),
    f"/{GW_ADAPTERS}/ListAdapters": ("unary_unary", b"", "gw"),
    f"/{EX}/Info": ("unary_unary", b"", "ex"),
    f"/{EX}/LoadAdapter": (
        "unary_unary",
        E.LoadAdapterRequest(name="a", path="/tmp").SerializeToString(),
        "ex",
    ),
    f"/{EX}/UnloadAdapter": (
        "unary_unary",
        E.UnloadAdapterRequest(name="a").SerializeToString(),
        "ex",
    ),
    f"/{EX}/ListAdapters": ("unary_unary", b"", "ex"),
    f"/{EX}/Session": (
        "stream_stream",
        E.SessionRequest(
            add=E.AddRequest(
                request_id="f",
                prompt_token_ids=[1, 5],
                sampling_params=VALID_PARAMS,
            )
        ).SerializeToString(),
        "ex",
    ),
    **{  # SMG's engine proto, served by the executor beside its own service
        f"/{SMG}/{name}": (kind, body.SerializeToString(), "ex")
        for name, kind, body in (
            (
                "Generate",
                "unary_stream",
                V.GenerateRequest(
                    request_id="s",
                    tokenized=V.TokenizedInput(input_ids=[1, 5]),
                    sampling_params=V.SamplingParams(max_tokens=3, temperature=0),
                    stream=True,
                ),
            ),
            ("Embed", "unary_unary", V.EmbedRequest(tokenized=V.TokenizedInput(input_ids=[1]))),
            ("HealthCheck", "unary_unary", V.HealthCheckRequest()),
            ("FlushCache", "unary_unary", V_COMMON.FlushCacheRequest()),
            ("StartProfile", "unary_unary", V_COMMON.StartProfileRequest()),
            ("StopProfile", "unary_unary", V_COMMON.StopProfileRequest()),
            ("Abort", "unary_unary", V.AbortRequest(request_ids=["s"])),
            ("GetModelInfo", "unary_unary", V.GetModelInfoRequest()),
            ("GetServerInfo", "unary_unary", V.GetServerInfoRequest()),
            ("GetLoads", "unary_unary", V.GetLoadsRequest()),
            ("GetTokenizer", "unary_stream", V_COMMON.GetTokenizerRequest()),
            ("SubscribeKvEvents", "unary_stream", V_COMMON.SubscribeKvEventsRequest()),
        )
    },
    f"/{BM}/Info": (
        "unary_unary",
        B.BlockManagerInfoRequest(pool_id=POOL).SerializeToString(),
        "bm",
    ),
    f"/{BM}/Register": (
        "unary_unary",
        B.RegisterPoolRequest(pool_id=POOL, num_blocks=64, block_size=16).SerializeToString(),
        "bm",
    ),
    f"/{BM}/Unregister": (
        "unary_unary",
        B.UnregisterPoolRequest(pool_id=POOL, epoch=1).SerializeToString(),
        "bm",
    ),
    f"/{BM}/Step": (
        "unary_unary",
        B.StepRequest(
            pool_id=POOL, epoch=1, ops=[B.Operation(free=B.FreeOp(seq_ids=[1]))]
        ).SerializeToString(),
        "bm",
    ),
    f"/{BM}/Restore": (
        "unary_unary",
        B.RestoreRequest(pool_id=POOL, epoch=1).SerializeToString(),
        "bm",
    ),
    f"/{BM}/Stats": ("unary_unary", B.PoolStatsRequest(pool_id=POOL).SerializeToString(), "bm"),
    f"/{BM}/StreamEvents": (
        "unary_stream",
        B.StreamEventsRequest(pool_id=POOL).SerializeToString(),
        "bm",
    ),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    from pagedserve.tools.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("fuzz") / "model")
    env = {"PAGEDSERVE_INTERNAL_TOKEN": TOKEN}
    bm = ServiceProcess(
        ["blockmgr", "--port", "0", "--max-pools", "16"], "blockmgr_listening", env=env
    )
    ex_extra = ("--max-model-len", "128", "--pool-id", POOL, "--max-seqs-per-session", "64")
    ex = ServiceProcess(executor_args(model, bm.address, *ex_extra), "executor_ready", env=env)
    gw = ServiceProcess(
        gateway_args(model, ex.address, "--max-n", "4"), "gateway_listening", env=env
    )
    wait_serving(gw.address)
    yield {"bm": bm.address, "ex": ex.address, "gw": gw.address}
    codes = {name: p.stop() for name, p in (("gw", gw), ("ex", ex), ("bm", bm))}
    assert codes == {"gw": 0, "ex": 0, "bm": 0}, codes


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Raw bytes, and the valid request with bytes flipped, inserted, dropped or cut."""
    flips = st.lists(
        st.tuples(st.integers(0, max(len(valid) - 1, 0)), st.integers(0, 255)), max_size=4
    )

    def mutate(data: tuple[list[tuple[int, int]], int, bytes]) -> bytes:
        edits, cut, tail = data
        b = bytearray(valid)
        for i, v in edits:
            if b:
                b[i % len(b)] = v
        return bytes(b[: cut or None]) + tail

    mutated = st.tuples(flips, st.integers(0, len(valid)), st.binary(max_size=8)).map(mutate)
    return st.one_of(st.binary(max_size=64), mutated, st.just(valid))


def _call(channels: dict[str, grpc.Channel], method: str, body: bytes) -> grpc.StatusCode:
    kind, _, target = RPCS[method]
    metadata = () if target == "gw" else ((INTERNAL_TOKEN_HEADER, TOKEN),)
    channel = channels[target]
    try:
        if kind == "unary_unary":
            channel.unary_unary(method)(body, timeout=10, metadata=metadata)
        elif kind == "unary_stream":
            call = channel.unary_stream(method)(body, timeout=10, metadata=metadata)
            # A stream that sends little (a watch of a quiet pool) was accepted: cancel it
            # after a while rather than wait out its deadline.
            quiet = threading.Timer(STREAM_OPEN_S, call.cancel)
            quiet.start()
            try:
                for i, _ in enumerate(call):
                    if i >= 2:
                        call.cancel()
                        break
            finally:
                quiet.cancel()
        else:
            call = channel.stream_stream(method)(iter([body]), timeout=10, metadata=metadata)
            for i, _ in enumerate(call):
                if i >= 1:
                    call.cancel()
                    break
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        if exc.code() in FORBIDDEN:
            raise AssertionError(
                f"{method}: {exc.code().name}: {exc.details()} for {body!r}"
            ) from None
        return exc.code()


def _fuzz(stack: dict[str, str], method: str, cases: int) -> None:
    channels = {name: grpc.insecure_channel(address) for name, address in stack.items()}
    seen: set[grpc.StatusCode] = set()

    @settings(
        max_examples=cases,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_mutations(RPCS[method][1]))
    def run(body: bytes) -> None:
        seen.add(_call(channels, method, body))

    try:
        run()
    finally:
        for ch in channels.values():
            ch.close()
    assert seen, method
    for name, address in stack.items():
        assert check(address, timeout=5)[0], f"{name} stopped serving after fuzzing {method}"


def _no_block_in_use(stack: dict[str, str]) -> None:
    client = GrpcClient(stack["bm"], internal_token=TOKEN)
    deadline = time.monotonic() + 15
    try:
        while client.stats(POOL).counters.num_in_use_blocks:
            assert time.monotonic() < deadline, client.stats(POOL).counters
            time.sleep(0.1)
    finally:
        client.close()


@pytest.mark.parametrize("method", list(RPCS))
def test_fuzzed_rpcs_get_client_errors_never_unknown_or_internal(stack, method) -> None:
    _fuzz(stack, method, SAMPLE)
    _no_block_in_use(stack)


@pytest.mark.soak
@pytest.mark.parametrize("method", list(RPCS))
def test_fuzzed_rpcs_soak(stack, method) -> None:
    _fuzz(stack, method, SOAK)
    _no_block_in_use(stack)


def test_every_rpc_of_every_service_is_fuzzed() -> None:
    from pagedserve.v1 import blockmgr_pb2, executor_pb2, generation_pb2

    declared = {
        f"/{svc.full_name}/{m.name}"
        for module in (blockmgr_pb2, executor_pb2, generation_pb2, V)
        for svc in module.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    assert declared == set(RPCS)
