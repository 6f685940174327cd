"""Public production traces, read into requests a cache experiment replays
(:mod:`.sweep`).

- **Mooncake** (FAST'25, ``kvcache-ai/Mooncake`` ``FAST25-release/traces/*.jsonl``): per line
  ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``: the prompt's blocks of
  512 tokens, remapped prefix hashes (equal ids: equal prefixes up to that block).
- **Qwen-Bailian** (ATC'25 "KVCache Cache in the Wild",
  ``alibaba-edu/qwen-bailian-usagetraces-anon``): per line ``chat_id``, ``parent_chat_id``
  (-1: none), ``timestamp`` (s), ``input_length``, ``output_length``, ``type``
  (text/search/image/file), ``turn``, ``hash_ids``: blocks of 16 tokens.

A line that is not such a request is counted and named (its line number and why), never
skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["FORMATS", "BadLine", "PublicRequest", "PublicTrace", "read_public_trace"]

#: Format name -> tokens per hash id.
FORMATS: dict[str, int] = {"mooncake": 512, "bailian": 16}


@dataclass(frozen=True, slots=True)
class PublicRequest:
    """One request of a trace: when it arrives (seconds from the trace's start), its prompt
    and output lengths in tokens, and its prompt's block hash ids (the last block may be
    partial). Bailian's session fields where the format has them."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chat_id: int | None = None
    parent_chat_id: int | None = None
    type: str | None = None
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class BadLine:
    line: int  # 1-based
    reason: str


@dataclass
class PublicTrace:
    """A trace's requests, in arrival order, the tokens per hash id, and its bad lines."""

    format: str
    block_tokens: int
    requests: list[PublicRequest] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)

    def followed(self) -> list[bool]:
        """Per request, whether a later request continues its session: one whose
        ``parent_chat_id`` is its ``chat_id`` (Bailian), or, without chat ids (Mooncake),
        one whose prompt holds its whole prompt (its last hash id: ids name prefixes)."""
        if any(r.chat_id is not None for r in self.requests):
            parents = {r.parent_chat_id for r in self.requests if r.parent_chat_id is not None}
            return [r.chat_id is not None and r.chat_id in parents for r in self.requests]
        later: set[int] = set()
        out = []
        for r in reversed(self.requests):
            out.append(bool(r.hash_ids) and r.hash_ids[-1] in later)
            later.update(r.hash_ids)
        return out[::-1]

    @property
    def max_hit_tokens(self) -> int:
        """The hit tokens of an unbounded cache: per request, its leading blocks whose ids an
        earlier request had, in tokens, capped at its ``input_length``."""
        seen: set[int] = set()
        total = 0
        for r in self.requests:
            run = 0
            for h in r.hash_ids:
                if h not in seen:
                    break
                run += 1
            total += min(run * self.block_tokens, r.input_length)
            seen.update(r.hash_ids)
        return total

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def scaled(self, n: int, scale: float, time_scale: float = 1.0) -> PublicTrace:
        """Its first ``n`` requests with every length times ``scale`` (at least 1 token; the
        hash ids cut to the blocks the prompt then covers) and every time over
        ``time_scale``: what ``bench serve --dataset-name`` sends. ``scale`` must give whole
        tokens per block (ValueError otherwise)."""
        block = self.block_tokens * scale
        if block < 1 or block != int(block):
            raise ValueError(
                f"--trace-scale {scale} gives {block} tokens per trace block: choose one that "
                f"gives a whole number (the trace's blocks are {self.block_tokens} tokens)"
            )
        out = PublicTrace(self.format, int(block))
        for r in self.requests[:n]:
            length = max(1, round(r.input_length * scale))
            out.requests.append(
                replace(
                    r,
                    timestamp_s=r.timestamp_s / time_scale,
                    input_length=length,
                    output_length=max(1, round(r.output_length * scale)),
                    hash_ids=r.hash_ids[: -(-length // int(block))],
                )
            )
        return out


def read_public_trace(path: str | Path, fmt: str) -> PublicTrace:
    """The requests of the ``fmt`` trace at ``path`` (sorted by arrival, stable);
    ValueError naming the format if it is none of :data:`FORMATS`; OSError if unreadable."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {sorted(FORMATS)} or pagedserve")
    trace = PublicTrace(fmt, FORMATS[fmt])
    with open(path, encoding="utf-8") as f:
        _parse(f, fmt, trace)
    trace.requests.sort(key=lambda r: r.timestamp_s)
    return trace


def _parse(lines: Iterable[str], fmt: str, trace: PublicTrace) -> None:
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            trace.requests.append(_request(raw, fmt, trace.block_tokens))
        except (ValueError, KeyError, TypeError) as exc:
            reason = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            trace.bad_lines.append(BadLine(number, reason))


def _request(raw: dict[str, Any], fmt: str, block_tokens: int) -> PublicRequest:
    input_length, output_length = _count(raw, "input_length"), _count(raw, "output_length")
    hash_ids = raw["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise ValueError("hash_ids must be a list of integers")
    if len(hash_ids) != -(-input_length // block_tokens):
        raise ValueError(
            f"{len(hash_ids)} hash_ids for input_length {input_length} "
            f"(blocks of {block_tokens} tokens: {-(-input_length // block_tokens)})"
        )
    timestamp = raw["timestamp"]
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or timestamp < 0:
        raise ValueError("timestamp must be a number >= 0")
    if fmt == "mooncake":
        return PublicRequest(timestamp / 1000.0, input_length, output_length, tuple(hash_ids))
    parent = raw["parent_chat_id"]
    return PublicRequest(
        float(timestamp),
        input_length,
        output_length,
        tuple(hash_ids),
        chat_id=int(raw["chat_id"]),
        parent_chat_id=None if parent is None or int(parent) < 0 else int(parent),
        type=str(raw["type"]),
        turn=int(raw["turn"]),
    )


def _count(raw: dict[str, Any], name: str) -> int:
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0")
    return value
