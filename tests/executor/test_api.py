"""The engine facade (``services.executor.api``): built from a model directory and flags,
greedy tokens equal to transformers', every block back after ``close``, the runner hook
around every forward."""

from __future__ import annotations

import pytest
import torch

from services.blockmgr.client import InProcessClient
from services.executor.api import (
    EngineError,
    ExecutorConfig,
    FinishReason,
    ForwardInfo,
    InProcessEngine,
    LoadedModel,
    RequestErrorCode,
    SamplingParams,
)
from services.executor.model import cpu_threads
from services.executor.model.loader import load_tokenizer

from .greedy import hf_greedy, shared_prefix_workload


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def workload(hf_model) -> list[tuple[list[int], int, list[int]]]:
    """8 (prompt, max_tokens, transformers' greedy output); half share a 40-token prefix."""
    return shared_prefix_workload(
        hf_model("llama"), seed=1, num_requests=8, prefix_len=40, max_tail=30, max_tokens=(1, 16)
    )


def _config(model: str, **flags) -> ExecutorConfig:
    flags = {
        "num_kv_blocks": 64,
        "max_model_len": 512,
        "max_num_batched_tokens": 128,
        "cpu_threads": 1,
        **flags,
    }
    return ExecutorConfig(model=model, dtype="float32", device="cpu", **flags)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


@pytest.mark.parametrize("flags", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_generate_matches_transformers_greedy(llama, workload, flags):
    with InProcessEngine(_config(llama, **flags)) as engine:
        outs = engine.generate([p for p, _, _ in workload], [greedy(n) for _, n, _ in workload])
        assert [o.request_id for o in outs] == [f"request-{i}" for i in range(len(workload))]
        for out, (prompt, n, expected) in zip(outs, workload, strict=True):
            (sample,) = out.outputs
            assert list(sample.token_ids) == expected
            assert out.prompt_token_ids == tuple(prompt)
            assert sample.finish_reason is (
                FinishReason.LENGTH if len(expected) == n else FinishReason.STOP
            )
        assert sum(o.num_cached_tokens for o in outs) > 0  # the shared prefix was hit
        assert engine.kv_stats().prefix_cache_hits_tokens > 0


def test_from_cli_flags_and_text_prompts(llama, hf_model):
    tokenizer = load_tokenizer(llama)
    text = "A good cup of tea needs only three things"
    ids = tokenizer(text).input_ids
    expected, _ = hf_greedy(hf_model("llama"), ids, 6)
    flags = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32"]
    with InProcessEngine.from_cli(llama, [*flags, "--max-model-len", "256"]) as engine:
        assert engine.config.num_kv_blocks == 32 and engine.served.max_model_len == 256
        (out,) = engine.generate([text], greedy(6))
        assert list(out.outputs[0].token_ids) == expected
        assert out.prompt_token_ids == tuple(ids)
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    with pytest.raises(ValueError, match="invalid executor flags"):
        InProcessEngine.from_cli(llama, ["--block-size", "three"])


def test_kv_stats_after_close_show_no_block_in_use(llama, workload):
    engine = InProcessEngine(_config(llama))
    for prompt, _, _ in workload:
        engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    live = engine.kv_stats().counters
    running = engine.stats().num_running
    assert live.num_in_use_blocks > 0 and live.num_sequences == running > 1
    usage = engine.kv_usage()
    assert usage.num_seqs == running
    assert usage.num_distinct_blocks < usage.num_blocks  # the shared prefix, counted once
    assert 0 <= usage.max_seq_unused_slots < engine.served.block_size
    engine.close()
    c = engine.kv_stats().counters
    assert c.num_in_use_blocks == 0 and c.num_sequences == 0
    assert c.num_free_blocks == c.num_usable_blocks
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


@pytest.mark.parametrize("flags", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_runner_hook_is_called_once_per_forward(llama, flags):
    calls: list[ForwardInfo] = []

    def hook(info, forward):
        calls.append(info)
        return forward()

    prompt = [1, *range(5, 25)]
    with InProcessEngine(_config(llama, **flags), runner_hook=hook) as engine:
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 5
        # one forward computes the prompt, four decode the next tokens (the fifth is sampled
        # from the fourth's logits)
        assert len(calls) == 5 == engine.stats().num_steps
    assert calls[0] == ForwardInfo(1, len(prompt), len(prompt))
    assert all(c.is_decode for c in calls[1:])
    assert [c.num_context_tokens for c in calls[1:]] == [len(prompt) + i for i in range(1, 5)]


def test_cpu_decode_threads_run_small_steps_on_fewer_threads_with_transformers_tokens(
    llama, hf_model, monkeypatch
):
    """``--cpu-decode-threads 1`` beside ``--cpu-threads 2``: the 300-token prompt's step runs
    on 2 threads, the decode steps on 1, and the tokens are transformers'. (The tiny model's
    small-step bound is set to 256 of its tokens.)"""
    params = sum(p.numel() for p in hf_model("llama").parameters())
    monkeypatch.setattr(cpu_threads, "SMALL_STEP_WORK", 256 * params)
    prompt = [1, *(5 + (i * 7) % 200 for i in range(299))]
    expected, _ = hf_greedy(hf_model("llama"), prompt, 6)
    threads: list[tuple[int, int]] = []  # (tokens of the step, torch threads it ran on)

    def hook(info, forward):
        out = forward()
        threads.append((info.num_tokens, torch.get_num_threads()))
        return out

    flags = {"cpu_threads": 2, "cpu_decode_threads": 1, "max_num_batched_tokens": 512}
    try:
        with InProcessEngine(_config(llama, **flags), runner_hook=hook) as engine:
            (out,) = engine.generate([prompt], greedy(6))
    finally:
        torch.set_num_threads(1)  # the suite's own
    assert list(out.outputs[0].token_ids) == expected
    assert threads[0] == (300, 2)
    assert threads[1:] == [(1, 1)] * 5


def test_submit_and_step_alongside_generate(llama, workload):
    (p0, n0, e0), (p1, n1, e1) = workload[:2]
    with InProcessEngine(_config(llama)) as engine:
        rid = engine.submit(p0, greedy(n0), request_id="mine")
        assert rid == "mine"
        (out,) = engine.generate([p1], greedy(n1))
        assert list(out.outputs[0].token_ids) == e1
        tokens: list[int] = []
        ended = None
        while engine.has_work:  # what generate() stepped for "mine" comes out first
            for o in engine.step():
                assert o.request_id == "mine"
                tokens += o.token_ids
                ended = o.finish_reason or ended
        assert tokens == e0 and ended is not None


def test_a_refused_request_leaves_nothing_queued(llama):
    with InProcessEngine(_config(llama, max_model_len=64)) as engine:
        with pytest.raises(EngineError) as err:
            engine.generate([[1, 5, 6], [1] * 100], greedy(4))
        assert err.value.code is RequestErrorCode.INVALID_ARGUMENT
        assert not engine.step() and not engine.has_work  # the first was taken back
        assert engine.abort("request-0") is False


def test_a_loaded_model_serves_engines_in_turn(llama, workload):
    config = _config(llama)
    prompts = [p for p, _, _ in workload[:4]]
    params = [greedy(n) for _, n, _ in workload[:4]]
    client = InProcessClient()
    with LoadedModel(config) as model:
        first = InProcessEngine(config, model=model, blockmgr=client)
        with pytest.raises(RuntimeError, match="not closed"):
            InProcessEngine(config, model=model)
        a = first.generate(prompts, params)
        first.close()
        with InProcessEngine(config, model=model, blockmgr=client) as second:
            b = second.generate(prompts, params)
            assert second.served.pool_id != first.served.pool_id
            assert sum(o.num_cached_tokens for o in b) == sum(o.num_cached_tokens for o in a)
        with pytest.raises(ValueError, match="model-side flags"):
            InProcessEngine(_config(llama, block_size=32), model=model)
    assert [o.outputs for o in a] == [o.outputs for o in b]
    assert [list(o.outputs[0].token_ids) for o in a] == [e for _, _, e in workload[:4]]
