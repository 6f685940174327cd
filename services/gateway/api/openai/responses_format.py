"""The Responses API's answer, or its typed event stream, made from the chat formatter's
objects (what the chat route would answer for the same conversation).

Output items, in order: the reasoning (with ``--reasoning-parser``) as a ``reasoning`` item,
the text as a ``message`` item with one ``output_text`` part, each call as a
``function_call`` item. ``status`` is ``completed``, or ``incomplete`` (``incomplete_details:
{"reason": "max_output_tokens"}``) for an output cut at its limit. Usage: ``input_tokens``
(``input_tokens_details.cached_tokens``: those read from the prefix cache),
``output_tokens``, ``total_tokens``.

The stream: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its deltas (``response.output_text.delta`` within
``response.content_part.added`` / ``done``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``) and their ``done`` events,
``response.output_item.done``; then ``response.completed`` (or ``response.incomplete``) with
the whole response. Every event carries its ``sequence_number``; an error after the start is
an ``error`` event.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pagedserve.v1 import generation_pb2
from services.gateway.api.openai.errors import HttpError
from services.gateway.api.openai.format import Formatter
from services.gateway.api.openai.responses_protocol import ResponsesRequest
from services.gateway.core.generation import GenerationError

__all__ = ["ResponsesFormatter"]


class ResponsesFormatter:
    """One Responses request's answer, from the chat formatter ``chat`` of its translation."""

    def __init__(self, chat: Formatter, request: ResponsesRequest) -> None:
        self.chat = chat
        self.request = request
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def error(self, exc: GenerationError) -> HttpError:
        return self.chat.error(exc)

    # -- a whole response --

    async def collect(self, responses: AsyncIterator[generation_pb2.GenerateResponse]) -> Any:
        chat = await self.chat.collect(responses)
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_id("rs"), message["reasoning_content"]))
        if message.get("content"):
            output.append(_message_item(_id("msg"), message["content"]))
        for call in message.get("tool_calls") or ():
            fn = call["function"]
            output.append(_call_item(_id("fc"), call["id"], fn["name"], fn["arguments"]))
        return self._response(output, choice["finish_reason"], chat["usage"])

    def _response(
        self, output: list[dict[str, Any]], finish: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        req = self.request
        done = finish is not None
        cut = finish == "length"
        fmt = req.text.format if req.text is not None and req.text.format else {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": ("incomplete" if cut else "completed") if done else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": self.chat.core.model_name,
            "instructions": req.instructions,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None,
            "reasoning": req.reasoning,
            "store": False,
            "text": {"format": fmt},
            "truncation": "disabled",
            "user": req.user,
            "metadata": req.metadata or {},
            "usage": _usage(usage) if usage is not None else None,
        }

    # -- the stream --

    async def events(
        self,
        first: generation_pb2.GenerateResponse | None,
        responses: AsyncIterator[generation_pb2.GenerateResponse],
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events; the caller owns (and closes) ``responses``."""
        items = _Items()
        yield items.event("response.created", response=self._response([], None, None))
        yield items.event("response.in_progress", response=self._response([], None, None))
        finish: str | None = None
        usage: dict[str, Any] | None = None
        try:
            async with contextlib.aclosing(self.chat.chunks(first, responses)) as chunks:
                async for chunk in chunks:
                    if chunk.get("usage") and not chunk["choices"]:
                        usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        for event in items.deltas(choice.get("delta") or {}):
                            yield event
                        finish = choice.get("finish_reason") or finish
        except GenerationError as exc:
            error = self.error(exc).body()["error"]
            yield items.event(
                "error", code=error["code"], message=error["message"], param=error["param"]
            )
            return
        for event in items.close():
            yield event
        response = self._response(items.output, finish or "stop", usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield items.event(kind, response=response)


class _Items:
    """The output items of a streamed response, opened and closed as the chat deltas come:
    one item at a time, a new one for each kind of content and for each call."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.open: tuple[str, int] | None = None  # (kind, call index)
        self.sequence = 0

    def event(self, kind: str, **body: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **body})
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    @property
    def _item(self) -> dict[str, Any]:
        return self.output[-1]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._item["id"], "output_index": len(self.output) - 1}

    def deltas(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if thought := delta.get("reasoning_content"):
            out += self._switch(("reasoning", 0), _reasoning_item(_id("rs"), ""))
            self._item["content"][0]["text"] += thought
            out.append(
                self.event(
                    "response.reasoning_text.delta", **self._where(), content_index=0, delta=thought
                )
            )
        if text := delta.get("content"):
            out += self._switch(("message", 0), _message_item(_id("msg"), ""))
            self._item["content"][0]["text"] += text
            out.append(
                self.event(
                    "response.output_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            index = call.get("index", 0)
            if call.get("id") is not None or self.open != ("function_call", index):
                item = _call_item(_id("fc"), call.get("id") or _id("call"), fn.get("name", ""), "")
                out += self._switch(("function_call", index), item, always=True)
            if arguments := fn.get("arguments"):
                self._item["arguments"] += arguments
                out.append(
                    self.event(
                        "response.function_call_arguments.delta", **self._where(), delta=arguments
                    )
                )
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        kind, _ = self.open
        self.open = None
        item, where = self._item, self._where()
        out = []
        if kind == "message":
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            out.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        out.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        return out

    def _switch(
        self, kind: tuple[str, int], item: dict[str, Any], always: bool = False
    ) -> list[bytes]:
        if self.open == kind and not always:
            return []
        out = self.close()
        self.open = kind
        item["status"] = "in_progress"
        added = {**item, "content": []} if "content" in item else dict(item)
        self.output.append(item)
        out.append(
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)
        )
        if kind[0] == "message":
            out.append(
                self.event(
                    "response.content_part.added",
                    **self._where(),
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        return out


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _message_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }
