"""Speculative decoding (n-gram drafts, greedy verification): outputs are token-identical to
the same engine without speculation and to transformers, under batching, chunked prefill,
prefix hits, preemption (recompute and swap), and with samples that cannot be speculated
batched beside; each case checks that drafts were made and accepted, so it cannot pass
vacuously."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine
from tests.executor.greedy import hf_greedy, run_engine
from tests.executor.test_structured_outputs import SPECS

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


def _engine(model_dir: str, **flags) -> Engine:
    graph_backend = flags.pop("graph_backend", None)
    config = ExecutorConfig(
        model=model_dir,
        dtype="float32",
        device=flags.pop("device", "cpu"),
        block_size=8,
        max_model_len=256,
        num_kv_blocks=flags.pop("num_kv_blocks", 256),
        **flags,
    )
    runner = build_runner(config.runner_config(), graph_backend=graph_backend)
    engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
    return engine


def _requests(seed: int, num: int, max_tokens: int = 100) -> dict[str, tuple]:
    """Prompts that repeat a passage (drafts from the prompt) and tails of their own."""
    rng = random.Random(seed)
    requests = {}
    for i in range(num):
        passage = [rng.randrange(10, 500) for _ in range(rng.randrange(6, 20))]
        prompt = [1, *passage, *[rng.randrange(10, 500) for _ in range(3)], *passage]
        prompt += [rng.randrange(10, 500) for _ in range(rng.randrange(0, 4))]
        requests[f"r{i}"] = (prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return requests


def _assert_same_with_and_without_speculation(model_dir: str, requests: dict) -> None:
    """The same tokens and finish reasons with speculation as without, with drafts made."""
    plain, plain_finals = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=SPEC)
    spec, finals = run_engine(engine, requests)
    assert spec == plain
    assert {k: f.finish_reason for k, f in finals.items()} == {
        k: f.finish_reason for k, f in plain_finals.items()
    }
    assert _spec_counts(engine)[0] > 0


def _spec_counts(engine: Engine) -> tuple[int, int]:
    return engine.spec.stats.num_draft_tokens, engine.spec.stats.num_accepted_tokens


#: The engine configurations speculation is tested under (their keys: the test ids).
CONFIGS: dict[str, dict] = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 24},  # chunked prefill, and drafts cut by the budget
    "recompute": {"num_kv_blocks": 40, "max_num_seqs": 12},  # preemption by recompute
    "swap": {
        "num_kv_blocks": 40,
        "max_num_seqs": 12,
        "preemption_mode": "swap",
        "kv_offloading_size": 0.001,
    },
    "async": {"async_scheduling": True},  # steps planned ahead for the most drafts
    # ... with chunked prefill, drafts cut by the budget, and preemption
    "async-recompute": {
        "async_scheduling": True,
        "max_num_batched_tokens": 48,
        "num_kv_blocks": 40,
        "max_num_seqs": 12,
    },
    "tp2": {"tensor_parallel_size": 2},  # (a draft model runs on the first rank)
}


def with_and_without(
    model_dir: str, requests: dict, speculative_config: str, config: dict
) -> tuple[tuple[dict, dict], tuple[dict, dict], Engine]:
    """``requests`` run on an engine of ``config`` without speculation, then with: the tokens
    and final outputs of each, and the speculating engine (its ranks closed)."""
    runs = []
    for spec in (None, speculative_config):
        engine = _engine(model_dir, speculative_config=spec, **config)
        try:
            runs.append(run_engine(engine, requests))
        finally:
            engine.runner.close()  # the other tensor-parallel rank, if any
    return runs[0], runs[1], engine


def assert_preempted_as_configured(engine: Engine, config: dict) -> None:
    """What ``config`` is about happened: preemptions, swaps, steps planned ahead."""
    if "max_num_seqs" in config:
        assert engine.scheduler.num_preemptions > 0
    if config.get("preemption_mode") == "swap":
        assert engine.scheduler.swapping.num_swapped_out > 0
    if config.get("async_scheduling"):
        assert engine.num_steps_ahead > engine.num_steps // 2, (
            engine.num_steps_ahead,
            engine.num_steps,
        )
        assert engine.num_ahead_failures == engine.num_bad_answers == 0


def assert_transformers_tokens(engine: Engine, requests: dict, model) -> None:
    """``engine``'s greedy tokens for ``requests`` are ``model``'s, with drafts accepted."""
    got, _ = run_engine(engine, requests)
    for rid, (prompt, params) in requests.items():
        assert got[(rid, 0)] == hf_greedy(model, prompt, params.max_tokens)[0], rid
    drafted, accepted = _spec_counts(engine)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_ngram_speculation_gives_the_tokens_of_the_engine_without_it(model_dir, config):
    requests = _requests(seed=1, num=12)
    (plain, _), (spec, finals), engine = with_and_without(
        model_dir, requests, SPEC, CONFIGS[config]
    )
    assert spec == plain
    drafted, accepted = _spec_counts(engine)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert all(len(t) == 100 or finals[k].finish_reason.name == "STOP" for k, t in spec.items())
    assert_preempted_as_configured(engine, CONFIGS[config])


@pytest.mark.parametrize("name", ["qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe", "phi3"])
def test_every_full_attention_family_speculates_with_transformers_tokens(
    name, tiny_checkpoint, hf_model
):
    engine = _engine(str(tiny_checkpoint(name)), speculative_config=SPEC)
    assert_transformers_tokens(engine, _requests(seed=1, num=12), hf_model(name))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "name", ["mistral_window", "qwen2_window", "phi3_window", "gemma2", "gemma3"]
)
def test_sliding_window_families_speculate_with_transformers_tokens(
    name, async_scheduling, tiny_checkpoint, hf_model
):
    """Windows of 16 tokens, which the prompts and outputs cross: a grow releases the blocks
    out of the window of its verified tokens only (drafts may be rejected; planned ahead,
    of the tokens the pool is sure of), batched with chunked prefill."""
    config = {"max_num_batched_tokens": 40, "async_scheduling": async_scheduling}
    engine = _engine(str(tiny_checkpoint(name)), speculative_config=SPEC, **config)
    assert_transformers_tokens(engine, _requests(seed=1, num=8, max_tokens=60), hf_model(name))
    assert engine.num_bad_answers == 0  # the pool's releases and ours agreed
    assert_preempted_as_configured(engine, config)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap", "recompute-async"])
def test_a_sliding_window_model_speculates_through_preemption(tiny_checkpoint, preemption_mode):
    config = {"num_kv_blocks": 80, "max_num_seqs": 12, "preemption_mode": preemption_mode}
    if preemption_mode == "swap":
        config["kv_offloading_size"] = 0.001
    if preemption_mode == "recompute-async":
        config.update(preemption_mode="recompute", async_scheduling=True)
    model = str(tiny_checkpoint("gemma2"))
    (plain, _), (spec, _), engine = with_and_without(model, _requests(seed=2, num=12), SPEC, config)
    assert spec == plain
    assert_preempted_as_configured(engine, config)
    assert _spec_counts(engine)[1] > 0
    assert engine.num_bad_answers == 0


def test_speculated_greedy_outputs_equal_transformers(model_dir, hf_model):
    requests = _requests(seed=1, num=12)
    engine = _engine(model_dir, speculative_config=SPEC)
    got, _ = run_engine(engine, requests)
    model = hf_model("llama")
    for rid, (prompt, params) in requests.items():
        assert got[(rid, 0)] == hf_greedy(model, prompt, params.max_tokens)[0], rid
    assert _spec_counts(engine)[1] > 0


@pytest.mark.parametrize(
    "overrides",
    [
        {"temperature": 0.9, "seed": 5},  # a seed draws per output position: exact
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 6, "n": 2},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.2},
        {"temperature": 0.0, "logprobs": 3, "min_tokens": 60},
        {"temperature": 0.0, "logit_bias": ((40, 2.0), (41, -1.0))},
    ],
    ids=["seeded", "seeded-top-k-p-n2", "penalties", "logprobs-min-tokens", "logit-bias"],
)
def test_sampled_requests_give_the_tokens_and_logprobs_of_the_engine_without_it(
    model_dir, overrides
):
    """Each row of a draft is sampled as that output position would be without speculation
    (drafts count as output for penalties and min_tokens; a seed's draw is per position)."""
    requests = {
        rid: (prompt, dataclasses.replace(params, **overrides))
        for rid, (prompt, params) in _requests(seed=1, num=12).items()
    }
    _assert_same_with_and_without_speculation(model_dir, requests)


def test_logprobs_of_accepted_drafts_equal_those_without_speculation(model_dir):
    requests = {
        rid: (prompt, dataclasses.replace(params, logprobs=2))
        for rid, (prompt, params) in _requests(seed=1, num=12).items()
    }
    plain = _logprobs(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=SPEC)
    spec = _logprobs(engine, requests)
    assert spec.keys() == plain.keys()
    for key, lps in plain.items():
        assert [lp.token_id for lp in spec[key]] == [lp.token_id for lp in lps]
        # The same positions through other kernels (k + 1 query rows, other row counts in
        # the matmuls): equal up to fp32 rounding, relative to the logprob's size.
        assert [lp.logprob for lp in spec[key]] == pytest.approx(
            [lp.logprob for lp in lps], rel=1e-5, abs=1e-5
        )
    assert _spec_counts(engine)[1] > 0


def test_prefix_hits_and_prompt_logprobs_beside_drafts_keep_the_tokens(model_dir):
    """The same prompts twice (the second time their prefixes are cache hits, committed from
    verified tokens only), and a request asking for prompt log-probabilities batched in."""
    requests = _requests(seed=1, num=8)
    prompt, params = requests["r0"]
    requests["logprobs"] = (prompt, dataclasses.replace(params, prompt_logprobs=2))
    plain_engine, engine = _engine(model_dir), _engine(model_dir, speculative_config=SPEC)
    for run in ("first", "again"):
        plain, _ = run_engine(plain_engine, requests)
        spec, finals = run_engine(engine, requests)
        assert spec == plain, run
        requests = {f"{rid}-again": value for rid, value in requests.items()}
    assert finals[("r0-again", 0)].usage.cached_prompt_tokens > 0
    assert _spec_counts(engine)[1] > 0


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_structured_outputs_are_speculated_within_their_grammar(model_dir, kind):
    """Drafts are cut where the grammar refuses them, each row is masked to what the grammar
    allows after the drafts before it, and the matcher follows the accepted ones."""
    requests = {
        rid: (prompt, dataclasses.replace(params, max_tokens=60, structured_outputs=SPECS[kind]))
        for rid, (prompt, params) in _requests(seed=1, num=12).items()
    }
    _assert_same_with_and_without_speculation(model_dir, requests)


def _logprobs(engine: Engine, requests: dict[str, tuple]) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(_key(rid), prompt, params)
    got: dict[str, list] = {}
    while engine.has_work:
        for out in engine.step():
            assert out.logprobs is None or len(out.logprobs) == len(out.token_ids)
            got.setdefault(out.req_id.request_id, []).extend(out.logprobs or ())
    return got


def test_samples_that_cannot_be_speculated_run_beside_speculated_ones(model_dir):
    requests = _requests(seed=1, num=12)
    for i, rid in enumerate(list(requests)):
        prompt, params = requests[rid]
        if i % 3 == 2:
            params = dataclasses.replace(params, use_beam_search=True, n=2)
        requests[rid] = (prompt, params)
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=SPEC)
    assert run_engine(engine, requests)[0] == plain
    assert _spec_counts(engine)[1] > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_between_steps_the_pool_holds_what_the_scheduler_would_restore(model_dir, async_scheduling):
    """After every step, each sequence's tokens (verified), slots and table in the pool are
    the scheduler's view of them (what a restart restores), though accepted drafts are
    reported a step late and steps planned ahead hold the worst case's slots. A draft
    model identical to the target has every draft accepted: the most drafts in flight; with
    more than 5 sequences running, speculation is off (steps planned ahead hold no room for
    drafts then, but still report the drafts accepted before)."""
    spec = json.dumps({"model": model_dir, "num_speculative_tokens": 4, "disable_by_batch_size": 6})
    engine = _engine(model_dir, speculative_config=spec, async_scheduling=async_scheduling)
    pool = engine.link.client.core._pools[engine.link.pool_id].manager
    requests = {  # of their own lengths: the batch shrinks, speculation starts
        rid: (prompt, dataclasses.replace(params, max_tokens=16 + 8 * i, ignore_eos=True))
        for i, (rid, (prompt, params)) in enumerate(_requests(seed=3, num=8).items())
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(_key(rid), prompt, params)
    checked = 0
    while engine.has_work:
        engine.step()
        for view in engine.scheduler.pre_plan_state(None):
            state = pool.seqs.get(view.seq_id)
            if state is None or view.host_slots:
                continue
            assert (state.num_tokens, state.num_slots) == (view.num_tokens, view.num_slots)
            assert tuple(state.tables[0]) == view.block_ids
            checked += state.num_slots > state.num_tokens
    assert checked > 0 and _spec_counts(engine)[1] > 0
    assert (engine.num_steps_ahead > 0) == async_scheduling


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_blockmgr_restart_mid_speculation_restores_the_lookahead_slots(
    model_dir, async_scheduling
):
    requests = _requests(seed=1, num=12)
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(model_dir, speculative_config=SPEC, async_scheduling=async_scheduling)
    for rid, (prompt, params) in requests.items():
        engine.add_request(_key(rid), prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while engine.has_work:
        for out in engine.step():
            tokens.setdefault((out.req_id.request_id, out.index), []).extend(out.token_ids)
        steps += 1
        if steps in (8, 15):  # the pool forgets everything: the engine restores it
            engine.link.invalidate()
    assert tokens == plain
    assert _spec_counts(engine)[1] > 0
    assert engine.link.num_recoveries == 2 and engine.num_bad_answers == 0


@pytest.mark.parametrize("method", ["ngram", "draft_model", "ngram_tp2"])
def test_verifying_steps_replay_their_graphs_with_the_tokens_of_plain_decoding(
    model_dir, method
) -> None:
    """Decode graphs (the eager stand-in replaying over the persistent buffers) serve the
    verifying steps too, 1 + k queries a sequence: the tokens of the engine without
    speculation, with drafts accepted; at TP = 2 every rank replays the same graph."""
    draft = {"model": model_dir, "num_speculative_tokens": 3}
    spec = json.dumps(draft) if method == "draft_model" else SPEC
    requests = _requests(seed=1, num=6, max_tokens=60)
    plain, _ = run_engine(_engine(model_dir), requests)
    engine = _engine(
        model_dir,
        speculative_config=spec,
        graph_backend="eager",
        cuda_graph_sizes=(1, 2, 4, 8, 16, 24, 32, 40),
        tensor_parallel_size=2 if method.endswith("tp2") else 1,
    )
    try:
        got, _ = run_engine(engine, requests)
    finally:
        engine.runner.close()
    assert got == plain
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    assert graphs.verify_query_len == (4 if method == "draft_model" else 5)
    assert graphs.num_verify_replays > 0
    if method == "draft_model":  # its catch-up forwards and its further drafts' too
        draft_graphs = engine.runner.draft.graphs  # type: ignore[attr-defined]
        assert draft_graphs.num_verify_replays > 0
        assert draft_graphs.num_replays > draft_graphs.num_verify_replays
    drafted, accepted = _spec_counts(engine)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def _key(rid: str) -> RequestKey:
    return RequestKey(0, rid)


@pytest.mark.gpu
def test_on_cuda_speculation_gives_the_tokens_of_graphed_decoding(model_dir):
    """On a GPU: the plain engine decodes through CUDA graphs, the speculating one verifies
    its drafts through the verification graphs (k + 1 queries per sequence); fp32 tokens
    are identical."""
    requests = _requests(seed=1, num=12)
    plain, _ = run_engine(_engine(model_dir, device="cuda"), requests)
    engine = _engine(model_dir, device="cuda", speculative_config=SPEC)
    assert run_engine(engine, requests)[0] == plain
    assert _spec_counts(engine)[1] > 0
    assert engine.runner.graphs.num_verify_replays > 0  # type: ignore[attr-defined]
