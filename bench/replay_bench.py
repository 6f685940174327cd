"""Eviction policies compared offline: a multi-turn chat workload recorded from a real engine
(``--record-trace``'s format), then replayed under each policy by ``pagedserve blockmgr
replay``'s code.

    .venv/bin/python -m bench.replay_bench [--conversations 48] [--turns 6]

The engine runs in-process over a tiny random Llama (CPU, fp32), its block manager recording.
Each turn of a conversation sends its whole history plus a new user message of 100-300 tokens
and asks for 50-150 tokens (``ignore_eos``); the turns of all conversations go in rounds, so the
working set (every conversation's history) grows to several times the device cache
(``--device-share`` of it). The recorded trace is then replayed under every policy at the
recorded size, at twice it, and with room for everything (the "infinite cache" reference).
Prints markdown: the live run, then per policy the prompt-token
hit ratio, evictions and replay time. Not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.common.engines import greedy, run_requests
from bench.common.workloads import final_lengths, turn_plan
from pagedserve.tools.tiny_model import write_tiny_model
from services.blockmgr.api.types import EvictionPolicyName, Free, Grow
from services.blockmgr.client import InProcessClient
from services.blockmgr.service.core import BlockManagerCore
from services.blockmgr.trace.record import StepRecord, TraceWriter, read_trace
from services.blockmgr.trace.replay import replay
from services.executor.api import ExecutorConfig, InProcessEngine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--device-share", type=float, default=0.25, help="device cache / final working set"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    bs = args.block_size
    plan = turn_plan(rng, args.conversations, args.turns)
    final_tokens = final_lengths(plan)
    working_set = sum(-(-n // bs) for n in final_tokens)
    num_blocks = max(int(working_set * args.device_share), max(final_tokens) // bs + 2) + 1
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(
            Path(tmp) / "llama", hidden_size=64, num_layers=2, max_position_embeddings=4096
        )
        config = ExecutorConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            block_size=bs,
            num_kv_blocks=num_blocks,
            max_model_len=max(final_tokens) + 16,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
        )
        trace_path = Path(tmp) / "trace.jsonl"
        trace = TraceWriter(trace_path)
        core = BlockManagerCore(trace=trace)
        engine = InProcessEngine(config, blockmgr=InProcessClient(core))
        vocab = engine.served.vocab_size
        histories = [[1] for _ in plan]
        start = time.perf_counter()
        for turn in range(args.turns):
            requests = []
            for c, conv in enumerate(plan):
                message, output = conv[turn]
                histories[c].extend(rng.randrange(3, vocab) for _ in range(message))
                requests.append((f"c{c}t{turn}", list(histories[c]), greedy(output)))
            got = run_requests(engine, requests).tokens
            for c in range(len(plan)):
                histories[c].extend(got[f"c{c}t{turn}"])
        wall = time.perf_counter() - start
        live = engine.kv_stats()
        preemptions = engine.stats().num_preemptions
        records = list(read_trace(trace_path))  # (flushed line by line)
        engine.close()  # (its pool's unregistration comes after the records read)
        trace.close()
    steps = [r for r in records if isinstance(r, StepRecord)]
    num_ops = sum(len(r.ops) for r in steps)
    # Grow and Free entries one by one: the per-sequence operations a Step carries.
    num_entries = sum(
        len(op.seq_ids) if isinstance(op, Grow | Free) else 1 for r in steps for op in r.ops
    )
    print(
        f"# Eviction policies on a recorded multi-turn trace: {args.conversations} "
        f"conversations x {args.turns} turns, working set {working_set} blocks of {bs}, device "
        f"cache {num_blocks - 1} usable blocks ({args.device_share:.0%}); {len(records)} "
        f"records, {num_ops:,} operations, {num_entries:,} per-sequence operations\n"
    )
    ratio = live.prefix_cache_hits_tokens / live.prefix_cache_queries_tokens
    print(
        f"Live run (LRU): {wall:.0f} s, prompt-token hit ratio {ratio:.1%}, "
        f"{live.num_evicted_blocks} blocks evicted, {preemptions} "
        "preemptions.\n"
    )
    print(
        "| policy | device blocks | hit ratio | evicted blocks | admissions refused | "
        "dropped | replay s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    total = 0.0
    infinite = 2 * working_set + args.conversations  # room for every history at once
    for blocks in (None, 2 * num_blocks, infinite):
        for policy in EvictionPolicyName if blocks != infinite else [EvictionPolicyName.LRU]:
            r = replay(records, policy=policy, num_blocks=blocks)
            total += r.seconds
            size = num_blocks if blocks is None else blocks
            name = "any (nothing evicted)" if blocks == infinite else policy.value
            print(
                f"| {name} | {size} | {r.hit_ratio:.1%} | {r.num_evicted_blocks:,} | "
                f"{r.num_refused_admissions:,} | {r.num_dropped:,} | {r.seconds:.2f} |"
            )
    print(f"\nAll {2 * len(EvictionPolicyName) + 1} replays: {total:.1f} s.\n")
    # The tiers' own policy: the recorded device cache (LRU) over a host tier of its size.
    host = num_blocks - 1
    print(f"Device cache as recorded (LRU), a host tier of {host} blocks:\n")
    print("| tier policy | hit ratio | host hit ratio | offloaded / onboarded | replay s |")
    print("|---|---:|---:|---:|---:|")
    for tier in EvictionPolicyName:
        r = replay(records, host_blocks=host, tier_policy=tier)
        print(
            f"| {tier.value} | {r.hit_ratio:.1%} | {r.host_hits_tokens / r.queries_tokens:.1%} "
            f"| {r.num_offloaded_blocks:,} / {r.num_onboarded_blocks:,} | {r.seconds:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
