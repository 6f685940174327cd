"""A sequence classifier through the whole stack (a ``LlamaForSequenceClassification``
checkpoint served by ``--runner pooling``): vLLM's ``/classify`` gives transformers' softmax
over the checkpoint's labels for texts and token ids, the most likely label by its
``id2label`` name, and ``/pooling`` the same values; bad input is a 400 naming the field;
embeddings and rerank name what the model is instead; no block is left in use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from pagedserve.tools.tiny_model import write_tiny_model
from tests.gateway.conftest import Stack
from tests.gateway.test_embeddings_e2e import start_pooling_stack, stop, wait_blocks_free
from tests.gateway.test_openai_api import base_url

POOL_ID = "classify-tests"
TEXTS = ["The cat sat on the mat.", "Engines run on fuel.", "hi"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cls") / "tiny-cls", seed=3, num_labels=3)


@pytest.fixture(scope="module")
def classifier(classifier_dir: Path) -> Iterator[Stack]:
    stack = start_pooling_stack(classifier_dir, POOL_ID)
    yield stack
    stop(stack)


def hf_probs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return torch.softmax(model.eval()(torch.tensor([ids])).logits[0], dim=-1)


def test_classify_gives_transformers_probabilities_and_label(
    classifier: Stack, classifier_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir, local_files_only=True)
    url = f"{base_url(classifier.http_port).removesuffix('/v1')}/classify"
    r = httpx.post(url, json={"model": "tiny-cls", "input": TEXTS}, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    ids = [tokenizer(t).input_ids for t in TEXTS]
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    for d, prompt in zip(out["data"], ids, strict=True):
        want = hf_probs(classifier_dir, prompt)
        torch.testing.assert_close(torch.tensor(d["probs"]), want, rtol=1e-4, atol=1e-5)
        assert d["num_classes"] == 3 and d["label"] == f"label_{int(want.argmax())}"
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids))
    one = httpx.post(url, json={"input": ids[1]}, timeout=30).json()  # token ids
    assert one["data"][0]["probs"] == pytest.approx(out["data"][1]["probs"], abs=1e-6)
    pooled = httpx.post(url.replace("/classify", "/pooling"), json={"input": TEXTS}, timeout=30)
    assert [d["object"] for d in pooled.json()["data"]] == ["pooling"] * 3
    assert [d["data"] for d in pooled.json()["data"]] == [
        pytest.approx(d["probs"], abs=1e-6) for d in out["data"]
    ]
    wait_blocks_free(classifier, POOL_ID)


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/classify", {"input": []}, "input", "must not be empty"),
        ("/classify", {"input": ["ok", ""]}, "input[1]", "must not be empty"),
        ("/v1/embeddings", {"input": "hello"}, "model", "use /classify"),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}, "model", "not a reranker"),
    ],
)
def test_bad_classify_requests_are_400_naming_the_field(
    classifier: Stack, path: str, body: dict, param: str, says: str
) -> None:
    root = base_url(classifier.http_port).removesuffix("/v1")
    r = httpx.post(f"{root}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
