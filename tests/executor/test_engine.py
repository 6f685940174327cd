"""The engine with the tiny Llama: token-identical to transformers under greedy decoding,
whatever the batching, chunking, preemption, prefix caching or block-manager transport."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.client import GrpcClient, InProcessClient
from services.blockmgr.service.config import BlockManagerServiceConfig
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine
from tests.blockmgr.helpers import ThreadedServer

from .greedy import shared_prefix_workload

NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def workload(llama, hf_model) -> list[tuple[list[int], int, list[int]]]:
    """32 (prompt, max_tokens, transformers' greedy output); half share a 40-token prefix."""
    return shared_prefix_workload(
        hf_model("llama"),
        seed=0,
        num_requests=NUM_REQUESTS,
        prefix_len=40,
        max_tail=50,
        max_tokens=(1, 24),
    )


def _engine(
    model: str, client: BlockManagerClient | None = None, launch_first: bool = False, **kw
) -> Engine:
    """``launch_first``: the runner claims its launch returns before the device is done (as
    on CUDA), so async scheduling plans the next step after the launch."""
    kw.setdefault("max_model_len", 512)
    config = ExecutorConfig(model=model, dtype="float32", device="cpu", **kw)
    runner = build_runner(config.runner_config())
    if launch_first:
        runner.launch_returns_early = True  # type: ignore[attr-defined]
    engine, _ = build_engine(config, runner=runner, blockmgr=client or InProcessClient())
    return engine


def _run_staggered(engine: Engine, workload, per_step: int = 4) -> dict[str, list[int]]:
    """Requests arrive a few per step while earlier ones are running."""
    got: dict[str, list[int]] = {}
    pending = list(enumerate(workload))
    while pending or engine.has_work:
        for i, (prompt, max_tokens, _) in pending[:per_step]:
            engine.add_request(
                RequestKey(0, f"r{i}"),
                prompt,
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
            )
        pending = pending[per_step:]
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    return got


def _assert_matches(got: dict[str, list[int]], workload) -> None:
    for i, (_, _, expected) in enumerate(workload):
        assert got[f"r{i}"] == expected, f"request r{i}"


def _assert_pool_empty(engine: Engine) -> None:
    c = engine.link.client.stats(engine.link.pool_id).counters
    assert c.num_in_use_blocks == 0 and c.num_free_blocks == c.num_usable_blocks


CONFIGS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "no_chunked_prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
    "small_budget": {"max_num_batched_tokens": 24},
    "tiny_kv_cache": {"num_kv_blocks": 12, "max_model_len": 176},
    "block_size_32": {"block_size": 32, "num_kv_blocks": 40},
    "async_scheduling": {"async_scheduling": True},
    "async_tiny_kv_cache": {"async_scheduling": True, "num_kv_blocks": 12, "max_model_len": 176},
    "async_launch_first": {"async_scheduling": True, "launch_first": True},
}


def _assert_round_trips(engine: Engine) -> None:
    """One Step per iteration; with async scheduling, decode steps got theirs a step early."""
    if engine.settings.async_scheduling:
        assert engine.num_steps_ahead > 0 and engine.num_bad_answers == 0
    else:
        assert engine.link.num_round_trips == engine.num_steps


@pytest.mark.parametrize("name", list(CONFIGS))
def test_32_concurrent_requests_match_transformers_greedy(llama, workload, name):
    kw = {"num_kv_blocks": 96, "max_num_batched_tokens": 128, **CONFIGS[name]}
    engine = _engine(llama, **kw)
    _assert_matches(_run_staggered(engine, workload), workload)
    if name == "default":
        assert engine.link.client.stats(engine.link.pool_id).prefix_cache_hits_tokens > 0
    _assert_round_trips(engine)
    _assert_pool_empty(engine)


@pytest.fixture
def grpc_blockmgr() -> Iterator[ThreadedServer]:
    server = ThreadedServer()
    yield server
    server.stop()


@pytest.mark.parametrize("name", ["default", "tiny_kv_cache", "async_tiny_kv_cache"])
def test_same_tokens_with_the_block_manager_over_grpc(llama, workload, grpc_blockmgr, name):
    kw = {"num_kv_blocks": 96, "max_num_batched_tokens": 128, **CONFIGS[name]}
    client = GrpcClient(grpc_blockmgr.address)
    engine = _engine(llama, client, **kw)
    _assert_matches(_run_staggered(engine, workload), workload)
    _assert_round_trips(engine)
    _assert_pool_empty(engine)
    client.close()


@pytest.fixture(scope="module")
def long_workload(llama, hf_model) -> list[tuple[list[int], int, list[int]]]:
    """8 requests whose outputs outgrow a 15-block cache together: preemption must happen."""
    rng = random.Random(1)
    hf = hf_model("llama")
    out = []
    for _ in range(8):
        prompt = [1] + [rng.randrange(3, 600) for _ in range(rng.randrange(8, 30))]
        max_tokens = rng.randrange(60, 100)
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        out.append((prompt, max_tokens, ids))
    return out


@pytest.mark.parametrize("transport", ["inproc", "grpc", "grpc_async"])
def test_preemption_by_recompute_keeps_outputs_identical(llama, long_workload, transport):
    server = ThreadedServer() if transport != "inproc" else None
    client = GrpcClient(server.address) if server else InProcessClient()
    try:
        engine = _engine(
            llama,
            client,
            num_kv_blocks=16,
            max_model_len=240,
            max_num_batched_tokens=64,
            async_scheduling=transport == "grpc_async",
            launch_first=transport == "grpc_async",
        )
        _assert_matches(_run_staggered(engine, long_workload, per_step=8), long_workload)
        assert engine.scheduler.num_preemptions > 0
        _assert_round_trips(engine)
        _assert_pool_empty(engine)
    finally:
        client.close()
        if server:
            server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generation_survives_a_block_manager_restart(llama, workload, async_scheduling):
    port = _free_port()
    config = BlockManagerServiceConfig(port=port, grace_period_s=0.1)
    server = ThreadedServer(config)
    client = GrpcClient(f"127.0.0.1:{port}", timeout_s=2.0)
    health: list[bool] = []
    outage_seen = threading.Event()

    def on_health(healthy: bool) -> None:
        health.append(healthy)
        if not healthy:
            outage_seen.set()

    config_e = ExecutorConfig(
        model=llama,
        dtype="float32",
        device="cpu",
        num_kv_blocks=96,
        max_num_batched_tokens=128,
        max_model_len=512,
        async_scheduling=async_scheduling,
    )
    engine, _ = build_engine(
        config_e,
        runner=build_runner(config_e.runner_config()),
        blockmgr=client,
        on_health=on_health,
    )
    got: dict[str, list[int]] = {}
    for i, (prompt, max_tokens, _) in enumerate(workload):
        engine.add_request(
            RequestKey(0, f"r{i}"), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
        )
    for _ in range(6):
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    while async_scheduling and engine.num_steps_ahead < 3:  # the next Step goes ahead
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    old_epoch = engine.link.epoch
    server.stop()  # the block manager dies with every table it had

    restarted: list[ThreadedServer] = []

    def restart_later() -> None:  # once the engine has met the outage (or after a minute)
        outage_seen.wait(60)
        restarted.append(ThreadedServer(config))

    t = threading.Thread(target=restart_later)
    t.start()
    while engine.has_work:  # the first step blocks until the new block manager answers
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    t.join()
    _assert_matches(got, workload)
    assert engine.link.epoch != old_epoch and engine.link.num_recoveries == 1
    assert health[:2] == [False, True]
    assert engine.num_ahead_failures == async_scheduling  # the Step sent ahead hit the outage
    _assert_pool_empty(engine)
    client.close()
    restarted[0].stop()


def test_seeded_sampling_is_reproducible_regardless_of_batch(llama, workload):
    params = SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        seed=1234,
        max_tokens=20,
        logprobs=3,
    )
    prompt = workload[3][0]

    def sample(extra: int, async_scheduling: bool = False) -> tuple[list[int], list[float]]:
        engine = _engine(llama, num_kv_blocks=96, async_scheduling=async_scheduling)
        for i in range(extra):
            engine.add_request(
                RequestKey(0, f"x{i}"),
                workload[i + 5][0],
                SamplingParams(temperature=1.0, max_tokens=25),
            )
        engine.add_request(RequestKey(0, "seeded"), prompt, params)
        toks: list[int] = []
        lps: list[float] = []
        while engine.has_work:
            for o in engine.step():
                if o.req_id.request_id == "seeded":
                    toks += o.token_ids
                    lps += [lp.logprob for lp in o.logprobs]
                    assert all(len(lp.top) == 3 for lp in o.logprobs)
        return toks, lps

    alone_tokens, alone_logprobs = sample(0)
    assert len(alone_tokens) == 20
    for extra, async_scheduling in ((7, False), (3, False), (7, True)):
        tokens, logprobs = sample(extra, async_scheduling)
        assert tokens == alone_tokens
        # Logprobs only differ by float reduction order across batch shapes.
        assert logprobs == pytest.approx(alone_logprobs, abs=1e-4)


def test_parallel_samples_share_prompt_blocks_and_copy_on_write(llama, workload):
    engine = _engine(llama, num_kv_blocks=96)
    prompt = workload[1][0]  # 40+ tokens: several full blocks and a partial one
    engine.add_request(
        RequestKey(0, "n4"), prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12)
    )
    outs: dict[int, list[int]] = {}
    finals = {}
    engine.step()
    engine.step()
    stats = engine.link.client.stats(engine.link.pool_id)
    prompt_blocks = -(-len(prompt) // 16)
    assert stats.counters.num_in_use_blocks < 4 * prompt_blocks
    if len(prompt) % 16:
        assert stats.num_cow_copies == 3
    engine2 = engine
    while engine2.has_work:
        for o in engine2.step():
            outs.setdefault(o.index, []).extend(o.token_ids)
            if o.finish_reason is not None:
                finals[o.index] = o.usage
    assert set(finals) == {0, 1, 2, 3}
    assert all(u.prompt_tokens == len(prompt) for u in finals.values())
    _assert_pool_empty(engine)


def test_async_batches_built_ahead_survive_aborts_and_finishes_between_steps(llama, workload):
    """Each next batch is built before this step's sampling; requests that finish or are
    aborted in between run as rows that write nothing, and every other output is exact."""
    engine = _engine(llama, num_kv_blocks=96, max_num_batched_tokens=128, async_scheduling=True)
    for i, (prompt, max_tokens, _) in enumerate(workload):
        engine.add_request(
            RequestKey(0, f"r{i}"), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
        )
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    step = 0
    while engine.has_work:
        step += 1
        if step % 3 == 0 and engine.num_batches_prepared:
            victim = next((k for k in sorted(engine.requests) if k.request_id not in aborted), None)
            if victim is not None and len(aborted) < 6:
                assert engine.abort_request(victim)
                aborted.add(victim.request_id)
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    assert len(aborted) == 6 and engine.num_batches_prepared > 0
    for i, (_, _, expected) in enumerate(workload):
        rid = f"r{i}"
        if rid in aborted:
            assert expected[: len(got.get(rid, []))] == got.get(rid, []), rid
        else:
            assert got[rid] == expected, rid
    _assert_pool_empty(engine)
