"""Beam search and parallel sampling on shared blocks: the PagedAttention paper's Fig. 15
on our engine, and beam-search throughput against transformers on the same requests.

**Memory saved by sharing** (the paper, section 4.4 / Fig. 15): for parallel sampling with
n = 2, 4, 6 and beam search with width 2, 4, 6, ``--requests`` requests at once on two
workloads (``short``: prompts of 20-100 tokens; ``long``: 200-800), outputs of up to 128
tokens (drawn in 32..128; ``ignore_eos``; sampling at temperature 1, seeded). After every
step we count the KV blocks the running sequences reference with sharing (distinct block
ids of their tables) and without it (each sequence owning every block of its table, as
when each beam or sample keeps its own copy); the saving is 1 - with / without, over the
sum of all steps. Block size 16, the tiny random Llama (the count does not depend on the
model).

**Throughput** (``--throughput``): beam width 4 on 16 requests with prompts of 35-254 tokens
and 64 new tokens (no end token), on ``cpu_bench.py``'s random Llama (hidden 512, 4 layers,
fp32): our engine (all at once, continuous batching) against transformers'
``generate(num_beams=4, num_return_sequences=4)`` on one left-padded batch; output tok/s
counts the 4 x 64 tokens returned per request; and how many requests return the same beams.

Usage: ``python -m bench.beam_bench [--requests 16] [--throughput]``. Not a test: prints
markdown.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.common.engines import EngineSystem, run_requests
from bench.common.hf import hf_beams
from bench.common.models import cpu_engine_config, write_cpu_model
from bench.common.workloads import random_prompts
from pagedserve.tools.tiny_model import write_tiny_model
from services.common.logging import configure_logging
from services.executor.api import (
    ExecutorConfig,
    InProcessEngine,
    SamplingParams,
    available_cores,
)

WORKLOADS = {"short": (20, 100), "long": (200, 800)}


def memory_saving(
    engine: InProcessEngine, requests: list[tuple[list[int], SamplingParams]]
) -> float:
    """1 - (blocks held with sharing) / (blocks held without), summed over the steps."""
    shared = unshared = 0

    def count(_outputs: object) -> None:
        nonlocal shared, unshared
        usage = engine.kv_usage()
        shared += usage.num_distinct_blocks
        unshared += usage.num_blocks

    run_requests(engine, [(f"r{i}", p, sp) for i, (p, sp) in enumerate(requests)], on_step=count)
    return 1 - shared / unshared


def fig15(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="beam_bench_") as tmp:
        model = str(write_tiny_model(Path(tmp) / "model", max_position_embeddings=2048))
        config = ExecutorConfig(
            model=model,
            dtype="float32",
            device="cpu",
            num_kv_blocks=8192,
            max_num_seqs=512,
            max_model_len=1024,
            max_num_batched_tokens=4096,
        )
        system = EngineSystem(config)
        vocab = system.model.vocab_size
        print(
            f"## Memory saved by sharing: {args.requests} requests at once, block size 16, "
            "outputs 32-128 tokens\n"
        )
        print("| workload | decoding | 2 | 4 | 6 |\n|---|---|---:|---:|---:|")
        for workload, (lo, hi) in WORKLOADS.items():
            prompts = [
                [1, *(rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi) - 1))]
                for _ in range(args.requests)
            ]
            outs = [rng.randint(32, 128) for _ in prompts]
            for mode in ("parallel sampling", "beam search"):
                row = []
                for k in (2, 4, 6):
                    beam = mode == "beam search"
                    reqs = [
                        (
                            p,
                            SamplingParams(
                                n=k,
                                temperature=0.0 if beam else 1.0,
                                seed=None if beam else i,
                                max_tokens=m,
                                ignore_eos=True,
                                use_beam_search=beam,
                            ),
                        )
                        for i, (p, m) in enumerate(zip(prompts, outs, strict=True))
                    ]
                    with system.engine() as engine:
                        row.append(memory_saving(engine, reqs))
                cells = " | ".join(f"{x:.1%}" for x in row)
                print(f"| {workload} ({lo}-{hi}) | {mode} | {cells} |")


def throughput(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    k, new, num = 4, 64, 16
    with tempfile.TemporaryDirectory(prefix="beam_bench_") as tmp:
        model_dir = write_cpu_model(Path(tmp) / "model")
        system = EngineSystem(cpu_engine_config(model_dir, args.threads))
        vocab = system.model.vocab_size
        prompts = random_prompts(rng, vocab, num)
        params = SamplingParams(n=k, use_beam_search=True, max_tokens=new, ignore_eos=True)
        requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
        walls = []
        for _ in range(2):  # a warm-up, then the timed run
            with system.engine() as engine:
                run = run_requests(engine, requests)
            walls.append(run.wall_s)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        beams = hf_beams(hf, prompts, k, new)
        hf_wall = time.perf_counter() - t0
        same = sum([run.samples[(f"r{i}", j)] for j in range(k)] == beams[i] for i in range(num))
    tokens = num * k * new
    print(
        f"\n## Beam search throughput: width {k}, {num} requests, prompts 35-254, {new} new "
        f"tokens, {args.threads} threads\n"
    )
    print("| system | wall (s) | output tok/s |\n|---|---:|---:|")
    print(f"| ours | {walls[-1]:.2f} | {tokens / walls[-1]:,.0f} |")
    hf_name = "transformers `generate(num_beams=4)`, one padded batch"
    print(f"| {hf_name} | {hf_wall:.2f} | {tokens / hf_wall:,.0f} |")
    ratio = hf_wall / walls[-1]
    print(f"\nours / transformers: {ratio:.2f}x; requests with the same beams: {same}/{num}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--threads", type=int, default=available_cores())
    args = ap.parse_args()
    configure_logging("beam_bench", "ERROR")
    fig15(args)
    if args.throughput:
        throughput(args)


if __name__ == "__main__":
    main()
