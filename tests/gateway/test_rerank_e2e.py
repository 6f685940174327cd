"""A reranker through the whole stack (``--runner pooling`` with ``classifier_from_token``,
Qwen3-Reranker's way): ``/v1/rerank`` (Jina / Cohere), ``/v1/score`` and a gRPC ``Embed`` of
a pair give sigmoid(logit[yes] - logit[no]) of HF's causal LM at the pair's last token,
ranked; bad input is a 400 naming the field; an embedding request names the runner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from pagedserve.v1 import generation_pb2 as G
from tests.gateway.conftest import Stack
from tests.gateway.test_embeddings_e2e import start_pooling_stack, stop, wait_blocks_free
from tests.gateway.test_openai_api import base_url

POOL_ID = "rerank-tests"
NO, YES = "a", "b"  # single tokens of the tiny tokenizer, standing for "no" and "yes"
QUERY = "Which animal purrs?"
DOCS = ["The cat purrs on the mat.", "Engines run on fuel.", "Dogs bark at night."]


@pytest.fixture(scope="module")
def reranker(tiny_model_dir: Path) -> Iterator[Stack]:
    config = f'{{"classifier_from_token": ["{NO}", "{YES}"]}}'
    stack = start_pooling_stack(tiny_model_dir, POOL_ID, "--pooler-config", config)
    yield stack
    stop(stack)


@pytest.fixture(scope="module")
def hf_score(tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in (NO, YES))

    def score(query: str, doc: str) -> float:
        ids = tokenizer(query, doc).input_ids
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return torch.sigmoid(logits[yes] - logits[no]).item()

    return score


def test_rerank_ranks_documents_by_hf_yes_no_probability(reranker: Stack, hf_score) -> None:
    body = {"model": "tiny-llama", "query": QUERY, "documents": DOCS, "top_n": 2}
    r = httpx.post(f"{base_url(reranker.http_port)}/rerank", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    expected = [hf_score(QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:2]
    assert [x["index"] for x in out["results"]] == order
    for x in out["results"]:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-5)
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert out["usage"]["total_tokens"] > 0
    wait_blocks_free(reranker, POOL_ID)


def test_score_one_to_many_and_pairwise(reranker: Stack, hf_score) -> None:
    url = f"{base_url(reranker.http_port)}/score"
    one = httpx.post(url, json={"text_1": QUERY, "text_2": DOCS}, timeout=30).json()
    assert [d["score"] for d in one["data"]] == pytest.approx(
        [hf_score(QUERY, d) for d in DOCS], abs=1e-5
    )
    queries = ["purr?", "fuel?", "bark?"]
    pairwise = httpx.post(url, json={"text_1": queries, "text_2": DOCS}, timeout=30).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [hf_score(q, d) for q, d in zip(queries, DOCS, strict=True)], abs=1e-5
    )
    assert [d["index"] for d in pairwise["data"]] == [0, 1, 2]


def test_grpc_embed_of_a_pair_is_its_score(reranker: Stack, hf_score) -> None:
    request = G.EmbedRequest(pair=G.TextPair(query=QUERY, document=DOCS[0]))
    out = reranker.stub().Embed(request, timeout=30)
    assert list(out.embedding) == pytest.approx([hf_score(QUERY, DOCS[0])], abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("rerank", {"query": "q", "documents": []}, "documents"),
        ("rerank", {"query": "q", "documents": ["ok", {"title": "x"}]}, "documents[1]"),
        ("rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
        ("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("embeddings", {"input": "hello"}, "model"),
    ],
)
def test_bad_scoring_requests_are_400_naming_the_field(
    reranker: Stack, path: str, body: dict, param: str
) -> None:
    r = httpx.post(f"{base_url(reranker.http_port)}/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
