"""The multi-turn chat workload of ``multiturn_bench.py`` and ``replay_bench.py``: per
conversation and turn, a new user message of 100-300 tokens and an answer of 50-150."""

from __future__ import annotations

import random


def turn_plan(rng: random.Random, conversations: int, turns: int) -> list[list[tuple[int, int]]]:
    """Per conversation, per turn: (message tokens, output tokens)."""
    return [
        [(rng.randrange(100, 301), rng.randrange(50, 151)) for _ in range(turns)]
        for _ in range(conversations)
    ]


def final_lengths(plan: list[list[tuple[int, int]]]) -> list[int]:
    """Each conversation's final history (messages and answers): what caches are sized
    against."""
    return [sum(m + o for m, o in conv) for conv in plan]
