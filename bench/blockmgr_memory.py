"""Does the block manager leak? A long steady-state run of the core, traced with tracemalloc.

A serving-like churn on one pool: 64 sequences live at a time, each admitted with a prompt
(half share a prefix), grown token by token with full blocks committed, freed when done and
replaced by a new one (fresh sequence ids, as an executor uses). Every ``--every`` steps it
prints the traced Python memory and the process RSS; at the end the allocation sites that
grew most between the first checkpoint (after the event buffer and caches filled) and the
last. Steady traced memory = no leak; growth names its line.

    .venv/bin/python -m bench.blockmgr_memory [--steps 120000] [--every 10000]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import tracemalloc

from services.blockmgr.api.hashing import block_hashes
from services.blockmgr.api.types import Admit, Commit, Free, Grow, PoolSpec
from services.blockmgr.service.core import BlockManagerCore

BS = 16


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120_000)
    ap.add_argument("--every", type=int, default=10_000)
    ap.add_argument("--seqs", type=int, default=64)
    args = ap.parse_args()
    core = BlockManagerCore(pool_lease_s=30.0)
    pool = core.register("leak-check", PoolSpec(4096, BS))
    epoch, token = pool.epoch, pool.owner_token
    rng = random.Random(0)
    shared = [rng.randrange(32000) for _ in range(64)]
    next_id = 0
    live: dict[int, tuple[list[int], int, int]] = {}  # seq -> (tokens, slots, committed)

    def admit_ops() -> list:
        nonlocal next_id
        ops = []
        while len(live) < args.seqs:
            prompt = (shared if next_id % 2 else []) + [rng.randrange(32000) for _ in range(40)]
            total = prompt + [rng.randrange(32000) for _ in range(rng.randrange(16, 200))]
            ops.append(Admit(next_id, len(prompt), len(prompt), tuple(block_hashes(prompt, BS))))
            live[next_id] = (total, len(prompt), 0)
            next_id += 1
        return ops

    core.step("leak-check", epoch, admit_ops(), token)
    tracemalloc.start(25)
    baseline = None
    print("| steps | traced MB | RSS MB (peak) |\n|---:|---:|---:|")
    for step in range(1, args.steps + 1):
        ops: list = []
        done = [s for s, (toks, slots, _) in live.items() if slots >= len(toks)]
        if done:
            ops.append(Free(tuple(done)))
            for s in done:
                del live[s]
        grow_ids = tuple(live)
        for s in grow_ids:
            toks, slots, committed = live[s]
            full = slots // BS  # blocks the pool already holds full
            if full > committed:
                hashes = block_hashes(toks[: full * BS], BS)[committed:full]
                ops.append(Commit(s, committed, tuple(hashes)))
            live[s] = (toks, slots + 1, max(committed, full))
        ops.append(Grow(grow_ids, (1,) * len(grow_ids)))
        core.step("leak-check", epoch, ops, token)
        if len(live) < args.seqs:
            core.step("leak-check", epoch, admit_ops(), token)
        if step % args.every == 0:
            gc.collect()
            traced, _ = tracemalloc.get_traced_memory()
            print(f"| {step:,} | {traced / 2**20:.2f} | {rss_mb():.1f} |", flush=True)
            if baseline is None:
                baseline = tracemalloc.take_snapshot()
    assert baseline is not None
    final = tracemalloc.take_snapshot()
    print("\nlargest growth since the first checkpoint:")
    for stat in final.compare_to(baseline, "lineno")[:8]:
        print(f"  {stat}")


if __name__ == "__main__":
    main()
