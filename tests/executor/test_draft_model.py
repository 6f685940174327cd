"""Speculative decoding with a draft model: the draft checkpoint (a noisy copy of the target,
so that some drafts are accepted and some rejected) drafts k tokens per step from its own KV
cache over the target's blocks. Outputs are token-identical to the engine without
speculation and to transformers, whatever the batching, chunking, preemption, prefix hits,
sampling or grammar; an identical draft has every draft accepted. Each case checks that drafts
were both accepted and rejected, so it cannot pass vacuously."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.blockmgr.client import InProcessClient
from services.executor.core.engine import Engine
from services.executor.model.errors import ModelLoadError
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine
from tests.executor.greedy import run_engine
from tests.executor.test_speculative import (
    CONFIGS,
    _engine,
    _requests,
    _spec_counts,
    assert_preempted_as_configured,
    assert_transformers_tokens,
    with_and_without,
)
from tests.executor.test_structured_outputs import SPECS

K = 4


def _spec(draft: object, k: int = K) -> str:
    return json.dumps({"model": str(draft), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def draft_dir(draft_checkpoint) -> str:
    return str(draft_checkpoint("llama", 0.02))


def _assert_some_accepted_some_rejected(engine: Engine) -> None:
    drafted, accepted = _spec_counts(engine)
    assert 0 < accepted < drafted, (drafted, accepted)


def test_a_draft_identical_to_the_target_has_every_draft_accepted(model_dir):
    """k drafts a step, all accepted: mean acceptance length exactly k + 1 (ignore_eos, and
    max_tokens = 1 + (k + 1) m, so that every step drafts k)."""
    requests = {
        rid: (prompt, dataclasses.replace(params, ignore_eos=True, max_tokens=1 + (K + 1) * 8))
        for rid, (prompt, params) in _requests(seed=1, num=6).items()
    }
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=_spec(model_dir))
    assert run_engine(engine, requests)[0] == plain
    stats = engine.spec.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.mean_acceptance_length == K + 1
    assert stats.accepted_per_pos == [stats.num_drafts] * K


#: An identical draft's configurations: forks (n = 2) besides the engine's.
IDENTICAL = {
    name: CONFIGS[name]
    for name in ("chunked", "recompute", "swap", "tp2", "async", "async-recompute")
} | {"n2": {}}


@pytest.mark.parametrize("name", list(IDENTICAL))
def test_an_identical_draft_keeps_every_draft_accepted_through_each_configuration(model_dir, name):
    """Output equality holds whatever the draft model's KV holds; this does not: an identical
    draft proposes the target's tokens only if its KV is right at every position, through
    chunked prefill, preemption (recompute, swap), a draft on the first of two ranks, steps
    planned ahead (async scheduling: the drafts accepted reported a step late), forks
    (n = 2), and sequences left behind while speculation is off for a batch of 6 or more
    (each request has its own length, so the batch shrinks)."""
    config = IDENTICAL[name]
    requests = {
        rid: (
            prompt,
            dataclasses.replace(
                params,
                ignore_eos=True,
                max_tokens=1 + (K + 1) * (4 + i),
                n=2 if name == "n2" else 1,
            ),
        )
        for i, (rid, (prompt, params)) in enumerate(_requests(seed=1, num=12).items())
    }
    spec = json.dumps({"model": model_dir, "num_speculative_tokens": K, "disable_by_batch_size": 6})
    (plain, _), (got, _), engine = with_and_without(model_dir, requests, spec, config)
    assert got == plain
    stats = engine.spec.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert engine.num_bad_answers == 0
    assert_preempted_as_configured(engine, config)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_draft_model_speculation_gives_the_tokens_of_the_engine_without_it(
    model_dir, draft_dir, config
):
    requests = _requests(seed=1, num=12)
    (plain, plain_finals), (spec, finals), engine = with_and_without(
        model_dir, requests, _spec(draft_dir), CONFIGS[config]
    )
    assert spec == plain
    assert {k: f.finish_reason for k, f in finals.items()} == {
        k: f.finish_reason for k, f in plain_finals.items()
    }
    _assert_some_accepted_some_rejected(engine)
    assert_preempted_as_configured(engine, CONFIGS[config])


@pytest.mark.parametrize(
    "name", ["qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2", "gemma3"]
)
def test_every_family_with_full_attention_layers_drafts_with_transformers_tokens(
    name, tiny_checkpoint, draft_checkpoint, hf_model
):
    """Gemma's sliding layers (windows of 16 tokens) beside its global ones: the draft model
    reads the full-attention group's tables."""
    target = str(tiny_checkpoint(name))
    engine = _engine(target, speculative_config=_spec(draft_checkpoint(name, 0.02)))
    assert_transformers_tokens(engine, _requests(seed=1, num=8, max_tokens=60), hf_model(name))


@pytest.mark.parametrize(
    "overrides",
    [
        {"temperature": 0.9, "seed": 5},  # a seed draws per output position: exact
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 6, "n": 2},
        {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2, "min_tokens": 60},
        {"temperature": 0.0, "structured_outputs": SPECS["json"], "max_tokens": 60},
    ],
    ids=["seeded", "seeded-top-k-p-n2", "penalties-logprobs-min-tokens", "json"],
)
def test_sampled_and_structured_requests_give_the_outputs_of_the_engine_without_it(
    model_dir, draft_dir, overrides
):
    """Drafts are the draft model's argmax, a token with certainty, so verification samples
    each row as without speculation; a draft the grammar refuses is rejected there."""
    requests = {
        rid: (prompt, dataclasses.replace(params, **overrides))
        for rid, (prompt, params) in _requests(seed=1, num=8, max_tokens=80).items()
    }
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=_spec(draft_dir))
    assert run_engine(engine, requests)[0] == plain
    assert _spec_counts(engine)[0] > 0


def test_a_drafted_stop_token_ends_the_sequence_there(model_dir):
    """An identical draft drafts the stop token the target then samples; the drafts after
    it are not taken, and the output ends as without speculation."""
    base = _requests(seed=1, num=6)
    plain, _ = run_engine(_engine(model_dir), base)
    stop = plain[("r0", 0)][6]  # a token the model does produce
    requests = {
        rid: (prompt, dataclasses.replace(params, stop_token_ids=(stop,)))
        for rid, (prompt, params) in base.items()
    }
    plain, plain_finals = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=_spec(model_dir))
    got, finals = run_engine(engine, requests)
    assert got == plain
    assert finals[("r0", 0)].stop_token_id == stop == got[("r0", 0)][-1]
    stats = engine.spec.stats  # (the drafts after an accepted stop token are not taken)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert {k: f.finish_reason for k, f in finals.items()} == {
        k: f.finish_reason for k, f in plain_finals.items()
    }


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_an_identical_draft_drafts_the_end_of_a_grammar_which_is_sampled_not_drafted(
    model_dir, kind
):
    """The draft model drafts the end token where the grammar is complete; no row is masked by
    an ended grammar, and the sample ends there as without speculation (ignore_eos too)."""
    requests = {
        rid: (
            prompt,
            dataclasses.replace(
                params, max_tokens=60, structured_outputs=SPECS[kind], ignore_eos=i % 2 == 0
            ),
        )
        for i, (rid, (prompt, params)) in enumerate(_requests(seed=1, num=8).items())
    }
    plain, plain_finals = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=_spec(model_dir))
    got, finals = run_engine(engine, requests)
    assert got == plain
    assert {k: f.finish_reason for k, f in finals.items()} == {
        k: f.finish_reason for k, f in plain_finals.items()
    }
    assert _spec_counts(engine)[1] > 0


def test_prefix_hits_read_the_draft_models_cache_too(model_dir):
    """The same prompts twice: the second time their prefixes are cache hits, whose draft KV
    the first run computed; an identical draft still has every draft accepted."""
    requests = {
        rid: (prompt, dataclasses.replace(params, ignore_eos=True, max_tokens=1 + (K + 1) * 4))
        for rid, (prompt, params) in _requests(seed=1, num=6).items()
    }
    engine = _engine(model_dir, speculative_config=_spec(model_dir))
    first, _ = run_engine(engine, requests)
    again, finals = run_engine(engine, {f"{rid}-again": v for rid, v in requests.items()})
    assert {(rid.removesuffix("-again"), i): t for (rid, i), t in again.items()} == first
    assert finals[("r0-again", 0)].usage.cached_prompt_tokens > 0
    stats = engine.spec.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_the_cache_budget_pays_for_both_models_blocks(model_dir, draft_dir):
    """Under a byte budget each block costs the target's bytes and the draft's (here the
    same model twice): half the blocks."""
    budget = 4 * 2**20
    plain = build_runner(_config(model_dir, kv_cache_memory=budget).runner_config())
    config = _config(model_dir, kv_cache_memory=budget, speculative_config=_spec(draft_dir))
    runner = build_runner(config.runner_config())
    assert runner.draft is not None
    assert runner.num_blocks == plain.num_blocks // 2
    assert runner.draft.num_blocks == runner.num_blocks


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "draft_model"}, "speculative_config.model: draft_model needs"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model: the ngram method"),
        ({"model": "x", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size: only 1"),
    ],
)
def test_a_bad_draft_config_is_refused_naming_the_field(spec, message):
    with pytest.raises(ValueError) as info:
        ExecutorConfig(model="m", speculative_config=json.dumps(spec)).validate()
    assert message in str(info.value)


def test_a_draft_checkpoint_that_cannot_serve_is_a_load_error_naming_the_field(model_dir, tmp_path):
    config = _config(model_dir, speculative_config=_spec(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"^speculative_config\.model: "):
        build_engine(
            config, runner=build_runner(config.runner_config()), blockmgr=InProcessClient()
        )


def _config(model_dir: str, **flags) -> ExecutorConfig:
    flags.setdefault("num_kv_blocks", None if "kv_cache_memory" in flags else 64)
    return ExecutorConfig(
        model=model_dir, dtype="float32", device="cpu", block_size=8, max_model_len=256, **flags
    )


@pytest.mark.gpu
def test_on_cuda_draft_model_speculation_gives_the_tokens_of_graphed_decoding(model_dir, draft_dir):
    """On a GPU: the plain engine decodes through CUDA graphs; the speculating one drafts
    with the draft model (eagerly) and verifies through the verification graphs. fp32
    tokens are identical."""
    requests = _requests(seed=1, num=12)
    plain, _ = run_engine(_engine(model_dir, device="cuda"), requests)
    engine = _engine(model_dir, device="cuda", speculative_config=_spec(draft_dir))
    assert run_engine(engine, requests)[0] == plain
    _assert_some_accepted_some_rejected(engine)
    assert engine.runner.graphs.num_verify_replays > 0  # type: ignore[attr-defined]
