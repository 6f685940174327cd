"""Anthropic's message, or its stream of events, made from the chat formatter's objects: the
chat completion (or its chunks) is what the OpenAI front would answer for the same
conversation, so detokenization, stop strings, tool-call parsing and reasoning are shared.

Content blocks: the reasoning (with ``--reasoning-parser``) as a ``thinking`` block, the text
as a ``text`` block, each call as a ``tool_use`` block (``input``: its JSON arguments). Stop
reasons: ``max_tokens`` for an output cut at its limit, ``tool_use`` when it calls a tool,
``stop_sequence`` (naming it) when a stop string ended it, else ``end_turn``. Usage:
``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those served
from the prefix cache (Anthropic counts them apart; their sum is the prompt).

The stream is Anthropic's: ``message_start``, ``ping``, then per block
``content_block_start`` / ``content_block_delta`` (``text_delta``, ``thinking_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason, usage)
and ``message_stop``; an error after the start is an ``error`` event.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pagedserve.v1 import generation_pb2
from services.gateway.api.openai.errors import HttpError
from services.gateway.api.openai.format import Formatter
from services.gateway.core.generation import GenerationError

__all__ = ["MessagesFormatter"]


class MessagesFormatter:
    """One Messages request's answer, from the chat formatter ``chat`` of its translation."""

    def __init__(self, chat: Formatter) -> None:
        self.chat = chat
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._stop_sequence: str | None = None

    def error(self, exc: GenerationError) -> HttpError:
        error = self.chat.error(exc)
        error.anthropic = True
        return error

    def _note(self, r: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
        if r.WhichOneof("stopped_by") == "stop_string":
            self._stop_sequence = r.stop_string
        return r

    async def _noted(
        self, responses: AsyncIterator[generation_pb2.GenerateResponse]
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        async for r in responses:
            yield self._note(r)

    # -- a whole message --

    async def collect(self, responses: AsyncIterator[generation_pb2.GenerateResponse]) -> Any:
        async with contextlib.aclosing(self._noted(responses)) as noted:
            chat = await self.chat.collect(noted)
        choice = chat["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append(
                {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
            )
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            fn = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_use_id(call["id"]),
                    "name": fn["name"],
                    "input": _input(fn["arguments"]),
                }
            )
        reason = self._stop_reason(choice["finish_reason"], bool(message.get("tool_calls")))
        return {
            **self._message(),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": self._stop_sequence if reason == "stop_sequence" else None,
            "usage": _usage(chat["usage"]),
        }

    def _message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.chat.core.model_name,
        }

    def _stop_reason(self, finish: str | None, calls: bool) -> str:
        if finish == "length":
            return "max_tokens"
        if calls or finish == "tool_calls":
            return "tool_use"
        return "stop_sequence" if self._stop_sequence is not None else "end_turn"

    # -- the stream --

    async def events(
        self,
        first: generation_pb2.GenerateResponse | None,
        responses: AsyncIterator[generation_pb2.GenerateResponse],
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events; the caller owns (and closes) ``responses``."""
        prompt = len(self.chat.prompt_ids.get(0, ()))
        start = {
            **self._message(),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("ping", {"type": "ping"})
        blocks = _Blocks()
        finish: str | None = None
        usage: dict[str, Any] | None = None
        try:
            first = self._note(first) if first is not None else None
            async with (
                contextlib.aclosing(self._noted(responses)) as noted,
                contextlib.aclosing(self.chat.chunks(first, noted)) as chunks,
            ):
                async for chunk in chunks:
                    if chunk.get("usage") and not chunk["choices"]:
                        usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        for event in blocks.deltas(choice.get("delta") or {}):
                            yield event
                        finish = choice.get("finish_reason") or finish
        except GenerationError as exc:
            yield _event("error", self.error(exc).body())
            return
        for event in blocks.close():
            yield event
        reason = self._stop_reason(finish, blocks.calls > 0)
        delta = {
            "stop_reason": reason,
            "stop_sequence": self._stop_sequence if reason == "stop_sequence" else None,
        }
        final = _usage(usage) if usage is not None else {"output_tokens": 0}
        yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": final})
        yield _event("message_stop", {"type": "message_stop"})


class _Blocks:
    """The content blocks of a streamed message, opened and closed as the chat deltas come:
    one block at a time, a new one for each kind of content and for each call."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None  # (kind, call index)
        self.calls = 0

    def deltas(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if thought := delta.get("reasoning_content"):
            block = {"type": "thinking", "thinking": "", "signature": ""}
            out += self._switch(("thinking", 0), block)
            out.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if delta.get("content"):
            out += self._switch(("text", 0), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if call.get("id") is not None or self.open != ("tool_use", call.get("index", 0)):
                tool: dict[str, Any] = {
                    "type": "tool_use",
                    "id": _tool_use_id(call.get("id") or uuid.uuid4().hex),
                    "name": fn.get("name", ""),
                    "input": {},
                }
                out += self._switch(("tool_use", call.get("index", 0)), tool, always=True)
                self.calls += 1
            if arguments := fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _switch(
        self, kind: tuple[str, int], block: dict[str, Any], always: bool = False
    ) -> list[bytes]:
        if self.open == kind and not always:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        out.append(_event("content_block_start", start))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return _event("content_block_delta", body)


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "output_tokens": chat_usage["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    """A call's arguments as its ``input``: the JSON object they spell (a constrained call's
    always do; a parsed one's that do not are passed whole as a string)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}


def _event(kind: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()
