"""Tensor parallelism on the CPU (gloo): the shard plan, greedy parity of TP=2 and TP=4 with
one rank, the engine at TP=2 under chunked prefill, prefix hits, preemption and
copy-on-write, and a rank that dies.

Each TP runner is real: rank 0 in this process, the other ranks spawned processes that
load their own slices of the checkpoint and follow rank 0's broadcasts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.testing.procs import ROOT
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.model.errors import UnsupportedModelError
from services.executor.model.forward_batch import SeqChunk
from services.executor.model.launch import build_runner
from services.executor.model.loader import read_model_config
from services.executor.model.parallel import ShardPlan, WorkerLost
from services.executor.model.runner import ModelRunner
from services.executor.model.workers import WorkerGroup
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .conftest import load_runner
from .greedy import BlockAllocator, GreedySeq, hf_greedy, run_greedy, shared_prefix_workload

MAX_LEN = 512
# A start-up failure ends it well within this (rank processes start in seconds; several times
# that on a loaded machine), far from the 600 s --distributed-timeout it must not wait for.
STARTUP_BOUND_S = 120
PARITY_MODELS = {
    "kv_heads_divisible": "llama_mha",
    "one_kv_head_replicated": "llama_head_dim",
    "vocab_and_mlp_not_divisible": "llama_odd_sizes",
    "qwen2_qkv_bias": "qwen2",
    "qwen3_qk_norm": "qwen3",
    "phi3_fused_checkpoint": "phi3",
    "tied_embeddings": "llama_tied",
    "mixtral_experts": "mixtral",
    "qwen3_moe_dense_and_sparse_layers": "qwen3_moe",
}


@pytest.fixture
def tp_runner(tiny_checkpoint) -> Iterator:
    """``tp_runner(name, size, **config)``: a fp32 CPU runner of ``size`` ranks, closed at
    the end of the test."""
    runners: list[ModelRunner] = []

    def make(name: str, size: int, **config: object) -> ModelRunner:
        runner = load_runner(
            tiny_checkpoint(name), dtype="float32", tensor_parallel_size=size, **config
        )
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


# ---- the shard plan (pure) --------------------------------------------------------------


def _config(tiny_checkpoint, name: str):
    return read_model_config(tiny_checkpoint(name))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_shards_cover_every_head_row_and_token_exactly_once(tiny_checkpoint, size):
    for name in PARITY_MODELS.values():
        c = _config(tiny_checkpoint, name)
        plans = [ShardPlan.of(c, rank, size) for rank in range(size)]
        q_heads = [h for p in plans for h in range(p.q_head_start, p.q_head_start + p.num_heads)]
        assert q_heads == list(range(c.num_heads))
        inter = [
            i
            for p in plans
            for i in range(p.intermediate_start, p.intermediate_start + p.num_real_intermediate)
        ]
        assert inter == list(range(c.intermediate_size))
        vocab = [v for p in plans for v in range(p.vocab_start, p.vocab_start + p.num_real_vocab)]
        assert vocab == list(range(c.vocab_size))
        group = c.num_heads // c.num_kv_heads
        for p in plans:  # each rank's query heads attend to the KV heads it holds
            kv_of_q = {q // group for q in range(p.q_head_start, p.q_head_start + p.num_heads)}
            assert kv_of_q == set(range(p.kv_head_start, p.kv_head_start + p.num_kv_heads))
            assert p.intermediate_rows * size >= c.intermediate_size
            assert p.vocab_rows * size >= c.vocab_size


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_checkpoint):
    c = _config(tiny_checkpoint, "llama")  # 4 query heads, 2 KV heads
    plans = [ShardPlan.of(c, rank, 4) for rank in range(4)]
    assert [(p.kv_head_start, p.num_kv_heads) for p in plans] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert all(p.local_config(c).num_kv_heads == 1 for p in plans)


def test_padding_of_sizes_the_ranks_do_not_divide(tiny_checkpoint):
    c = _config(tiny_checkpoint, "llama_odd_sizes")
    assert c.vocab_size % 4 and c.intermediate_size % 4
    last = ShardPlan.of(c, 3, 4)
    assert last.intermediate_rows == -(-c.intermediate_size // 4)
    assert last.num_real_intermediate == c.intermediate_size - 3 * last.intermediate_rows
    assert last.num_real_vocab == c.vocab_size - 3 * last.vocab_rows


def test_heads_that_do_not_split_are_refused_naming_the_flag(tiny_checkpoint):
    c = _config(tiny_checkpoint, "llama")
    with pytest.raises(UnsupportedModelError, match="--tensor-parallel-size=3"):
        ShardPlan.of(c, 0, 3)
    with pytest.raises(UnsupportedModelError, match="--tensor-parallel-size=8"):
        ShardPlan.of(c, 0, 8)  # 4 query heads


def test_tensor_parallel_flags_are_parsed_and_checked():
    c = ExecutorConfig.from_args(
        ["--model", "m", "--tensor-parallel-size", "2", "--distributed-timeout", "30"]
    )
    assert (c.tensor_parallel_size, c.distributed_timeout) == (2, 30.0)
    assert c.distributed_init_method is None
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        ExecutorConfig(model="m", tensor_parallel_size=0)


# ---- greedy parity with one rank ----------------------------------------------------------


def _greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[GreedySeq]:
    seqs = [GreedySeq(list(p), 10, start_step=i) for i, p in enumerate(prompts)]
    run_greedy(runner, seqs, allocator=BlockAllocator(runner.num_blocks), chunk_size=12)
    return seqs


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[1, *(rng.randrange(3, vocab_size) for _ in range(n))] for n in (5, 23, 41)]


# Every family at 2 ranks; at 4 only the shapes that split differently there (4 KV heads, a
# replicated KV head, padded vocabulary and MLP rows). MoE at 4 ranks: test_moe.py.
FOUR_RANK_CASES = ("kv_heads_divisible", "one_kv_head_replicated", "vocab_and_mlp_not_divisible")


@pytest.mark.parametrize(
    ("case", "size"),
    [(case, 2) for case in PARITY_MODELS] + [(case, 4) for case in FOUR_RANK_CASES],
)
def test_tensor_parallel_greedy_tokens_and_logits_match_one_rank(
    make_runner, tp_runner, case, size
):
    name = PARITY_MODELS[case]
    one = make_runner(name)
    prompts = _prompts(one.config.vocab_size)
    expected = _greedy(one, prompts)
    runner = tp_runner(name, size, num_kv_blocks=128)
    assert runner.model.shard.size == size and runner.workers is not None
    got = _greedy(runner, prompts)
    for e, g in zip(expected, got, strict=True):
        assert g.output == e.output
        for le, lg in zip(e.logits, g.logits, strict=True):
            torch.testing.assert_close(lg, le, rtol=0, atol=1e-4)


def test_tensor_parallel_matches_transformers_and_copies_blocks_on_every_rank(
    tp_runner, hf_model, prompt_ids
):
    """Copy-on-write runs on each rank's shard: a sequence continued from copied blocks
    decodes exactly as transformers does."""
    runner = tp_runner("llama", 2)
    prompt = prompt_ids[2]
    expected, _ = hf_greedy(hf_model("llama"), prompt, 6)
    allocator = BlockAllocator(runner.num_blocks, seed=3)
    seq = GreedySeq(prompt, 1)
    run_greedy(runner, [seq], allocator=allocator)
    fresh = allocator.allocate(len(seq.block_table))
    runner.copy_blocks(list(zip(seq.block_table, fresh, strict=True)))
    # The copy holds the prompt's K/V on every rank: continue from it alone.
    copy = GreedySeq(prompt, 6, block_table=fresh, num_computed_tokens=len(prompt))
    copy.output = list(seq.output)
    run_greedy(runner, [copy], allocator=allocator)
    assert copy.output == expected


def test_every_rank_replays_its_decode_graphs_in_step(make_runner, tiny_checkpoint):
    """The graph path at TP=2, through the eager replay stand-in on every rank: decode
    batches around the bucket edges replay graphs (the workers into their own persistent
    buffers) and decode exactly as one eager rank does."""
    one = make_runner("llama")
    runner = build_runner(
        ExecutorConfig(
            model=str(tiny_checkpoint("llama")),
            device="cpu",
            dtype="float32",
            num_kv_blocks=128,
            max_model_len=MAX_LEN,
            tensor_parallel_size=2,
            cuda_graph_sizes=(1, 2, 4),
        ).runner_config(),
        graph_backend="eager",
    )
    try:
        assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4)
        prompts = [*_prompts(one.config.vocab_size), [1, 7, 8, 9], [1, 40, 41]]
        expected = _greedy(one, prompts)  # staggered: decode batches of 1 to 5 sequences
        got = _greedy(runner, prompts)
        assert [g.output for g in got] == [e.output for e in expected]
        for e, g in zip(expected, got, strict=True):
            for le, lg in zip(e.logits, g.logits, strict=True):
                torch.testing.assert_close(lg, le, rtol=0, atol=1e-4)
        assert runner.graphs.num_replays > 0
    finally:
        runner.close()


# ---- the engine at TP=2 -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "async_scheduling", "num_kv_blocks"),
    [
        ("llama", False, 14),
        ("llama", True, 13),
        # A hybrid KV cache (a sliding and a full group, one layer each): every rank reads its
        # slot through the broadcast tables of both groups.
        ("gemma3", False, 26),
    ],
)
def test_engine_at_tp2_matches_transformers_under_chunking_prefix_hits_preemption_and_cow(
    tiny_checkpoint, hf_model, name, async_scheduling, num_kv_blocks
):
    model = str(tiny_checkpoint(name))
    work = shared_prefix_workload(
        hf_model(name), seed=5, num_requests=16, prefix_len=40, max_tail=40, max_tokens=(4, 24)
    )
    config = ExecutorConfig(
        model=model,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        num_kv_blocks=num_kv_blocks,  # room for a few sequences: preemption
        max_model_len=176,
        max_num_batched_tokens=24,  # chunked prefill
        async_scheduling=async_scheduling,  # batches built a step early, broadcast patched
    )
    runner = build_runner(config.runner_config())
    try:
        engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
        for i, (prompt, max_tokens, _) in enumerate(work):
            n = 2 if i % 4 == 1 else 1  # n=2 greedy: two samples share the prompt, then COW
            params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens)
            engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
        got: dict[tuple[str, int], list[int]] = {}
        while engine.has_work:
            for o in engine.step():
                got.setdefault((o.req_id.request_id, o.index), []).extend(o.token_ids)
        for i, (_, _, expected) in enumerate(work):
            for index in range(2 if i % 4 == 1 else 1):
                assert got[(f"r{i}", index)] == expected, f"r{i} sample {index}"
        assert engine.scheduler.num_preemptions > 0
        assert engine.num_cached_prompt_tokens > 0
        stats = engine.link.client.stats(engine.link.pool_id)
        assert stats.num_cow_copies > 0
        assert stats.counters.num_in_use_blocks == 0
        assert (engine.num_batches_prepared > 0) == async_scheduling
    finally:
        runner.close()
    assert all(p.exitcode == 0 for p in runner.workers.processes)  # SHUTDOWN, not killed


# ---- a rank that dies ---------------------------------------------------------------------


def test_a_dead_rank_is_reported_while_idle_and_fails_the_next_step(tp_runner):
    runner = tp_runner("llama", 2)
    assert runner.workers is not None
    lost = threading.Event()
    errors: list[WorkerLost] = []
    runner.workers.watch(lambda exc: (errors.append(exc), lost.set()))
    chunk = SeqChunk([1, 5, 9], 0, [1], True)
    runner.execute([chunk])
    pid = runner.workers.processes[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert lost.wait(60), "the watcher did not report the dead rank"
    assert "rank 1" in str(errors[0]) and "-9" in str(errors[0])
    with pytest.raises(WorkerLost):
        runner.execute([chunk])
    with pytest.raises(WorkerLost):
        runner.copy_blocks([(1, 2)])


def test_a_rank_that_cannot_load_its_shard_fails_startup_with_its_reason(tmp_path: Path):
    """Every rank checks the split; here all refuse and rank 0 raises the model error
    without waiting for a timeout."""
    from pagedserve.tools.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "m", num_heads=4, num_kv_heads=2)
    t0 = time.monotonic()
    with pytest.raises(UnsupportedModelError, match="--tensor-parallel-size=3"):
        build_runner(
            ExecutorConfig(model=str(model), device="cpu", tensor_parallel_size=3).runner_config()
        )
    assert time.monotonic() - t0 < STARTUP_BOUND_S  # not --distributed-timeout (600 s)


def test_a_start_up_failure_on_rank_0_alone_stops_the_workers_at_once(tiny_checkpoint, monkeypatch):
    """Rank 0 fails before a start-up collective the workers already wait in: it must not
    wait for them (nor for --distributed-timeout) but kill them."""
    from services.executor.model import launch as model_launch

    def fail(model, config, **kwargs):
        raise RuntimeError("rank 0 cannot size its cache")

    monkeypatch.setattr(model_launch, "size_kv_cache", fail)
    launched: list[WorkerGroup] = []
    real_launch = WorkerGroup.launch

    def launch(*args):
        launched.append(real_launch(*args))
        return launched[-1]

    monkeypatch.setattr(model_launch.WorkerGroup, "launch", launch)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot size"):
        load_runner(tiny_checkpoint("llama"), tensor_parallel_size=2)
    assert time.monotonic() - t0 < STARTUP_BOUND_S  # not --distributed-timeout (600 s)
    assert all(p.exitcode is not None for p in launched[0].processes)


def test_a_checkpoint_error_found_after_the_ranks_are_up_exits_2_and_leaves_no_rank(
    tmp_path: Path,
):
    """A start-up failure after the ranks are up (here a malformed generation_config.json, a
    configuration error: status 2, never restarted) ends the executor and its worker with
    it: no hang at exit."""
    from pagedserve.tools.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "m")
    (model / "generation_config.json").write_text("{not json")
    args = ["executor", "--model", str(model), "--port", "0", "--num-kv-blocks", "32"]
    args += ["--max-model-len", "256", "--tensor-parallel-size", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2
    records = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    events = [r.get("event") for r in records]
    assert "config_error" in events and "tensor_parallel_stopped" in events
    (error,) = [r for r in records if r.get("event") == "config_error"]
    assert "generation_config.json" in json.dumps(error)
    (started,) = [r for r in records if r.get("event") == "tensor_parallel_started"]
    for pid in started["worker_pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---- NCCL, on a host with two GPUs --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per rank)")
@pytest.mark.parametrize("case", ["kv_heads_divisible", "one_kv_head_replicated"])
def test_nccl_tp2_with_cuda_graphs_decodes_as_one_rank(tiny_checkpoint, case):
    """The NCCL path: rank 0 on cuda:0, rank 1 on cuda:1, every rank capturing its decode
    graphs (collectives inside); greedy tokens as one eager rank in fp32."""
    name = PARITY_MODELS[case]
    runners = [
        load_runner(tiny_checkpoint(name), device="cuda", dtype="float32", enforce_eager=True),
        load_runner(
            tiny_checkpoint(name),
            device="cuda",
            dtype="float32",
            tensor_parallel_size=2,
            cuda_graph_sizes=(1, 2, 4, 8),
        ),
    ]
    try:
        prompts = _prompts(runners[0].config.vocab_size)
        expected, got = (_greedy(r, prompts) for r in runners)
        assert [g.output for g in got] == [e.output for e in expected]
        for e, g in zip(expected, got, strict=True):
            for le, lg in zip(e.logits, g.logits, strict=True):
                torch.testing.assert_close(lg.cpu(), le.cpu(), rtol=0, atol=1e-3)
        assert runners[1].graphs is not None and runners[1].graphs.num_replays > 0
    finally:
        for r in runners:
            r.close()
