"""vLLM's ``POST /classify`` over a sequence classifier (an executor serving a
``*ForSequenceClassification`` checkpoint with ``--runner pooling``): ``input`` as a string,
a list of strings, a token-id list or a list of them; for each, the softmax probabilities of
the checkpoint's labels (``id2label``), the most likely label and ``num_classes``. And vLLM's
``POST /pooling``: whatever a pooling executor returns for each input, as it is (a vector,
a classifier's probabilities, a reranker's score). The inputs run concurrently, as
embeddings do."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from services.common.limits import FieldError
from services.gateway.api.http import as_http, ignored_headers
from services.gateway.api.openai.embeddings import EmbeddingsBody, Input, embed_all, encode
from services.gateway.core.embedding import EmbeddingService
from services.gateway.core.errors import ErrorKind, GenerationError
from services.gateway.core.generation import GenerationCore

__all__ = ["ClassifyBody", "PoolingBody", "add_classify_routes"]


class ClassifyBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Input
    user: str | None = None
    priority: int = 0


class PoolingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None
    user: str | None = None
    priority: int = 0


def _labels(core: GenerationCore) -> list[str]:
    info = core.pool.info
    if info is None:
        raise GenerationError(ErrorKind.UNAVAILABLE, "no executor is serving yet")
    if len(info.labels) < 2:
        raise FieldError(
            "model",
            "this model is not a classifier: /classify needs executors serving a "
            "*ForSequenceClassification checkpoint of two labels or more with --runner pooling",
        )
    return list(info.labels)


def _listing(kind: str, model: str, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """vLLM's answer envelope: an id of ``kind``, the items, the prompt tokens counted."""
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


def add_classify_routes(
    app: FastAPI, core: GenerationCore, check_model: Callable[[str | None], str]
) -> None:
    service = EmbeddingService(core)

    @app.post("/classify")
    async def classify(body: ClassifyBody) -> Response:
        headers = ignored_headers(body, "/classify")
        with as_http(headers):
            labels = _labels(core)
            inputs = EmbeddingsBody(input=body.input, priority=body.priority)
            results = await embed_all(
                service, core, inputs.to_embeds(check_model(body.model)), "input"
            )
        tokens = sum(r.usage.prompt_tokens for r in results)
        data: list[dict[str, Any]] = []
        for i, r in enumerate(results):
            probs = list(r.embedding)
            best = max(range(len(probs)), key=probs.__getitem__) if probs else 0
            label = labels[best] if best < len(labels) else f"LABEL_{best}"
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return JSONResponse(
            _listing("classify", body.model or core.model_name, data, tokens), headers=headers
        )

    @app.post("/pooling")
    async def pooling(body: PoolingBody) -> Response:
        headers = ignored_headers(body, "/pooling")
        with as_http(headers):
            inputs = EmbeddingsBody(
                input=body.input,
                dimensions=body.dimensions,
                normalize=body.normalize,
                priority=body.priority,
            )
            results = await embed_all(
                service, core, inputs.to_embeds(check_model(body.model)), "input"
            )
        tokens = sum(r.usage.prompt_tokens for r in results)
        data = [
            {
                "index": i,
                "object": "pooling",
                "data": encode(list(r.embedding), body.encoding_format),
            }
            for i, r in enumerate(results)
        ]
        return JSONResponse(
            _listing("pool", body.model or core.model_name, data, tokens), headers=headers
        )
