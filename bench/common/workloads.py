"""The benchmarks' requests: seeded random prompts over the tiny tokenizer's ids, and the
multi-turn chat plan."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = [
    "BOS_ID",
    "FIRST_ORDINARY_ID",
    "Req",
    "final_lengths",
    "make_requests",
    "random_prompts",
    "requested_tokens",
    "turn_plan",
]

BOS_ID = 1  # the tiny tokenizer's <s>; prompts start with it, as a tokenizer would do
FIRST_ORDINARY_ID = 3  # ids 0..2 are <pad>, <s>, </s>


@dataclass(frozen=True)
class Req:
    req_id: str
    prompt: list[int]
    max_tokens: int


def make_requests(
    num: int, prompt: tuple[int, int], output: tuple[int, int], vocab_size: int, seed: int
) -> list[Req]:
    """A fixed, seeded set ``r0 ..``: prompt lengths (BOS included) and ``max_tokens``
    uniform in their inclusive ranges."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        n_prompt = rng.randint(*prompt)
        tokens = [BOS_ID] + [
            rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n_prompt - 1)
        ]
        reqs.append(Req(f"r{i}", tokens, rng.randint(*output)))
    return reqs


def requested_tokens(reqs: list[Req]) -> int:
    return sum(r.max_tokens for r in reqs)


def random_prompts(
    rng: random.Random, vocab: int, n: int, lo: int = 35, hi: int = 254
) -> list[list[int]]:
    """``n`` prompts of ``lo..hi`` tokens: BOS, then random ids past the special tokens."""
    return [
        [BOS_ID, *(rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(lo, hi) - 1))]
        for _ in range(n)
    ]


def turn_plan(rng: random.Random, conversations: int, turns: int) -> list[list[tuple[int, int]]]:
    """The multi-turn chat workload: per conversation, per turn, (new user message tokens,
    output tokens), a message of 100-300 tokens and an answer of 50-150."""
    return [
        [(rng.randrange(100, 301), rng.randrange(50, 151)) for _ in range(turns)]
        for _ in range(conversations)
    ]


def final_lengths(plan: list[list[tuple[int, int]]]) -> list[int]:
    """Each conversation's final history (messages and answers): what caches are sized
    against."""
    return [sum(m + o for m, o in conv) for conv in plan]
