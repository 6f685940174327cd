"""Beam search in the engine returns the beams of transformers'
``generate(num_beams=k, num_return_sequences=k, length_penalty, early_stopping)``, tokens and
order, for k = 2 and 4, with and without end tokens in play, whatever runs beside it, with
chunked prefill, prefix hits and preemption; and its beams share their blocks."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.blockmgr.client import InProcessClient
from services.common.limits import FieldError
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.outputs import EngineError
from services.executor.core.sequence import FinishReason, RequestKey
from services.executor.model.launch import build_runner
from services.executor.model.loader import load_tokenizer
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .greedy import hf_beams, run_engine

MAX_TOKENS = 20
TEXTS = ("The cache is cut into blocks", "Beams share", "A longer prompt about the many ways")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, hf_model, family):
    model_dir = str(tiny_checkpoint(family))
    config = ExecutorConfig(
        model=model_dir, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=160
    )
    runner = build_runner(config.runner_config())
    tok = load_tokenizer(model_dir)
    prompts = [tok(t).input_ids for t in TEXTS]

    def make(**kw) -> Engine:
        cfg = dataclasses.replace(config, **kw)
        own = runner if "num_kv_blocks" not in kw else build_runner(cfg.runner_config())
        engine, _ = build_engine(cfg, runner=own, blockmgr=InProcessClient())
        return engine

    return make, hf_model(family), prompts


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Per request, its samples' tokens by index; and the finals by (request, index)."""
    tokens, finals = run_engine(engine, requests)
    got: dict[str, dict[int, list[int]]] = {}
    for (rid, index), toks in tokens.items():
        got.setdefault(rid, {})[index] = toks
    return got, finals


def _hf_beams(model, prompt, k, length_penalty, early_stopping, ends) -> list[list[int]]:
    return hf_beams(
        model,
        prompt,
        k,
        MAX_TOKENS,
        ends=ends,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )


def _same(ours: list[int], hf: list[int], ends: set[int], pad: int) -> bool:
    """HF pads a beam that ended early; ours is the beam itself."""
    if ours and ours[-1] in ends:
        return hf[: len(ours)] == ours and all(t == pad for t in hf[len(ours) :])
    return hf == ours


def _ends(engine: Engine, params: SamplingParams) -> set[int]:
    eos = set() if params.ignore_eos else set(engine.settings.eos_token_ids)
    return eos | set(params.stop_token_ids)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize(
    ("length_penalty", "early_stopping", "end"),
    [
        (1.0, "false", "eos"),
        (0.7, "true", "frequent"),
        (1.5, "never", "frequent"),
        (1.0, "false", None),
    ],
)
def test_beams_equal_transformers_generate(setup, k, length_penalty, early_stopping, end):
    make, model, prompts = setup
    engine = make()
    # A token the model likes puts an end in play (its EOS rarely wins on random weights).
    frequent = _run(engine, {"g": (prompts[0], SamplingParams(temperature=0, max_tokens=8))})[0]
    stop = (frequent["g"][0][2],) if end == "frequent" else ()
    params = SamplingParams(
        n=k,
        use_beam_search=True,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_tokens=MAX_TOKENS,
        ignore_eos=end != "eos",
        stop_token_ids=stop,
    )
    requests = {f"b{i}": (p, params) for i, p in enumerate(prompts)}
    # Other traffic in the same batches.
    requests |= {
        f"x{i}": (p, SamplingParams(temperature=0, max_tokens=9)) for i, p in enumerate(prompts)
    }
    got, finals = _run(engine, requests)
    ends = _ends(engine, params)
    hf_early = {"false": False, "true": True, "never": "never"}[early_stopping]
    for i, prompt in enumerate(prompts):
        hf = _hf_beams(model, prompt, k, length_penalty, hf_early, ends)
        ours = [got[f"b{i}"][j] for j in range(k)]
        # (transformers fills with pad_token_id, or the first end token when that is 0)
        pad = model.config.pad_token_id or (sorted(ends)[0] if ends else -1)
        for o, h in zip(ours, hf, strict=True):
            assert _same(o, h, ends, pad), f"{i} {o} {h} {ours} {hf}"
        for j, o in enumerate(ours):
            reason = finals[(f"b{i}", j)].finish_reason
            assert reason is (FinishReason.STOP if o[-1] in ends else FinishReason.LENGTH)
    assert not engine.scheduler.running and not engine.requests


def test_beams_survive_chunked_prefill_prefix_hits_and_preemption(setup):
    make, model, prompts = setup
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=MAX_TOKENS, ignore_eos=True)
    long = prompts[2] * 4
    requests = {f"b{i}": (p, params) for i, p in enumerate([*prompts, long])}
    roomy, _ = _run(make(), requests)
    # Small step budget (chunked prefill), a KV cache too small for every beam (preemption),
    # then the same again on the warm engine (prefix hits).
    tight = make(num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=16)
    first, _ = _run(tight, requests)
    assert tight.scheduler.num_preemptions > 0
    again, finals = _run(tight, {f"again{k}": v for k, v in requests.items()})
    assert first == roomy
    assert {k.removeprefix("again"): v for k, v in again.items()} == roomy
    assert any(f.usage.cached_prompt_tokens for f in finals.values())
    hf = _hf_beams(model, long, 4, 1.0, False, set())
    assert [roomy["b3"][j] for j in range(4)] == hf


def test_beams_share_blocks_by_reference(setup):
    make, _, prompts = setup
    engine = make()
    prompt = prompts[2] * 3  # several full blocks
    engine.add_request(
        RequestKey(0, "b"),
        prompt,
        SamplingParams(n=4, use_beam_search=True, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    held = []
    while engine.has_work:
        engine.step()
        held.append(engine.link.client.stats(engine.link.pool_id).counters.num_in_use_blocks)
    per_beam = -(-(len(prompt) + MAX_TOKENS) // 16)
    assert max(held) < 4 * per_beam  # without sharing, four copies of the prompt's blocks


def test_an_aborted_beam_search_ends_every_beam_and_frees_its_blocks(setup):
    make, _, prompts = setup
    engine = make()
    engine.add_request(
        RequestKey(0, "b"),
        prompts[0],
        SamplingParams(n=3, use_beam_search=True, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    for _ in range(4):
        assert not engine.step()  # nothing is streamed before the end
    assert engine.abort_request(RequestKey(0, "b"))
    outs = [o for _ in range(3) for o in engine.step()]
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.finish_reason is FinishReason.ABORT for o in outs)
    assert not engine.requests and not engine.scheduler.running
    assert engine.link.client.stats(engine.link.pool_id).counters.num_in_use_blocks == 0


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"logprobs": 1}, "logprobs"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_unsupported_beam_search_combinations_are_refused_naming_the_field(extra, field):
    with pytest.raises(FieldError) as info:
        SamplingParams(n=2, use_beam_search=True, **extra).validate(1000)
    assert info.value.field == field


def test_a_search_ending_beside_longer_traffic_returns_its_beams(setup):
    make, model, prompts = setup
    beam = SamplingParams(n=2, use_beam_search=True, max_tokens=3, ignore_eos=True)
    got, _ = _run(
        make(),
        {"b": (prompts[0], beam), "g": (prompts[1], SamplingParams(temperature=0, max_tokens=20))},
    )
    assert [got["b"][j] for j in range(2)] == hf_beams(model, prompts[0], 2, 3)
    assert len(got["g"][0]) == 20


def test_searches_wider_than_the_free_seats_take_turns_and_impossible_ones_are_refused(setup):
    make, model, prompts = setup
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=10, ignore_eos=True)
    engine = make(max_num_seqs=4)  # two searches of 4 beams: one at a time
    got, _ = _run(engine, {"a": (prompts[0], params), "b": (prompts[1], params)})
    for rid, prompt in (("a", prompts[0]), ("b", prompts[1])):
        assert [got[rid][j] for j in range(4)] == hf_beams(model, prompt, 4, 10)
    narrow = make(max_num_seqs=3)
    with pytest.raises(EngineError, match=r"^INVALID_ARGUMENT: sampling_params\.n: 4 beams"):
        narrow.add_request(RequestKey(0, "x"), prompts[0], params)
    small = make(num_kv_blocks=6, max_model_len=64)
    long = dataclasses.replace(params, max_tokens=60)
    with pytest.raises(EngineError, match="KV blocks at once"):
        small.add_request(RequestKey(0, "y"), prompts[2] * 2, long)


@pytest.mark.parametrize("seed", [2, 5])
def test_a_tight_cache_with_mixed_traffic_gives_the_roomy_results(setup, seed):
    """Searches and plain requests under preemption: a split search is preempted whole and
    admitted again together; the results are those of a roomy cache."""
    make, _, prompts = setup
    rng = random.Random(seed)
    requests = {}
    for i in range(rng.randrange(2, 5)):
        n, m = rng.choice([2, 3, 4]), rng.randrange(5, 25)
        params = SamplingParams(n=n, use_beam_search=True, max_tokens=m, ignore_eos=True)
        requests[f"b{i}"] = (prompts[rng.randrange(3)] * rng.randrange(1, 4), params)
    for i in range(rng.randrange(1, 3)):
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(5, 30))
        requests[f"g{i}"] = (prompts[rng.randrange(3)], params)
    roomy, _ = _run(make(max_model_len=128), requests)
    tight_engine = make(num_kv_blocks=16, max_num_batched_tokens=32, max_model_len=128)
    tight, _ = _run(tight_engine, requests)
    assert tight == roomy
    assert tight_engine.link.client.stats(tight_engine.link.pool_id).counters.num_in_use_blocks == 0


def test_aborting_one_beam_aborts_the_whole_search(setup):
    make, _, prompts = setup
    engine = make()
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(RequestKey(0, "b"), prompts[0], params)
    for _ in range(3):
        engine.step()
    assert engine.abort_request(RequestKey(0, "b"), index=1)
    outs = [o for _ in range(2) for o in engine.step()]
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert not engine.has_work and not engine.requests
