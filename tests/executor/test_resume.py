"""A sample resumed from its earlier output tokens (what the gateway sends when a stream's
executor was lost) carries on exactly as the uninterrupted sample would have: the same greedy
tokens, the same seeded draws (each draw is addressed by seed, sample index and output
position), the same length limits; and requests that cannot be resumed are refused naming
the field."""

from __future__ import annotations

import dataclasses

import pytest

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.outputs import EngineError
from services.executor.core.sampler import draw_seed
from services.executor.core.sequence import FinishReason, RequestKey, Resume
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .greedy import run_engine, shared_prefix_workload


@pytest.fixture(scope="module")
def engine_factory(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    config = ExecutorConfig(
        model=model, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=128
    )
    runner = build_runner(config.runner_config())

    def make(**kw) -> Engine:
        cfg = dataclasses.replace(config, **kw)
        engine, _ = build_engine(cfg, runner=runner, blockmgr=InProcessClient())
        return engine

    return make


@pytest.fixture(scope="module")
def prompts(hf_model) -> list[list[int]]:
    work = shared_prefix_workload(
        hf_model("llama"), seed=5, num_requests=6, prefix_len=20, max_tail=30, max_tokens=(1, 2)
    )
    return [prompt for prompt, _, _ in work]


def test_draw_seeds_depend_only_on_seed_sample_and_position():
    seeds = {draw_seed(s, i, p) for s in (0, 1, 2**64 - 1) for i in range(4) for p in range(64)}
    assert len(seeds) == 3 * 4 * 64
    assert all(0 <= s < 2**63 for s in seeds)
    assert draw_seed(7, 1, 30) == draw_seed(7, 1, 30)


@pytest.mark.parametrize("cut", [0, 1, 9, 16, 23])
def test_greedy_resume_continues_token_for_token(engine_factory, prompts, cut):
    prompt = prompts[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    whole, _ = run_engine(engine_factory(), {"a": (prompt, params, None)})
    full = whole[("a", 0)]
    assert len(full) == 24
    # Resumed next to other traffic, as on a surviving executor.
    busy = {f"x{i}": (prompts[i + 1], params, None) for i in range(3)}
    resumed, finals = run_engine(
        engine_factory(), {**busy, "r": (prompt, params, Resume(0, tuple(full[:cut])))}
    )
    assert resumed[("r", 0)] == full[cut:]
    assert finals[("r", 0)].finish_reason is FinishReason.LENGTH
    assert finals[("r", 0)].usage.prompt_tokens == len(prompt)
    assert finals[("r", 0)].usage.completion_tokens == 24


def test_seeded_samples_resume_to_the_same_draws(engine_factory, prompts):
    """Sample j of a seeded n = 3 request, with penalties (which read the output so far),
    resumed after k tokens as its own n = 1 request, draws the very tokens it drew."""
    params = SamplingParams(
        n=3,
        temperature=0.8,
        top_p=0.95,
        seed=99,
        max_tokens=20,
        ignore_eos=True,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
    )
    prompt = prompts[2]
    whole, _ = run_engine(engine_factory(), {"a": (prompt, params, None)})
    samples = [whole[("a", j)] for j in range(3)]
    assert len({tuple(s) for s in samples}) == 3  # three distinct samples
    one = dataclasses.replace(params, n=1)
    requests = {
        f"r{j}-{k}": (prompt, one, Resume(j, tuple(samples[j][:k])))
        for j in range(3)
        for k in (0, 7, 19)
    }
    resumed, _ = run_engine(engine_factory(), requests)
    for j in range(3):
        for k in (0, 7, 19):
            assert resumed[(f"r{j}-{k}", 0)] == samples[j][k:], (j, k)


def test_resumed_output_counts_toward_min_and_max_tokens(engine_factory, prompts):
    prompt = prompts[3]
    eos = engine_factory().settings.eos_token_ids[0]
    # min_tokens=5 with 4 tokens already out: EOS is allowed again from the second new token.
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5)
    resumed, finals = run_engine(engine_factory(), {"r": (prompt, params, Resume(0, (eos,) * 4))})
    out = resumed[("r", 0)]
    assert 1 <= len(out) <= 6
    assert finals[("r", 0)].usage.completion_tokens == 4 + len(out)


@pytest.mark.parametrize(
    ("params", "resume", "field"),
    [
        (SamplingParams(n=2, max_tokens=8), Resume(0, (1, 2)), "sampling_params.n"),
        (SamplingParams(max_tokens=2), Resume(0, (1, 2)), "resume.output_token_ids"),
        (SamplingParams(max_tokens=300), Resume(0, (1,) * 250), "resume.output_token_ids"),
        (SamplingParams(max_tokens=8), Resume(0, (10**6,)), "resume.output_token_ids[0]"),
        (
            SamplingParams(max_tokens=8, prompt_logprobs=1),
            Resume(0, (1,)),
            "sampling_params.prompt_logprobs",
        ),
    ],
)
def test_unresumable_requests_are_refused_naming_the_field(
    engine_factory, prompts, params, resume, field
):
    engine = engine_factory()
    with pytest.raises(EngineError) as info:
        engine.add_request(RequestKey(0, "bad"), prompts[0], params, resume=resume)
    assert info.value.message.startswith(field)
    assert not engine.has_work
