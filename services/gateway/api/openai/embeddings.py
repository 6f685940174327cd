"""OpenAI's ``POST /v1/embeddings`` over the gateway's ``Embed`` (a pooling executor's
vectors): ``input`` as a string, a list of strings, a token-id list or a list of them;
``dimensions``; ``encoding_format`` ``float`` or ``base64`` (little-endian float32, what the
official client asks for by default); vLLM's ``normalize`` and ``priority``. The inputs run
concurrently; an error about one names it (``input[2]``)."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.v1 import generation_pb2
from services.common.limits import FieldError
from services.gateway.api.http import as_http, ignored_headers
from services.gateway.core.embedding import EmbeddingService
from services.gateway.core.generation import GenerationCore, GenerationError

__all__ = ["EmbeddingsBody", "add_embedding_routes", "embed_all", "encode"]

Input = str | list[str] | list[int] | list[list[int]]


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Input
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    normalize: bool | None = None  # vLLM's: default the --pooler-config's
    priority: int = 0

    def to_embeds(self, lora: str) -> list[generation_pb2.EmbedRequest]:
        """One ``EmbedRequest`` per input."""
        inputs: list[str | list[int]]
        if isinstance(self.input, str):
            inputs = [self.input]
        elif self.input and all(isinstance(x, int) for x in self.input):
            inputs = [list(self.input)]  # type: ignore[arg-type]  # one token-id list
        else:
            inputs = list(self.input)  # type: ignore[arg-type]
        if not inputs:
            raise FieldError("input", "must not be empty")
        out = []
        for i, x in enumerate(inputs):
            req = generation_pb2.EmbedRequest(priority=self.priority, lora_name=lora)
            if not x:  # (OpenAI's rule: "" would embed the special tokens alone)
                raise FieldError(f"input[{i}]" if len(inputs) > 1 else "input", "must not be empty")
            if isinstance(x, str):
                req.text = x
            else:
                req.token_ids.ids.extend(x)
            if self.dimensions is not None:
                req.dimensions = self.dimensions
            if self.normalize is not None:
                req.normalize = self.normalize
            out.append(req)
        return out


def encode(vector: list[float], fmt: str) -> list[float] | str:
    """A vector as sent: floats, or base64 of little-endian float32."""
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _name_the_input(exc: GenerationError, name: str, i: int, many: bool) -> GenerationError:
    """An error about input ``i`` of several names it (``input[i]``; ``name`` is the
    request's list of inputs)."""
    if many and (exc.field or "").startswith(("text", "token_ids", "input", "pair")):
        exc.field = f"{name}[{i}]"
        exc.message = f"{exc.field}: {exc.message.split(': ', 1)[-1]}"
    elif exc.field in ("text", "token_ids.ids") or (exc.field or "").startswith("pair"):
        exc.field = name
        exc.message = f"{name}: {exc.message.split(': ', 1)[-1]}"
    return exc


def _failed_with(task: asyncio.Future[Any], exc: BaseException) -> bool:
    return task.done() and not task.cancelled() and task.exception() is exc


async def embed_all(
    service: EmbeddingService,
    core: GenerationCore,
    requests: list[generation_pb2.EmbedRequest],
    name: str,
) -> list[generation_pb2.EmbedResponse]:
    """Every request's answer, run concurrently; the first to fail fails them all (the
    others aborted), its error naming ``name[i]``. Raises FieldError past the admission's
    capacity."""
    core.admission.check_fits(len(requests), name, "inputs")
    tasks = [asyncio.ensure_future(service.embed(r)) for r in requests]
    try:
        return list(await asyncio.gather(*tasks))
    except GenerationError as exc:
        i = next(i for i, t in enumerate(tasks) if _failed_with(t, exc))
        raise _name_the_input(exc, name, i, len(requests) > 1) from None
    finally:
        for t in tasks:
            t.cancel()  # (the others', when one failed: aborted on their executors)


def add_embedding_routes(
    app: FastAPI, core: GenerationCore, check_model: Callable[[str | None], str]
) -> None:
    service = EmbeddingService(core)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsBody) -> Response:
        headers = ignored_headers(body, "/v1/embeddings")
        with as_http(headers):
            info = core.pool.info
            if info is not None and info.num_labels:
                raise FieldError(
                    "model",
                    "this model scores instead of embedding: use /classify (a classifier of "
                    "several labels) or /v1/score and /v1/rerank (a reranker's one score)",
                )
            requests = body.to_embeds(check_model(body.model))
            results = await embed_all(service, core, requests, "input")
        prompt_tokens = sum(r.usage.prompt_tokens for r in results)
        data: list[dict[str, Any]] = [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode(list(r.embedding), body.encoding_format),
            }
            for i, r in enumerate(results)
        ]
        return JSONResponse(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": body.model or core.model_name,
                "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            },
            headers=headers,
        )
