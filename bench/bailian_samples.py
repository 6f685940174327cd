"""Sample traces in Qwen-Bailian's format (ATC'25, "KVCache Cache in the Wild"), for cache
experiments where the real traces cannot be fetched.

The samples are ours, not Alibaba's: a stated generative model shaped after what the paper
reports of its two workloads, so that the format's importer and the eviction policies can be
run on the structure the real traces have (sessions, turns, request types, shared templates).
Figures on them say how a policy copes with that structure, not what it would score on the
real traces.

- ``to-c`` (consumer apps): sessions of ``text`` chat (a system prompt of one of 4 app
  variants), ``search`` (each turn adds 40-120 blocks of retrieved pages), ``file`` (the first
  turn carries a 100-400 block document) and ``image`` (48 blocks of image tokens). A turn's
  prompt is the previous turn's prompt, its output and a new message (2-40 blocks), so a
  later turn reuses the whole history; the number of turns is geometric (means: text 3,
  search 1.5, file 4, image 1.5), the think time between turns exponential (means 30, 15, 60,
  20 s); sessions start as a Poisson process.
- ``to-b`` (API): single-turn calls; each names one of 300 templates (a system prompt and
  few-shot examples, 10-150 blocks) by Zipf popularity (s = 1.1), then its own input (1-40
  blocks). One call in ten is an agent's next step: its previous call's prompt and output,
  then a tool result (4-30 blocks).

Blocks are the format's 16 tokens; ``hash_ids`` are prefix-chained (equal ids only where the
whole prefix is equal), and the last block of a prompt may be partial. Usage:
``python -m bench.bailian_samples --profile to-c --out FILE [--requests N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 16
_TYPES = {  # type: (share of sessions, mean turns, mean think time s)
    "text": (0.6, 3.0, 30.0),
    "search": (0.2, 1.5, 15.0),
    "file": (0.1, 4.0, 60.0),
    "image": (0.1, 1.5, 20.0),
}


@dataclass
class _Chain:
    """Prefix-chained block ids: a block's id names its content and everything before it."""

    ids: dict[tuple[int, int], int] = field(default_factory=dict)
    fresh: int = 0  # content made so far

    def hash_ids(self, contents: list[int]) -> list[int]:
        out, parent = [], -1
        for content in contents:
            parent = self.ids.setdefault((parent, content), len(self.ids))
            out.append(parent)
        return out

    def unique(self, n: int) -> list[int]:
        """``n`` blocks of content no other block has."""
        self.fresh += n
        return list(range(self.fresh - n, self.fresh))


def _line(
    chat: tuple[int, int], t: float, ids: list[int], kind: str, turn: int, rng: random.Random
) -> dict[str, Any]:
    length = (len(ids) - 1) * BLOCK + rng.randint(1, BLOCK)  # the last block partial
    output = min(2000, int(rng.expovariate(1 / 250)) + 8)
    return {
        "chat_id": chat[0],
        "parent_chat_id": chat[1],
        "timestamp": round(t, 3),
        "input_length": length,
        "output_length": output,
        "type": kind,
        "turn": turn,
        "hash_ids": ids,
    }


def _next_history(chain: _Chain, contents: list[int], output_length: int) -> list[int]:
    """A turn's prompt as the next one starts it: its partial last block completed by the
    output (new content from there), then the output's blocks."""
    return [*contents[:-1], *chain.unique(-(-output_length // BLOCK))]


def to_c(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """Consumer sessions (see the module's docstring), ``num_requests`` lines by arrival."""
    rng, chain = random.Random(seed), _Chain()
    systems = {k: [chain.unique(rng.randint(8, 40)) for _ in range(4)] for k in _TYPES}
    # next turns due: (time, chat id, parent chat id, type, history contents, turn)
    due: list[tuple[float, int, int, str, list[int], int]] = []
    lines: list[dict[str, Any]] = []
    t, chat_id = 0.0, 0
    while len(lines) < num_requests:
        if not due or due[0][0] > t:  # a new session starts
            t += rng.expovariate(1.5)
            kind = rng.choices(list(_TYPES), [v[0] for v in _TYPES.values()])[0]
            start = list(rng.choice(systems[kind]))
            if kind == "file":
                start += chain.unique(rng.randint(100, 400))
            elif kind == "image":
                start += chain.unique(48)
            heapq.heappush(due, (t, chat_id, -1, kind, start, 1))
            chat_id += 1
            continue
        when, chat, parent, kind, history, turn = heapq.heappop(due)
        contents = [*history, *chain.unique(rng.randint(2, 40))]
        if kind == "search":
            contents += chain.unique(rng.randint(40, 120))
        line = _line((chat, parent), when, chain.hash_ids(contents), kind, turn, rng)
        lines.append(line)
        if rng.random() > 1 / _TYPES[kind][1]:  # geometric turns with that mean
            later = when + rng.expovariate(1 / _TYPES[kind][2])
            history = _next_history(chain, contents, line["output_length"])
            heapq.heappush(due, (later, chat_id, chat, kind, history, turn + 1))
            chat_id += 1
    return lines


def to_b(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """API calls (see the module's docstring), ``num_requests`` lines by arrival."""
    rng, chain = random.Random(seed), _Chain()
    templates = [chain.unique(rng.randint(10, 150)) for _ in range(300)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(templates))]
    lines: list[dict[str, Any]] = []
    contents_of: list[list[int]] = []
    t = 0.0
    while len(lines) < num_requests:
        t += rng.expovariate(8.0)
        if lines and rng.random() < 0.1:  # an agent's next step on a recent call
            back = rng.randint(1, min(20, len(lines)))
            prev, prev_contents = lines[-back], contents_of[-back]
            history = _next_history(chain, prev_contents, prev["output_length"])
            contents = [*history, *chain.unique(rng.randint(4, 30))]
            chat, turn = (len(lines), prev["chat_id"]), prev["turn"] + 1
        else:
            template = rng.choices(templates, weights)[0]
            contents = [*template, *chain.unique(rng.randint(1, 40))]
            chat, turn = (len(lines), -1), 1
        lines.append(_line(chat, t, chain.hash_ids(contents), "text", turn, rng))
        contents_of.append(contents)
    return lines


PROFILES = {"to-c": to_c, "to-b": to_b}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a Bailian-format sample trace.")
    parser.add_argument("--profile", choices=sorted(PROFILES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lines = PROFILES[args.profile](args.requests, args.seed)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    blocks = sum(len(line["hash_ids"]) for line in lines)
    print(f"{args.out}: {len(lines)} requests, {blocks} block references")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
