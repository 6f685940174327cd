"""A block manager recording its workload (``--record-trace``) while a real engine runs against it
over gRPC, and the offline replay of that trace: replayed as recorded it reproduces the live
run's hits, evictions and copies exactly; under other policies and sizes it runs to the end and
prints a row per policy (``pagedserve blockmgr replay``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.blockmgr.api.types import EvictionPolicyName
from services.blockmgr.client import GrpcClient, InProcessClient
from services.blockmgr.service.config import BlockManagerServiceConfig
from services.blockmgr.service.core import BlockManagerCore
from services.blockmgr.trace.record import RegisterRecord, StepRecord, read_trace
from services.blockmgr.trace.replay import replay
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine
from tests.blockmgr.helpers import ThreadedServer

from .greedy import shared_prefix_workload

ROOT = Path(__file__).resolve().parents[2]


def test_a_recorded_trace_replays_to_the_live_runs_hits_and_evictions(
    tiny_checkpoint, hf_model, tmp_path
) -> None:
    trace = tmp_path / "trace.jsonl"
    server = ThreadedServer(
        BlockManagerServiceConfig(port=0, grace_period_s=0.1, record_trace=str(trace))
    )
    client = GrpcClient(server.address, timeout_s=5.0)
    config = ExecutorConfig(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",
        device="cpu",
        block_size=8,
        num_kv_blocks=14,  # small: evictions and preemptions
        max_model_len=96,
        max_num_batched_tokens=32,
    )
    try:
        engine, _ = build_engine(
            config, runner=build_runner(config.runner_config()), blockmgr=client
        )
        work = shared_prefix_workload(
            hf_model("llama"),
            seed=9,
            num_requests=16,
            prefix_len=24,
            max_tail=20,
            max_tokens=(4, 16),
        )
        for i, (prompt, max_tokens, _) in enumerate(work):
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, n=2 if i % 5 == 0 else 1
            )
            engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
        while engine.has_work:
            engine.step()
        live = client.stats(engine.link.pool_id)
    finally:
        client.close()
        server.stop()
    assert live.prefix_cache_hits_tokens > 0 and live.num_evicted_blocks > 0
    assert live.num_cow_copies > 0 and engine.scheduler.num_preemptions > 0

    records = list(read_trace(trace))
    assert isinstance(records[0], RegisterRecord) and records[0].spec.num_blocks == 14
    assert sum(isinstance(r, StepRecord) for r in records) > 10
    again = replay(records)
    assert (again.queries_tokens, again.hits_tokens) == (
        live.prefix_cache_queries_tokens,
        live.prefix_cache_hits_tokens,
    )
    assert (again.num_evicted_blocks, again.num_cow_copies, again.num_dropped) == (
        live.num_evicted_blocks,
        live.num_cow_copies,
        0,
    )
    # Room for everything: nothing refused, dropped or evicted. (Not more hits for sure: the
    # live run's retried admissions, which hit what others committed meanwhile, went through
    # at their first attempt here.)
    # The same device pool with a host tier: what is evicted goes down to it.
    tiered = replay(records, host_blocks=64)
    assert tiered.num_offloaded_blocks == live.num_evicted_blocks
    assert tiered.hits_tokens >= again.hits_tokens
    bigger = replay(records, policy=EvictionPolicyName.ARC, num_blocks=200)
    assert (bigger.num_refused_admissions, bigger.num_dropped, bigger.num_evicted_blocks) == (
        0,
        0,
        0,
    )

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.blockmgr",
            "replay",
            str(trace),
            "--policy",
            "recorded,lru,lfu,arc,s3fifo",
            "--device-blocks",
            "12",
            "--host-blocks",
            "8",
            "--tier-policy",
            "lru,s3fifo",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in rows[1:]]
    assert cells == [
        (policy, tier)
        for policy in ("recorded", "lru", "lfu", "arc", "s3fifo")
        for tier in ("lru", "s3fifo")
    ]


def test_a_requests_kv_retention_priority_reaches_its_cached_blocks(tiny_checkpoint) -> None:
    core = BlockManagerCore()
    config = ExecutorConfig(
        model=str(tiny_checkpoint("llama")), dtype="float32", device="cpu", block_size=8
    )
    engine, _ = build_engine(
        config, runner=build_runner(config.runner_config()), blockmgr=InProcessClient(core)
    )
    prompt = list(range(5, 45))  # 5 full blocks
    for i, priority in enumerate((2, 0)):
        params = SamplingParams(temperature=0.0, max_tokens=2, kv_retention_priority=priority)
        engine.add_request(RequestKey(0, f"r{i}"), [1, i + 1, *prompt], params)
        while engine.has_work:
            engine.step()
    levels = core.manager(engine.link.pool_id).pool.pins.levels
    assert sorted(set(levels.priority.values())) == [2] and len(levels.priority) == 5
    assert len(levels.levels[2]) == 5  # free and cached, evicted after priority 0
