"""``logit_bias`` (OpenAI's; transformers' ``sequence_bias`` of one-token sequences) through
the engine: greedy tokens identical to transformers' with the same bias, biased and unbiased
requests batched together, sync and async scheduling; log-probabilities stay the model's."""

from __future__ import annotations

import random

import pytest
import torch

from services.blockmgr.client import InProcessClient
from services.common.limits import FieldError
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .greedy import hf_greedy

MAX_TOKENS = 12


def _hf_biased(model, prompt: list[int], bias: dict[int, float]) -> list[int]:
    """transformers' greedy tokens with ``bias`` as one-token ``sequence_bias``."""
    sequence_bias = [[[t], b] for t, b in bias.items()]
    return hf_greedy(model, prompt, MAX_TOKENS, sequence_bias=sequence_bias)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_biased_and_unbiased_requests_batched_together_get_transformers_tokens(
    tiny_checkpoint, hf_model, async_scheduling
) -> None:
    hf, rng = hf_model("llama"), random.Random(11)
    vocab = hf.config.vocab_size
    prompts = [
        [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))] for _ in range(6)
    ]
    biases: list[dict[int, float]] = []
    for i, prompt in enumerate(prompts):
        first = hf_greedy(hf, prompt, 1)[0][0]
        if i % 3 == 0:
            biases.append({})  # unbiased, beside the others
        elif i % 3 == 1:  # the greedy choice banned: another path from the first token on
            biases.append({first: -100.0, rng.randrange(3, vocab): 2.5})
        else:  # a token pushed up, by a bias that changes some choices but not all
            biases.append({rng.randrange(3, vocab): 8.0, rng.randrange(3, vocab): -3.0})
    config = ExecutorConfig(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        async_scheduling=async_scheduling,
    )
    engine, _ = build_engine(config, blockmgr=InProcessClient())
    for i, (prompt, bias) in enumerate(zip(prompts, biases, strict=True)):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            logit_bias=tuple(sorted(bias.items())),
            logprobs=1,
        )
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    got: dict[str, list[int]] = {}
    chosen: dict[str, list[float]] = {}
    while engine.has_work:
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
            chosen.setdefault(o.req_id.request_id, []).extend(lp.logprob for lp in o.logprobs)
    for i, (prompt, bias) in enumerate(zip(prompts, biases, strict=True)):
        expected = _hf_biased(hf, prompt, bias) if bias else hf_greedy(hf, prompt, MAX_TOKENS)[0]
        assert got[f"r{i}"] == expected, i
    # A banned first choice: the sample differs from the unbiased greedy output, and the
    # log-probability returned for its first token is the model's, without the bias.
    prompt, bias = prompts[1], biases[1]
    tokens, logits = hf_greedy(hf, prompt, 1)
    assert got["r1"][0] != tokens[0]
    model_logprob = torch.log_softmax(logits[0], dim=-1)[got["r1"][0]].item()
    assert chosen["r1"][0] == pytest.approx(model_logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("bias", "field"),
    [
        (((5, 101.0),), "logit_bias[5]"),
        (((5, float("nan")),), "logit_bias[5]"),
        (((10**6, 1.0),), "logit_bias[1000000]"),
        (((5, 1.0), (5, 2.0)), "logit_bias"),
        (tuple((t, 1.0) for t in range(1025)), "logit_bias"),
    ],
)
def test_a_bad_logit_bias_is_refused_naming_the_field(bias, field) -> None:
    with pytest.raises(FieldError) as info:
        SamplingParams(logit_bias=bias).validate(vocab_size=32000)
    assert info.value.field == field


def test_logit_bias_with_beam_search_is_refused_naming_the_field() -> None:
    params = SamplingParams(n=2, use_beam_search=True, logit_bias=((5, 1.0),))
    with pytest.raises(FieldError) as info:
        params.validate(vocab_size=32000)
    assert info.value.field == "logit_bias"
