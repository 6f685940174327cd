"""Prompt log-probabilities (what lm-evaluation-harness scores multiple-choice tasks with):
each prompt token's log-probability given the tokens before it, with top alternatives, equal
to transformers' log-softmax of the forward logits, however the prompt is chunked, whatever
is in the prefix cache, through preemption, and reported once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.outputs import SeqOutput
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .conftest import CheckpointFactory

NAME = "llama"


def _engine(tiny_checkpoint: CheckpointFactory, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 256)
    config = ExecutorConfig(
        model=str(tiny_checkpoint(NAME)), dtype="float32", device="cpu", block_size=8, **kw
    )
    engine, _ = build_engine(
        config, runner=build_runner(config.runner_config()), blockmgr=InProcessClient()
    )
    return engine


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(RequestKey(0, rid), prompt, params)
    outs: dict[str, list[SeqOutput]] = {}
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.req_id.request_id, []).append(o)
    return outs


@torch.inference_mode()
def _hf_prompt_logprobs(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt])).logits[0].float()  # [len, V]
    return torch.log_softmax(logits, dim=-1)


def _prompts() -> list[list[int]]:
    return [[1, *range(40, 40 + n)] for n in (1, 9, 30, 57)]


@pytest.mark.parametrize(
    "kw",
    [
        {},  # whole prompts in one step
        {"max_num_batched_tokens": 7},  # chunks of up to 7 tokens, across blocks
        {"num_kv_blocks": 12, "max_num_batched_tokens": 16, "max_model_len": 88},  # preemption
        {"async_scheduling": True, "max_num_batched_tokens": 16},
        {"tensor_parallel_size": 2, "max_num_batched_tokens": 16},  # logits gathered to rank 0
    ],
    ids=["whole", "chunked", "preempted", "async", "tp2"],
)
def test_prompt_logprobs_equal_transformers_log_softmax(
    tiny_checkpoint: CheckpointFactory,
    hf_model: Callable[[str], PreTrainedModel],
    kw: dict,
) -> None:
    engine = _engine(tiny_checkpoint, **kw)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=3, ignore_eos=True)
    try:
        outs = _run(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    finally:
        engine.runner.close()  # the other tensor-parallel rank, if any
    if "num_kv_blocks" in kw:
        assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        reported = [o for o in outs[f"r{i}"] if o.prompt_logprobs]
        if len(prompt) == 1:  # nothing before the only token
            assert not reported
            continue
        (first,) = reported  # once, on the first output
        assert first is outs[f"r{i}"][0]
        ref = _hf_prompt_logprobs(hf_model(NAME), prompt)
        assert [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]
        for p, lp in enumerate(first.prompt_logprobs):
            assert abs(lp.logprob - ref[p, prompt[p + 1]].item()) < 1e-4, (i, p)
            top_vals, top_ids = ref[p].topk(3)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            vals = [v for _, v in lp.top]
            assert max(abs(v - w) for v, w in zip(vals, top_vals.tolist(), strict=True)) < 1e-4


def test_a_prompt_logprobs_request_computes_its_whole_prompt_despite_the_prefix_cache(
    tiny_checkpoint: CheckpointFactory, hf_model: Callable[[str], PreTrainedModel]
) -> None:
    engine = _engine(tiny_checkpoint)
    prompt = _prompts()[3]
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    first = _run(engine, {"warm": (prompt, plain)})
    again = _run(engine, {"hit": (prompt, plain)})
    assert again["hit"][0].usage.cached_prompt_tokens > 0  # the cache holds the prompt
    with_lp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)
    outs = _run(engine, {"lp": (prompt, with_lp)})
    out = outs["lp"][0]
    assert out.usage.cached_prompt_tokens == 0 and len(out.prompt_logprobs) == len(prompt) - 1
    assert all(lp.top == () for lp in out.prompt_logprobs)
    assert [o.token_ids for o in outs["lp"]] == [o.token_ids for o in first["warm"]]
    ref = _hf_prompt_logprobs(hf_model(NAME), prompt)
    assert abs(out.prompt_logprobs[-1].logprob - ref[-2, prompt[-1]].item()) < 1e-4


def test_n_samples_report_the_prompt_logprobs_once_on_sample_zero(
    tiny_checkpoint: CheckpointFactory,
) -> None:
    engine = _engine(tiny_checkpoint)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, n=3, prompt_logprobs=1)
    outs = _run(engine, {"r": (_prompts()[2], params)})
    reported = [o for o in outs["r"] if o.prompt_logprobs]
    assert len(reported) == 1 and reported[0].index == 0
    assert len(reported[0].prompt_logprobs) == len(_prompts()[2]) - 1
