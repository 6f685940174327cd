"""Benchmark workloads: what to send, and how many tokens to ask back.

``random``: prompts of random token ids, ``--random-input-len`` long (± ``--random-range-ratio``),
outputs ``--random-output-len`` (same spread). ``prefix-repetition``: ``num_prefixes`` shared
random prefixes, each request one of them plus a random suffix (the prefix cache's workload).
``sharegpt``: the first human turn of each conversation in a local ShareGPT JSON file as the
prompt (text), the first reply's token count as the output length. ``mooncake`` / ``bailian``:
a public trace (:mod:`services.blockmgr.trace.public`) as real requests (:func:`trace_requests`).
Everything is seeded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.blockmgr.trace.public import PublicTrace


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    arrival_s: float | None = None  # a trace's: when to send it (else the request rate's)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


FIRST_ID = 10  # random ids start above the usual special tokens


def _lens(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    ins, outs = _lens(rng, input_len, range_ratio, n), _lens(rng, output_len, range_ratio, n)
    return [BenchRequest(_ids(rng, i, vocab_size), i, o) for i, o in zip(ins, outs, strict=True)]


def prefix_repetition_requests(
    n: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    out = []
    for i in range(n):
        prompt = prefixes[i % num_prefixes] + _ids(rng, suffix_len, vocab_size)
        out.append(BenchRequest(prompt, len(prompt), output_len))
    rng.shuffle(out)
    return out


def sharegpt_requests(path: Path, n: int, tokenizer: Tokenizer, seed: int) -> list[BenchRequest]:
    data = json.loads(Path(path).read_text())
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        prompt_len, output_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if prompt_len >= 4 and output_len >= 4:  # as vLLM: drop degenerate pairs
            out.append(BenchRequest(prompt, prompt_len, output_len))
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"{path} holds only {len(out)} usable conversations, {n} asked")
    return out


def trace_requests(trace: PublicTrace, vocab_size: int, seed: int) -> list[BenchRequest]:
    """``trace``'s requests (scaled already: :meth:`PublicTrace.scaled`) as real prompts: each
    hash id becomes a block of ``trace.block_tokens`` token ids drawn from a generator seeded
    by (``seed``, the id), so equal ids give equal tokens; a prompt is its blocks cut to its
    ``input_length``; it is sent at its timestamp."""
    blocks: dict[int, list[int]] = {}
    out = []
    for r in trace.requests:
        ids: list[int] = []
        for h in r.hash_ids:
            if h not in blocks:
                blocks[h] = _ids(random.Random(f"{seed}:{h}"), trace.block_tokens, vocab_size)
            ids += blocks[h]
        prompt = ids[: r.input_length]
        out.append(BenchRequest(prompt, len(prompt), r.output_length, r.timestamp_s))
    return out
