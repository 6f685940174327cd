"""Embeddings through the whole stack as real processes (block manager, an executor started
with ``--runner pooling``, gateway): the official ``openai`` client's ``embeddings.create``
(base64 by default, and float) and the gRPC ``Embed`` give HF ``AutoModel``'s last-token
vectors, normalized; a shared prefix is served from the cache; bad input is a 400 / an
INVALID_ARGUMENT naming the field; generation on a pooling executor names the runner; no
block is left in use."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, PreTrainedTokenizerBase

from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving, wait_until
from pagedserve.v1 import generation_pb2 as G
from services.blockmgr.client import GrpcClient
from tests.gateway.conftest import Stack, stack_executor_args
from tests.gateway.test_openai_api import base_url

POOL_ID = "embedding-tests"
TEXTS = ["The cat sat on the mat.", "Paged attention keeps the KV cache in blocks.", "hi"]


def start_pooling_stack(model_dir: Path, pool_id: str, *executor_flags: str) -> Stack:
    """Block manager, an executor with ``--runner pooling`` and ``executor_flags``, gateway."""
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    executor = ServiceProcess(
        stack_executor_args(
            model_dir,
            "--runner",
            "pooling",
            "--blockmgr-address",
            blockmgr.address,
            "--pool-id",
            pool_id,
            *executor_flags,
        ),
        "executor_ready",
    )
    gateway = ServiceProcess(
        gateway_args(model_dir, executor.address, "--metrics-port", "0"), "gateway_listening"
    )
    metrics_port = int(gateway.wait_for_event("metrics_listening")["metrics_port"])
    http_port = int(gateway.wait_for_event("http_listening")["http_port"])
    wait_serving(gateway.address)
    return Stack(model_dir, blockmgr, executor, gateway, metrics_port, http_port)


def stop(stack: Stack) -> None:
    for proc in (stack.gateway, stack.executor, stack.blockmgr):
        assert proc.stop() == 0, proc.args[0]


@pytest.fixture(scope="module")
def pooling_stack(tiny_model_dir: Path) -> Iterator[Stack]:
    stack = start_pooling_stack(tiny_model_dir, POOL_ID)
    yield stack
    stop(stack)


@pytest.fixture(scope="module")
def client(pooling_stack: Stack) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=base_url(pooling_stack.http_port), api_key="k", max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> AutoModel:
    return AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def expected(hf: AutoModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return F.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)


def assert_close(got: list[float], want: torch.Tensor) -> None:
    assert F.cosine_similarity(torch.tensor(got), want, dim=0).item() >= 0.99999
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)


def wait_blocks_free(stack: Stack, pool_id: str = POOL_ID) -> None:
    """Every block of the pool free (a pooling request's blocks go with the executor's next
    step, just after its vector went out)."""

    def free() -> bool:
        client = GrpcClient(stack.blockmgr.address)
        try:
            return client.stats(pool_id).counters.num_in_use_blocks == 0
        finally:
            client.close()

    wait_until(free, what="every block free")


def vector(embedding: list[float] | str) -> list[float]:
    """An embedding as sent: floats, or base64 of little-endian float32."""
    if isinstance(embedding, str):
        raw = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return embedding


# None: the client's default, which asks for base64 and decodes it itself
@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_client_embeddings_equal_hf_last_token_pooling(
    client: openai.OpenAI,
    hf: AutoModel,
    tokenizer: PreTrainedTokenizerBase,
    encoding_format: str | None,
) -> None:
    model = client.models.list().data[0].id
    kw = {"encoding_format": encoding_format} if encoding_format else {}
    out = client.embeddings.create(model=model, input=TEXTS, **kw)  # type: ignore[arg-type]
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == model
    ids = [tokenizer(t).input_ids for t in TEXTS]
    for d, prompt in zip(out.data, ids, strict=True):
        assert_close(vector(d.embedding), expected(hf, prompt))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))


def test_dimensions_keep_the_first_values_normalized(
    client: openai.OpenAI, hf: AutoModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    model = client.models.list().data[0].id
    out = client.embeddings.create(model=model, input=TEXTS[0], dimensions=8)
    with torch.inference_mode():
        raw = hf(torch.tensor([tokenizer(TEXTS[0]).input_ids])).last_hidden_state[0, -1]
    assert_close(out.data[0].embedding, F.normalize(raw[:8], dim=0))


def test_pooling_route_returns_the_embedding_as_it_is(
    pooling_stack: Stack, hf: AutoModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    url = f"{base_url(pooling_stack.http_port).removesuffix('/v1')}/pooling"
    body = {"input": TEXTS[:2], "encoding_format": "base64"}
    out = httpx.post(url, json=body, timeout=30).json()
    assert [d["object"] for d in out["data"]] == ["pooling", "pooling"]
    for d, text in zip(out["data"], TEXTS, strict=False):
        assert_close(vector(d["data"]), expected(hf, tokenizer(text).input_ids))


def test_grpc_embed_of_token_ids_hits_the_prefix_cache(pooling_stack: Stack, hf: AutoModel) -> None:
    stub = pooling_stack.stub()
    shared = [(7 * i) % 500 + 3 for i in range(40)]
    first = stub.Embed(G.EmbedRequest(token_ids=G.TokenIds(ids=[*shared, 5, 6])), timeout=30)
    second = stub.Embed(G.EmbedRequest(token_ids=G.TokenIds(ids=[*shared, 8, 9, 10])), timeout=30)
    assert first.usage.prompt_tokens == 42 and first.usage.completion_tokens == 0
    assert second.usage.cached_prompt_tokens == 32  # two full blocks of 16
    assert_close(list(second.embedding), expected(hf, [*shared, 8, 9, 10]))
    wait_blocks_free(pooling_stack)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": "hi", "dimensions": 100000}, "dimensions", "must be in [1, "),
        ({"input": ["ok", ""]}, "input[1]", "must not be empty"),
        ({"input": [[1, 2], [1, 10**9]]}, "input[1]", ""),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_field(
    pooling_stack: Stack, body: dict, param: str, message: str
) -> None:
    r = httpx.post(f"{base_url(pooling_stack.http_port)}/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_generation_on_a_pooling_executor_is_400_naming_the_runner(
    client: openai.OpenAI, pooling_stack: Stack
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=4)
    assert "--runner pooling executors; a generation needs --runner generate" in str(err.value)
    with pytest.raises(grpc.RpcError) as rpc:
        list(pooling_stack.stub().Generate(G.GenerateRequest(prompt="hi"), timeout=30))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_blocks_free(pooling_stack)


def test_scores_on_an_embedding_model_are_400_naming_the_model(pooling_stack: Stack) -> None:
    url = base_url(pooling_stack.http_port)
    r = httpx.post(f"{url}/rerank", json={"query": "q", "documents": ["d"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "not a reranker" in r.json()["error"]["message"]
