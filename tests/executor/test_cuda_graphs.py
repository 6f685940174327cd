"""Decode graphs: bucketing, padding and the persistent input buffers, exercised on the CPU
through the eager stand-in for replay (it re-runs the captured forward over the same
buffers); the real CUDA graphs are checked by the ``gpu`` tests at the end."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.model.cuda_graphs import (
    VERIFY_CAPTURE_TOKENS,
    CudaGraphBackend,
    EagerGraphBackend,
    graph_keys,
    graph_output_bytes,
)
from services.executor.model.forward_batch import GraphKey, SeqChunk
from services.executor.model.launch import build_runner
from services.executor.model.runner import ModelRunner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .conftest import load_runner
from .greedy import BlockAllocator, shared_prefix_workload

SIZES = (1, 2, 4, 8)


def test_capture_sizes_follow_vllms_scheme_or_the_flag() -> None:
    def sizes(**kw: object) -> tuple[int, ...]:
        return ExecutorConfig(model="m", **kw).capture_sizes  # type: ignore[arg-type]

    assert sizes(max_num_seqs=1) == (1,)
    assert sizes(max_num_seqs=5) == (1, 2, 4, 8)
    assert sizes(max_num_seqs=17) == (1, 2, 4, 8, 16, 24)
    full = sizes(max_num_seqs=256)
    assert full[:5] == (1, 2, 4, 8, 16) and full[-1] == 256 and len(full) == 35
    assert sizes(cuda_graph_sizes=(3, 6)) == (3, 6)
    argv = ["--model", "m", "--cuda-graph-sizes", "8,1, 4", "--enforce-eager"]
    parsed = ExecutorConfig.from_args(argv)
    assert parsed.cuda_graph_sizes == (1, 4, 8) and parsed.enforce_eager
    with pytest.raises(ValueError, match="cuda-graph-sizes"):
        ExecutorConfig(model="m", cuda_graph_sizes=(0, 4))


def _prefilled(runner: ModelRunner, num_seqs: int, seed: int) -> list[SeqChunk]:
    """``num_seqs`` sequences of different lengths prefilled eagerly; returns the decode
    chunk of each (one token, at a position that is sometimes a block boundary)."""
    rng = random.Random(seed)
    alloc = BlockAllocator(runner.num_blocks, seed)
    decode = []
    for _ in range(num_seqs):
        n = rng.choice([3, 15, 16, 17, 31, 40])
        prompt = [rng.randrange(3, 600) for _ in range(n)]
        table = alloc.allocate(-(-(n + 1) // runner.block_size))
        runner.execute([SeqChunk(prompt, 0, table, True)])
        decode.append(SeqChunk([rng.randrange(3, 600)], n, table, True))
    return decode


def test_replay_matches_eager_decode_at_every_batch_size_around_the_bucket_edges(
    make_runner: Callable[..., ModelRunner],
) -> None:
    runner = make_runner("llama", block_size=16, num_blocks=128)
    runner.capture_decode_graphs(SIZES, EagerGraphBackend())
    graphs = runner.graphs
    assert graphs is not None and graphs.num_captures == len(SIZES)
    for num_seqs in range(1, 11):
        decode = _prefilled(runner, num_seqs, seed=num_seqs)
        runner.graphs = None
        eager = runner.execute(decode)
        cache_after_eager = runner.kv_cache.clone()
        runner.graphs = graphs
        replays = graphs.num_replays
        graphed = runner.execute(decode)  # writes the same K/V again: idempotent
        assert graphed.shape == eager.shape == (num_seqs, runner.config.vocab_size)
        torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-4)
        assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
        # Padding sequences wrote nowhere: not into the reserved block 0, nor any block
        # outside the real tables. (The real K/V may differ in the last bits: a padded
        # batch is a matmul of another shape.)
        used = sorted({b for c in decode for b in c.block_table})
        untouched = [b for b in range(runner.num_blocks) if b not in used]
        assert torch.equal(runner.kv_cache[:, :, untouched], cache_after_eager[:, :, untouched])
        torch.testing.assert_close(runner.kv_cache, cache_after_eager, rtol=0, atol=1e-5)
        assert graphs.num_replays == replays + (num_seqs <= max(SIZES))
    assert graphs.num_captures == len(SIZES)  # nothing was captured again


def test_prefill_and_mixed_steps_stay_eager(make_runner: Callable[..., ModelRunner]) -> None:
    runner = make_runner("llama", block_size=16, num_blocks=64)
    runner.capture_decode_graphs(SIZES, EagerGraphBackend())
    assert runner.graphs is not None
    decode = _prefilled(runner, 2, seed=0)
    prefill = SeqChunk([5, 6, 7], 0, [60, 61], True)
    not_last = SeqChunk([9], 0, [62], need_logits=False)  # a one-token prefill chunk
    assert runner.graphs.bucket([*decode, prefill]) is None
    assert runner.graphs.bucket([not_last]) is None
    assert runner.graphs.bucket(decode) == GraphKey(2)
    assert runner.graphs.bucket(decode * 5) is None  # 10 > the largest size


def _verifying_chunks(runner: ModelRunner) -> list[SeqChunk]:
    """Three prefilled sequences (on ``runner``, seeded alike for every runner), then a
    verifying step: 1 + 3 drafts with every row, one plain decode token, 1 + 1 draft."""
    rng = random.Random(5)
    alloc = BlockAllocator(runner.num_blocks, 5)
    chunks = []
    for n, new, every in ((15, 4, True), (16, 1, False), (30, 2, True)):
        prompt = [rng.randrange(3, 600) for _ in range(n)]
        table = alloc.allocate(-(-(n + 4) // runner.block_size))
        runner.execute([SeqChunk(prompt, 0, table, True)])
        tokens = [rng.randrange(3, 600) for _ in range(new)]
        chunks.append(SeqChunk(tokens, n, table, True, all_logits=every))
    return chunks


def test_verification_graphs_compute_what_eager_steps_do(
    make_runner: Callable[..., ModelRunner],
) -> None:
    """A verifying step (1 + k tokens a sequence, fewer for some) replays the graph of
    ``1 + k`` queries: the same logits rows as the eager forward, in the same order, and the
    same cache afterwards (the padding queries after a sequence's own write nowhere)."""
    graphed = make_runner("llama", block_size=8, num_blocks=64)
    graphed.capture_decode_graphs((1, 2, 4, 8, 16), EagerGraphBackend(), verify_query_len=4)
    graphs = graphed.graphs
    assert graphs is not None and graphs.verify_sizes == (1, 2, 4, 8, 16)
    assert graphs.num_captures == 5 + 5
    eager = make_runner("llama", block_size=8, num_blocks=64)
    chunks = _verifying_chunks(graphed)
    assert graphs.bucket(chunks) == GraphKey(4, 4)
    assert _verifying_chunks(eager) == chunks
    expected = eager.execute(chunks)
    got = graphed.execute(chunks)
    assert graphs.num_verify_replays == 1
    assert got.shape == expected.shape == (4 + 1 + 2, eager.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, rtol=1e-5, atol=1e-5)


def test_the_kv_cache_sizing_sets_aside_every_graphs_logits() -> None:
    """Each captured graph keeps its fp32 logits for good (an H200 measured 618 MB of graphs
    for 35 decode sizes over a 32,000-token vocabulary, 541 MB of them logits)."""
    assert graph_keys((1, 2, 4, 8), 3) == [
        *(GraphKey(s) for s in (1, 2, 4, 8)),
        *(GraphKey(s, 3) for s in (1, 2, 4, 8)),
    ]
    assert graph_output_bytes((1, 2, 4, 8), 3, 100) == (15 + 15 * 3) * 100 * 4
    assert graph_output_bytes((), 3, 100) == 0
    sizes = ExecutorConfig(model="m", max_num_seqs=256).capture_sizes
    assert graph_output_bytes(sizes, 1, 32000) == 4231 * 32000 * 4


def test_verification_graphs_cover_a_lone_sequence_and_stop_at_512_tokens() -> None:
    """A batch of one verifies under a graph too (an H200 ran batch-1 speculation eagerly
    when verification graphs had to fit within the largest decode graph's tokens); at 256
    sequences and 1 + 4 tokens each, the verification graphs stop at 96 sequences (480
    tokens), and larger verifying steps run eagerly."""
    assert graph_keys((1,), 5) == [GraphKey(1), GraphKey(1, 5)]
    sizes = ExecutorConfig(model="m", max_num_seqs=256).capture_sizes
    verify = [k.num_seqs for k in graph_keys(sizes, 5) if k.query_len == 5]
    assert verify == [s for s in sizes if s <= 96] and max(sizes) == 256
    assert max(verify) * 5 <= VERIFY_CAPTURE_TOKENS < (max(verify) + 8) * 5


def test_steps_the_verification_graphs_cannot_take_run_eagerly(
    make_runner: Callable[..., ModelRunner],
) -> None:
    runner = make_runner("llama", block_size=8, num_blocks=64)
    runner.capture_decode_graphs((1, 2, 4, 8), EagerGraphBackend(), verify_query_len=3)
    graphs = runner.graphs
    assert graphs is not None and graphs.verify_sizes == (1, 2, 4, 8)
    two = SeqChunk([5, 6], 10, [1, 2], True, all_logits=True)
    assert graphs.bucket([two]) == GraphKey(1, 3)
    assert graphs.bucket([two] * 3) == GraphKey(4, 3)
    assert graphs.bucket([two] * 9) is None  # over the largest graph
    assert graphs.bucket([SeqChunk([5, 6, 7, 8], 10, [1, 2], True)]) is None  # over 1 + k
    near_end = SeqChunk([5], runner.config.max_model_len - 2, [1] * 32, True, all_logits=True)
    assert graphs.bucket([near_end, two]) is None  # its padding would pass max_model_len
    assert graphs.bucket([near_end]) == GraphKey(1)  # (a plain decode token)


def _graphed_engine(model: str, sizes: tuple[int, ...] = SIZES, **kw: object) -> Engine:
    kw.setdefault("max_model_len", 512)
    config = ExecutorConfig(model=model, dtype="float32", device="cpu", **kw)  # type: ignore[arg-type]
    runner = build_runner(config.runner_config())
    runner.capture_decode_graphs(sizes, EagerGraphBackend())
    engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
    return engine


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_over_graphs_gives_transformers_tokens_with_preemption_and_prefix_hits(
    llama, hf_model, async_scheduling
) -> None:
    """Batches grow and shrink across the bucket edges (1..12 running), the small cache
    forces preemption by recompute, and half the prompts share a prefix. With async
    scheduling the padded graph batches are built a step early and completed at launch."""
    cases = shared_prefix_workload(
        hf_model("llama"), seed=3, num_requests=12, prefix_len=21, max_tail=12, max_tokens=(20, 60)
    )
    engine = _graphed_engine(
        llama,
        num_kv_blocks=24 if not async_scheduling else 20,  # admissions go a step later
        max_model_len=112,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    got: dict[str, list[int]] = {}
    pending = list(enumerate(cases))
    while pending or engine.has_work:
        for i, (prompt, max_tokens, _) in pending[:2]:
            engine.add_request(
                RequestKey(0, f"r{i}"),
                prompt,
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
            )
        pending = pending[2:]
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    for i, (_, _, expected) in enumerate(cases):
        assert got[f"r{i}"] == expected, f"request r{i}"
    assert engine.scheduler.num_preemptions > 0
    assert graphs.num_replays > 0 and graphs.num_captures == len(SIZES)
    assert (engine.num_batches_prepared > 0) == async_scheduling


def test_parallel_samples_copy_on_write_under_graphs_match_one_sample(llama) -> None:
    """n=3 greedy samples fork after the prompt and copy the shared partial block on their
    first write: every sample must equal the single-sample run, all decoded through graphs."""
    prompt = [1, *range(40, 60)]  # 21 tokens: one full block and a shared partial one
    engine = _graphed_engine(llama, num_kv_blocks=64)
    engine.add_request(RequestKey(0, "one"), prompt, SamplingParams(temperature=0, max_tokens=12))
    engine.add_request(
        RequestKey(0, "three"), prompt, SamplingParams(n=3, temperature=0, max_tokens=12)
    )
    outs: dict[tuple[str, int], list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            outs.setdefault((o.req_id.request_id, o.index), []).extend(o.token_ids)
    assert len(outs[("one", 0)]) == 12
    for i in range(3):
        assert outs[("three", i)] == outs[("one", 0)]
    assert engine.link.client.stats(engine.link.pool_id).num_cow_copies >= 2
    assert engine.runner.graphs.num_replays > 0  # type: ignore[attr-defined]


# ---- on a GPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_mixtures_of_experts_decode_through_the_graphs_as_eagerly(tiny_checkpoint, name) -> None:
    """Routing (top-k over the gate) and the fused experts run inside the captured forward:
    replayed over the persistent buffers, greedy tokens equal the eager engine's."""
    model = str(tiny_checkpoint(name))
    outputs = []
    for eager in (True, False):
        config = ExecutorConfig(
            model=model,
            dtype="float32",
            device="cpu",
            num_kv_blocks=128,
            max_model_len=256,
            enforce_eager=eager,
            cuda_graph_sizes=SIZES,
        )
        runner = build_runner(config.runner_config(), graph_backend=None if eager else "eager")
        engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
        rng = random.Random(1)
        got: dict[str, list[int]] = {}
        for i in range(6):
            prompt = [1] + [rng.randrange(3, 600) for _ in range(rng.randrange(3, 40))]
            params = SamplingParams(temperature=0.0, max_tokens=3 + 3 * i)
            engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
        while engine.has_work:
            for o in engine.step():
                got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
        outputs.append(got)
        graphs = runner.graphs
        assert (graphs is None) if eager else (graphs is not None and graphs.num_replays > 0)
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen2",
        "qwen3",
        "phi4_mini",
        "mistral_window",
        "gemma2",
        "gemma3",
        "mixtral",
        "qwen3_moe",
    ],
)
def test_cuda_graphs_and_eager_give_identical_greedy_tokens_in_fp32(tiny_checkpoint, name):
    model = str(tiny_checkpoint(name))
    outputs = []
    for eager, async_scheduling in ((True, False), (False, False), (False, True)):
        config = ExecutorConfig(
            model=model,
            dtype="float32",
            device="cuda",
            num_kv_blocks=256,
            max_model_len=512,
            enforce_eager=eager,
            cuda_graph_sizes=SIZES,
            async_scheduling=async_scheduling,
        )
        engine, _ = build_engine(config, blockmgr=InProcessClient())
        assert (engine.runner.graphs is None) == eager  # type: ignore[attr-defined]
        # Gemma: a hybrid pool, the graphs reading both groups' tables from their buffers.
        assert engine.scheduler.config.num_kv_groups == (2 if name.startswith("gemma") else 1)
        rng = random.Random(0)
        got: dict[str, list[int]] = {}
        for i in range(10):  # outputs of 4-40 tokens: the batch shrinks through the graphs' sizes
            prompt = [1] + [rng.randrange(3, 600) for _ in range(rng.randrange(3, 60))]
            params = SamplingParams(temperature=0.0, max_tokens=4 + 4 * i)
            engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
        while engine.has_work:
            for o in engine.step():
                got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
        outputs.append(got)
        if not eager:
            graphs = engine.runner.graphs  # type: ignore[attr-defined]
            assert graphs.num_replays > 0 and graphs.num_captures == len(SIZES)
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.gpu
def test_no_recapture_and_no_memory_growth_at_steady_state(tiny_checkpoint) -> None:
    runner = load_runner(
        tiny_checkpoint("llama"),
        dtype="float32",
        device="cuda",
        num_kv_blocks=256,
        max_model_len=512,
        enforce_eager=True,  # no default capture: this test captures SIZES itself
    )
    runner.capture_decode_graphs(SIZES, CudaGraphBackend())
    graphs = runner.graphs
    assert graphs is not None
    decode = _prefilled(runner, 8, seed=1)
    for n in (8, 3, 1, 5):  # warm every bucket once
        runner.execute(decode[:n])
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    replays = graphs.num_replays
    for step in range(200):
        n = 1 + step % 8
        logits = runner.execute(decode[:n])
        assert logits.shape[0] == n
    torch.cuda.synchronize()
    assert graphs.num_captures == len(SIZES)
    assert graphs.num_replays == replays + 200
    assert torch.cuda.memory_reserved() == reserved
