"""Block-manager benchmark: the core in-process vs the gRPC service on loopback.

Reports, for each transport:
- block operations per second in an allocate/commit/free churn (one block op = one block
  allocated, committed or freed);
- latency (p50/p99) of one ``Step`` for a 256-sequence decode step (one Grow entry per sequence,
  with the block allocations and commits that a real decode produces);
- latency of an admission-heavy step (32 frees + 32 admissions of 512-token prompts with their
  hashes, half of them hitting a shared 256-token prefix).

The gRPC server runs as a separate process (``pagedserve blockmgr``), as in production.
Usage: ``python -m bench.blockmgr_bench [--steps N]``. Not a test: prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from bench.common.stats import percentile as pct
from pagedserve.testing.procs import ServiceProcess
from services.blockmgr.api.hashing import block_hashes, hash_block
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import Admit, Commit, Free, Grow, OpStatus, PoolSpec
from services.blockmgr.client import GrpcClient, InProcessClient

BS = 16


def decode_steps(client: BlockManagerClient, steps: int) -> list[float]:
    """256 running sequences, each step grows every one by a token; full blocks committed."""
    max_blocks_per_seq = (512 + steps) // BS + 1
    pool = client.register("bench-decode", PoolSpec(256 * max_blocks_per_seq + 1, BS))
    epoch = pool.epoch
    rng = random.Random(0)
    seq_tokens: dict[int, list[int]] = {}
    seq_hashes: dict[int, list[bytes]] = {}
    ops = []
    for seq_id in range(256):
        tokens = [rng.randrange(32000) for _ in range(rng.randrange(64, 512))]
        seq_tokens[seq_id] = tokens
        seq_hashes[seq_id] = block_hashes(tokens, BS)
        ops.append(Admit(seq_id, len(tokens), len(tokens), tuple(seq_hashes[seq_id])))
    client.step("bench-decode", epoch, ops)
    seq_ids = tuple(seq_tokens)
    ones = (1,) * 256
    latencies = []
    commits: list[Commit] = []  # blocks filled by the previous step's forward
    for _ in range(steps):
        t0 = time.perf_counter()
        result = client.step("bench-decode", epoch, [*commits, Grow(seq_ids, ones)])
        latencies.append(time.perf_counter() - t0)
        assert all(s == OpStatus.OK for s in result.results[-1].statuses)
        commits = []
        for seq_id, tokens in seq_tokens.items():
            tokens.append(rng.randrange(32000))
            if len(tokens) % BS == 0:  # a block just filled: commit it
                chain = seq_hashes[seq_id]
                chain.append(hash_block(chain[-1], tokens[-BS:]))
                commits.append(Commit(seq_id, len(chain) - 1, (chain[-1],)))
    return latencies


def admission_steps(client: BlockManagerClient, steps: int) -> list[float]:
    """Each step frees the 32 oldest sequences and admits 32 new 512-token prompts."""
    client.register("bench-admit", PoolSpec(32 * 4 * 33 + 1, BS))
    epoch = client.info("bench-admit").pools[0].epoch
    rng = random.Random(1)
    shared = [rng.randrange(32000) for _ in range(256)]
    live: list[int] = []
    next_id = 0
    latencies = []
    for _ in range(steps):
        ops: list = []
        if len(live) >= 96:
            ops.append(Free(tuple(live[:32])))
            live = live[32:]
        for i in range(32):
            head = shared if i % 2 == 0 else [rng.randrange(32000) for _ in range(256)]
            tokens = head + [rng.randrange(32000) for _ in range(256)]
            hashes = tuple(block_hashes(tokens, BS))
            ops.append(Admit(next_id, len(tokens), len(tokens), hashes))
            ops.append(Commit(next_id, 0, hashes))
            live.append(next_id)
            next_id += 1
        t0 = time.perf_counter()
        client.step("bench-admit", epoch, ops)
        latencies.append(time.perf_counter() - t0)
    return latencies


def churn_ops_per_second(client: BlockManagerClient, seconds: float) -> float:
    """Admit 64-token sequences (4 blocks), commit them, free them; count block ops."""
    client.register("bench-churn", PoolSpec(4096 + 1, BS))
    epoch = client.info("bench-churn").pools[0].epoch
    rng = random.Random(2)
    block_ops = 0
    next_id = 0
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        ops: list = []
        ids = []
        for _ in range(64):
            tokens = [rng.randrange(32000) for _ in range(64)]
            h = tuple(block_hashes(tokens, BS))
            ops += [Admit(next_id, 64, 64, h), Commit(next_id, 0, h[:3])]
            ids.append(next_id)
            next_id += 1
        ops.append(Free(tuple(ids)))
        client.step("bench-churn", epoch, ops)
        block_ops += 64 * (4 + 3 + 4)
    return block_ops / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--churn-seconds", type=float, default=3.0)
    args = ap.parse_args()

    server = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    address = server.address
    rows = []
    try:
        clients: list[tuple[str, BlockManagerClient]] = [
            ("in-process", InProcessClient()),
            ("gRPC loopback", GrpcClient(address)),
        ]
        for name, client in clients:
            ops_s = churn_ops_per_second(client, args.churn_seconds)
            dec = decode_steps(client, args.steps)
            adm = admission_steps(client, max(args.steps // 10, 50))
            rows.append((name, ops_s, dec, adm))
            client.close()
    finally:
        server.stop()

    print(f"\nblock manager benchmark ({os.cpu_count()} CPUs, {args.steps} decode steps)\n")
    print(
        "| transport | block ops/s | decode step (256 seqs) p50 / p99 | "
        "admission step (32 x 512 tok) p50 / p99 |"
    )
    print("|---|---:|---:|---:|")
    for name, ops_s, dec, adm in rows:
        print(
            f"| {name} | {ops_s:,.0f} | {statistics.median(dec) * 1e3:.3f} / "
            f"{pct(dec, 0.99) * 1e3:.3f} ms | {statistics.median(adm) * 1e3:.3f} / "
            f"{pct(adm, 0.99) * 1e3:.3f} ms |"
        )


if __name__ == "__main__":
    main()
