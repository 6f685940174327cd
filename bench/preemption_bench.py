"""Preemption by swapping against preemption by recomputation, on a KV cache too small for its
batch, in one run:

- ``recompute``: a preempted sequence's blocks are freed and its tokens computed again when
  it is admitted back (the prefix cache serves what was committed and not evicted since);
- ``recompute + host tier``: the same, with a host tier behind the cache (an evicted block is
  offloaded, and onboarded on the re-admission's prefix hit);
- ``swap``: ``--preemption-mode swap``: the sequence's blocks go to the host tier and back.

    .venv/bin/python -m bench.preemption_bench [--num-requests 48] [--num-kv-blocks 97]

A random Llama (hidden 256, 4 layers, 8 query / 2 KV heads, fp32, 2 torch threads), block
size 16, the engine in-process, greedy with ``ignore_eos``, all requests at t=0. Two
workloads: long prompts with medium outputs (a recomputation redoes a long prompt), and short
prompts with long outputs (it redoes mostly outputs). Reported: output tok/s, preemptions,
tokens the forwards computed (recomputation included), blocks swapped out / in. The modes must
produce the same tokens (checked). Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common.engines import greedy, run_requests
from bench.common.timers import ForwardTimer
from pagedserve.tools.tiny_model import write_tiny_model
from services.executor.api import ExecutorConfig, InProcessEngine

MODES = {
    "recompute": {"preemption_mode": "recompute"},
    "recompute + host tier": {"preemption_mode": "recompute", "kv_offloading_size": 0.25},
    "swap": {"preemption_mode": "swap", "kv_offloading_size": 0.25},
}


def engine_config(args: argparse.Namespace, model: str, mode: str) -> ExecutorConfig:
    return ExecutorConfig(
        model=model,
        dtype="float32",
        device="cpu",
        block_size=16,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=1024,
        max_num_batched_tokens=512,
        cpu_threads=args.threads,
        **MODES[mode],
    )


def run(config: ExecutorConfig, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    counter = ForwardTimer(enabled=False)  # counts the tokens the forwards compute
    with InProcessEngine(config, runner_hook=counter) as engine:
        done = run_requests(
            engine, [(f"r{i}", prompt, greedy(n)) for i, (prompt, n) in enumerate(requests)]
        )
        stats = engine.kv_stats()
        preemptions = engine.stats().num_preemptions
    return {
        "tokens": done.tokens,
        "tok_s": sum(n for _, n in requests) / done.wall_s,
        "preemptions": preemptions,
        "computed": counter.num_tokens,
        "swapped": (stats.num_swapped_out_blocks, stats.num_swapped_in_blocks),
    }


def workloads(args: argparse.Namespace) -> dict[str, list[tuple[list[int], int]]]:
    rng = random.Random(args.seed)

    def prompt(lo: int, hi: int) -> list[int]:
        return [1] + [rng.randrange(3, 600) for _ in range(rng.randrange(lo, hi))]

    n = args.num_requests
    return {
        "long prompts (256-448), 96 outputs": [(prompt(255, 448), 96) for _ in range(n)],
        "short prompts (16-64), 256 outputs": [(prompt(15, 64), 256) for _ in range(n)],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--num-kv-blocks", type=int, default=97, help="96 usable blocks of 16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model = str(
            write_tiny_model(
                Path(tmp) / "llama",
                arch="llama",
                hidden_size=256,
                num_layers=4,
                num_heads=8,
                num_kv_heads=2,
                intermediate_size=512,
                max_position_embeddings=2048,
            )
        )
        print(
            f"KV cache: {args.num_kv_blocks - 1} usable blocks of 16; {args.num_requests} "
            f"requests at t=0; {args.threads} threads\n"
        )
        print(
            "| workload | mode | output tok/s | preemptions | tokens computed | blocks "
            "swapped out / in |"
        )
        print("|---|---|---:|---:|---:|---:|")
        for name, requests in workloads(args).items():
            rows = {mode: run(engine_config(args, model, mode), requests) for mode in MODES}
            base = rows["recompute"]
            for mode, r in rows.items():
                same = r["tokens"] == base["tokens"]
                ok &= same
                ratio = r["tok_s"] / base["tok_s"]
                print(
                    f"| {name} | {mode} | {r['tok_s']:,.0f} ({ratio:.2f}x) | "
                    f"{r['preemptions']} | {r['computed']:,} | {r['swapped'][0]:,} / "
                    f"{r['swapped'][1]:,} |" + ("" if same else " tokens differ!")
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
