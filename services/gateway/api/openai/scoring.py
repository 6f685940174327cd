"""vLLM's scoring routes over a reranker (an executor whose ``--pooler-config`` has
``classifier_from_token``): ``POST /v1/score`` (``text_1`` against each of ``text_2``, or
pairwise) and the Jina / Cohere ``POST /v1/rerank`` (``query``, ``documents``, ``top_n``;
also at ``/rerank`` and ``/v2/rerank``). Each (query, document) pair is tokenized as the
tokenizer pairs two texts and scored by the gateway's ``Embed``: sigmoid(logit[yes] -
logit[no]) at its last token. Prompt templates such as Qwen3-Reranker's instruction are
the client's to put in the texts, as with vLLM."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.v1 import generation_pb2
from services.common.limits import FieldError
from services.gateway.api.http import as_http, ignored_headers
from services.gateway.api.openai.embeddings import embed_all
from services.gateway.core.embedding import EmbeddingService
from services.gateway.core.generation import GenerationCore

__all__ = ["RerankBody", "ScoreBody", "add_scoring_routes"]


class ScoreBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = 0

    def pairs(self) -> list[tuple[str, str]]:
        """One query against every document, or as many queries as documents, pairwise."""
        queries = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        docs = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not queries or not docs:
            raise FieldError("text_1" if not queries else "text_2", "must not be empty")
        if len(queries) == 1:
            return [(queries[0], d) for d in docs]
        if len(queries) != len(docs):
            raise FieldError(
                "text_2",
                f"{len(docs)} texts for {len(queries)} text_1: give one text_1, or one per text_2",
            )
        return list(zip(queries, docs, strict=True))


class RerankBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    priority: int = 0

    def texts(self) -> list[str]:
        out = []
        for i, d in enumerate(self.documents):
            text = d if isinstance(d, str) else d.get("text")
            if not isinstance(text, str):
                raise FieldError(f"documents[{i}]", 'must be a string or {"text": string}')
            out.append(text)
        if not out:
            raise FieldError("documents", "must not be empty")
        return out


def _requests(
    pairs: list[tuple[str, str]], lora: str, priority: int
) -> list[generation_pb2.EmbedRequest]:
    out = []
    for query, doc in pairs:
        req = generation_pb2.EmbedRequest(priority=priority, lora_name=lora)
        req.pair.query, req.pair.document = query, doc
        out.append(req)
    return out


def _check_reranker(core: GenerationCore) -> None:
    info = core.pool.info
    if info is not None and info.num_labels != 1:
        raise FieldError(
            "model",
            "this model is not a reranker: scores need executors started with --runner pooling "
            'and --pooler-config \'{"classifier_from_token": ["no", "yes"]}\', or serving a '
            "one-label *ForSequenceClassification checkpoint (a cross-encoder)",
        )


def add_scoring_routes(
    app: FastAPI, core: GenerationCore, check_model: Callable[[str | None], str]
) -> None:
    service = EmbeddingService(core)

    async def score(body: ScoreBody) -> Response:
        headers = ignored_headers(body, "/v1/score")
        with as_http(headers):
            _check_reranker(core)
            reqs = _requests(body.pairs(), check_model(body.model), body.priority)
            results = await embed_all(service, core, reqs, "text_2")
        tokens = sum(r.usage.prompt_tokens for r in results)
        data = [
            {"index": i, "object": "score", "score": r.embedding[0]} for i, r in enumerate(results)
        ]
        out = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.model or core.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return JSONResponse(out, headers=headers)

    async def rerank(body: RerankBody) -> Response:
        headers = ignored_headers(body, "/v1/rerank")
        with as_http(headers):
            _check_reranker(core)
            docs = body.texts()
            pairs = [(body.query, d) for d in docs]
            reqs = _requests(pairs, check_model(body.model), body.priority)
            results = await embed_all(service, core, reqs, "documents")
        tokens = sum(r.usage.prompt_tokens for r in results)
        ranked = sorted(range(len(docs)), key=lambda i: -results[i].embedding[0])
        out = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": body.model or core.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [
                {"index": i, "relevance_score": results[i].embedding[0]}
                | ({"document": {"text": docs[i]}} if body.return_documents else {})
                for i in ranked[: body.top_n]
            ],
        }
        return JSONResponse(out, headers=headers)

    for path in ("/v1/score", "/score"):
        app.post(path)(score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path)(rerank)
