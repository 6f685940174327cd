"""Tool-call parsers: a chat reply's tool calls, in the format a model family was trained to
write them, for ``tool_choice: "auto"`` (the gateway's ``--tool-call-parser``, vLLM's names).

With ``auto`` the model decides between text and calls, so nothing constrains its output; the
parser reads the calls out of the finished text, and while it streams says how much of it is
surely text (:meth:`ToolCallParser.content_end`) so that text goes out as it comes and the
calls, once complete, whole. Output that looks like a call but does not parse, lacks its
arguments or calls a function the request did not declare stays text, as vLLM returns it.

- ``hermes`` (Qwen2.5, Qwen3, QwQ, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks, text before them the reply's content.
- ``llama3_json`` (Llama 3.1+): the reply is one JSON call ``{"name": ..., "parameters":
  {...}}`` (or several, separated by ``;``), optionally after ``<|python_tag|>``.

With ``tool_choice`` ``required`` or a named function the reply is constrained to the calls
instead (:class:`ToolCalls`), and read back from it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from services.gateway.text.stop_strings import holdback_len


@dataclass(frozen=True)
class ParsedReply:
    """A finished reply: its text outside the calls (None when there is none) and each call's
    (function name, arguments as a JSON object's text)."""

    content: str | None
    calls: list[tuple[str, str]]


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str, tools: Collection[str]) -> ParsedReply:
        """The calls in a finished reply, of the functions named ``tools``; no call
        (``text`` as content) if they do not parse."""
        ...

    def content_end(self, text: str, start: int = 0) -> int:
        """How much of ``text`` (a reply so far) is surely content: text from here on may be,
        or start, a call, and is held until the reply is finished. ``start``: the end given
        for the reply's text before (it only grows)."""
        ...


def _call(obj: Any, args_keys: tuple[str, ...], tools: Collection[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of one decoded call object of a declared function, or None if
    it is not one."""
    if not isinstance(obj, dict) or obj.get("name") not in tools:
        return None
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        return None
    args = obj[key]
    if isinstance(args, str):  # some templates put the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesParser:
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tools: Collection[str]) -> ParsedReply:
        first = text.find(self.start)
        if first < 0:
            return ParsedReply(text, [])
        calls = []
        for body in self._block.findall(text, first):
            try:
                call = _call(json.loads(body), ("arguments",), tools)
            except (ValueError, RecursionError):  # (RecursionError: nested too deep)
                call = None
            if call is None:
                return ParsedReply(text, [])
            calls.append(call)
        content = text[:first].strip()
        return ParsedReply(content or None, calls)

    def content_end(self, text: str, start: int = 0) -> int:
        # A marker that ends before ``start``'s held part would have stopped ``start``.
        first = text.find(self.start, max(start, 0))
        if first >= 0:
            return first
        return len(text) - holdback_len(text, (self.start,))


class Llama3JsonParser:
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, tools: Collection[str]) -> ParsedReply:
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag) :].lstrip()
        if not body.startswith("{"):
            return ParsedReply(text, [])
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return ParsedReply(text, [])
            call = _call(obj, ("parameters", "arguments"), tools)
            if call is None:
                return ParsedReply(text, [])
            calls.append(call)
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return ParsedReply(text, [])
            at = len(body) - len(rest)
        return ParsedReply(None, calls)

    def content_end(self, text: str, start: int = 0) -> int:
        body = text.lstrip()
        if not body:
            return 0  # leading blanks: the reply may still open with a call
        if body.startswith(("{", self.tag)) or self.tag.startswith(body):
            return 0
        return len(text)


PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser named ``name`` (one of :data:`PARSERS`)."""
    return PARSERS[name]()


# ---- the calls a request requires (tool_choice required or named) ----------------------------


@dataclass(frozen=True)
class ToolCalls:
    """What a chat reply with tools must be: the arguments of function ``name`` (a named
    ``tool_choice``), or, with ``name`` None (``required``), a JSON list of one or more
    ``{"name", "parameters"}`` calls; ``schema`` constrains the output to it."""

    name: str | None
    schema: dict[str, Any]
    field: str = "tools"  # the request field the schema comes from (errors name it)

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """The (function name, arguments JSON) of each call in a complete output; None if
        it is not one (cut by max_tokens)."""
        if self.name is not None:
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return None
            return [(self.name, text)]
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def calls_schema(names: list[str], params: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """One or more calls of the tools (one with ``parallel`` false), as vLLM constrains
    ``tool_choice: required``."""
    return {
        "type": "array",
        "minItems": 1,
        **({} if parallel else {"maxItems": 1}),
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in zip(names, params, strict=True)
            ]
        },
    }
