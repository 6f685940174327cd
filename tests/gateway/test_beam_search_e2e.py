"""Beam search through the real stack: the gRPC API and the OpenAI API (vLLM's
``use_beam_search``) return transformers' beams, best first, each whole in one final
message; unsupported combinations are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.v1 import common_pb2
from pagedserve.v1 import generation_pb2 as G
from tests.executor.greedy import hf_beams
from tests.gateway.conftest import Stack

PROMPT = "Beam search keeps the best"


def test_grpc_beam_search_returns_transformers_beams_whole(stack: Stack) -> None:
    request = G.GenerateRequest(
        prompt=PROMPT,
        sampling_params=G.SamplingParams(n=3, use_beam_search=True, max_tokens=12, ignore_eos=True),
    )
    responses = list(stack.stub().Generate(request, timeout=60))
    assert sorted(r.index for r in responses) == [0, 1, 2]  # one final message per beam
    assert all(r.finish_reason == common_pb2.FINISH_REASON_LENGTH for r in responses)
    ours = {r.index: list(r.token_ids) for r in responses}
    ids = list(stack.stub().Tokenize(G.TokenizeRequest(text=PROMPT)).token_ids)
    model = AutoModelForCausalLM.from_pretrained(stack.model_dir, dtype=torch.float32).eval()
    assert [ours[i] for i in range(3)] == hf_beams(model, ids, 3, 12)


def test_openai_use_beam_search_gives_the_same_beams(stack: Stack) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="x", max_retries=0
    )
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        n=2,
        max_tokens=10,
        extra_body={"use_beam_search": True, "ignore_eos": True, "early_stopping": True},
    )
    request = G.GenerateRequest(
        prompt=PROMPT,
        sampling_params=G.SamplingParams(
            n=2, use_beam_search=True, max_tokens=10, ignore_eos=True, early_stopping="true"
        ),
    )
    texts = {r.index: r.text for r in stack.stub().Generate(request, timeout=60)}
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [texts[0], texts[1]]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (G.SamplingParams(n=2, use_beam_search=True, logprobs=1), "sampling_params.logprobs"),
        (
            G.SamplingParams(n=2, use_beam_search=True, early_stopping="soon"),
            "sampling_params.early_stopping",
        ),
    ],
)
def test_grpc_unsupported_beam_search_requests_are_invalid(stack: Stack, params, field) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub().Generate(G.GenerateRequest(prompt=PROMPT, sampling_params=params)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field)
