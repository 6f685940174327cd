"""A burst of requests sharing a long prefix, all arriving in one step: with and without
holding back the admissions whose prefix another request is computing in that step.

    .venv/bin/python -m bench.internals.prefix_burst [--requests 64] [--prefix 256] [--tail 8]

The engine runs in-process over a tiny random Llama (CPU, fp32, one torch thread), greedy,
``ignore_eos``. Reported per mode: prompt tokens computed, TTFT p50 / p99 (wall time from
the burst to each request's first token), the wall time of the whole burst, and whether both
modes produced the same tokens. Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common.stats import percentile
from pagedserve.tools.tiny_model import write_tiny_model
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine


def run(model: str, prompts: list[list[int]], max_tokens: int, hold_back: bool) -> dict:
    config = ExecutorConfig(
        model=model,
        dtype="float32",
        device="cpu",
        num_kv_blocks=2048,
        max_num_batched_tokens=8192,
        max_model_len=1024,
        cpu_threads=1,  # one torch thread, as set in main (the runner sets its own)
    )
    engine, _ = build_engine(config, blockmgr=InProcessClient())
    engine.scheduler.config = replace(engine.scheduler.config, hold_back_shared_prefixes=hold_back)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(RequestKey(0, str(i)), p, params)
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            rid = o.req_id.request_id
            if o.token_ids and rid not in ttft:
                ttft[rid] = time.perf_counter() - t0
            tokens.setdefault(rid, []).extend(o.token_ids)
    wall = time.perf_counter() - t0
    ts = sorted(ttft.values())
    return {
        "prompt_tokens": engine.num_prompt_tokens,
        "ttft_p50": statistics.median(ts),
        "ttft_p99": percentile(ts, 0.99),
        "wall": wall,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--tail", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, 500) for _ in range(args.prefix - 1)]
    prompts = [
        [*shared, *(rng.randrange(3, 500) for _ in range(args.tail))] for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "m"))
        eager = run(model, prompts, args.max_tokens, hold_back=False)
        held = run(model, prompts, args.max_tokens, hold_back=True)
    print(
        f"{args.requests} requests, {args.prefix}-token shared prefix + {args.tail}-token "
        f"tails, all in one step, {args.max_tokens} output tokens each:\n"
    )
    print("| mode | prompt tokens computed | TTFT p50 | TTFT p99 | burst wall |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (
        ("every admission computes its prefix", eager),
        ("hold back sharers one step", held),
    ):
        print(
            f"| {name} | {r['prompt_tokens']:,} | {r['ttft_p50'] * 1e3:.0f} ms | "
            f"{r['ttft_p99'] * 1e3:.0f} ms | {r['wall'] * 1e3:.0f} ms |"
        )
    print(f"\nsame tokens both ways: {eager['tokens'] == held['tokens']}")


if __name__ == "__main__":
    main()
