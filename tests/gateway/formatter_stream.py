"""Drive the OpenAI formatter directly with the core's response messages (for the chat
parsers, whose inputs a random-weight model never writes): whole and streamed results."""

from __future__ import annotations

import asyncio
import functools
import json
from types import SimpleNamespace
from typing import Any

from transformers import PreTrainedTokenizerFast

from pagedserve.tools.tiny_tokenizer import build_tokenizer
from pagedserve.v1 import common_pb2
from pagedserve.v1 import generation_pb2 as G
from services.gateway.api.openai.format import Formatter


def responses(
    parts: list[str], index: int = 0, finish: int = common_pb2.FINISH_REASON_STOP
) -> list[G.GenerateResponse]:
    """One response per text part (a token each, with its logprob), the last one final."""
    out = []
    for k, part in enumerate(parts):
        r = G.GenerateResponse(index=index, text=part, token_ids=[k + 3])
        r.logprobs.add(token_id=k + 3, logprob=-0.5)
        out.append(r)
    out[-1].finish_reason = finish
    out[-1].usage.completion_tokens = len(parts)
    return out


@functools.cache
def _tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())


def formatter(**attrs: Any) -> Formatter:
    """A chat formatter (over the tiny tokenizer) with ``attrs`` set."""
    core = SimpleNamespace(model_name="m", tokenizer=_tokenizer())
    fmt = Formatter(core, "chat", False, False)  # type: ignore[arg-type]
    for name, value in attrs.items():
        setattr(fmt, name, value)
    return fmt


async def _aiter(items: list) -> Any:
    for item in items:
        yield item


def stream(fmt: Formatter, items: list[G.GenerateResponse]) -> list[dict]:
    """The streamed chunks, ``[DONE]`` left out."""

    async def run() -> list[bytes]:
        return [e async for e in fmt.events(None, _aiter(items))]

    return [json.loads(e[len(b"data: ") :]) for e in asyncio.run(run())[:-1]]


def whole(fmt: Formatter, items: list[G.GenerateResponse]) -> list[dict]:
    """The choices of the whole (non-streamed) reply."""
    return asyncio.run(fmt.collect(_aiter(items)))["choices"]


def deltas(chunks: list[dict], index: int = 0) -> list[dict]:
    return [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
