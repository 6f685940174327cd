"""A model whose every layer slides (Mistral-style), served from a sliding-window pool (the
blocks out of the window go back to the block manager) and from a full pool (every block
kept), with the same KV-cache memory.

    .venv/bin/python bench/sliding_bench.py [--window 64] [--max-model-len 512]

The engine runs in-process over a tiny random Mistral (CPU, fp32, 2 torch threads), greedy,
``ignore_eos``. Reported per pool kind:

- the max concurrency at ``max_model_len`` (what the executor logs at start-up);
- a workload that fills the cache: 64 requests, prompts 256-448 tokens, 64 output tokens
  each, all at once: output tok/s, preemptions, the most blocks in use;
- multi-turn prefix hits: 32 conversations x 4 turns, each turn the whole history (its
  prompts and outputs) plus a new message, turns sent in rounds; the share of prompt tokens
  served from the prefix cache.

Both pools must produce the same tokens (checked). The full pool is the same engine with the
pool registered without KV-cache groups. Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.tools.tiny_model import write_tiny_model
from services.blockmgr.client import InProcessClient
from services.common.blocks import max_live_blocks
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.service import startup
from services.executor.service.config import ExecutorConfig


def make_engine(args: argparse.Namespace, model: str, sliding: bool) -> Engine:
    config = ExecutorConfig(
        model=model,
        dtype="float32",
        device="cpu",
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=256,
        cpu_threads=args.threads,
    )
    groups = startup.kv_cache_groups
    if not sliding:  # the same model, its pool registered with no groups: every block kept
        startup.kv_cache_groups = lambda mc: ()  # type: ignore[assignment]
    try:
        engine, _ = startup.build_engine(
            config, runner=build_runner(config.runner_config()), blockmgr=InProcessClient()
        )
    finally:
        startup.kv_cache_groups = groups  # type: ignore[assignment]
    return engine


def run(engine: Engine, requests: list[tuple[str, list[int], int]]) -> dict[str, Any]:
    """All ``requests`` at once; returns tokens, wall time, the most blocks in use."""
    for rid, prompt, n in requests:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(RequestKey(0, rid), prompt, params)
    got: dict[str, list[int]] = {}
    most = 0
    start = time.perf_counter()
    while engine.has_work:
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
        counters = engine.link.client.stats(engine.link.spec.pool_id).counters
        most = max(most, counters.num_in_use_blocks)
    return {"tokens": got, "wall": time.perf_counter() - start, "most_blocks": most}


def fill_workload(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(args.seed)
    return [
        (
            f"r{i}",
            [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(255, 448))],
            args.output_len,
        )
        for i in range(args.num_requests)
    ]


def multi_turn(args: argparse.Namespace, engine: Engine, vocab: int) -> dict[str, Any]:
    """32 conversations x 4 turns, in rounds; returns the prompt-token hit ratio and the
    outputs (to compare pools)."""
    rng = random.Random(args.seed + 1)
    histories = [[1] + [rng.randrange(3, vocab) for _ in range(32)] for _ in range(32)]
    outputs: list[list[int]] = []
    pool = engine.link.spec.pool_id
    before = engine.link.client.stats(pool)
    for turn in range(4):
        requests = []
        for c, history in enumerate(histories):
            history.extend(rng.randrange(3, vocab) for _ in range(rng.randrange(16, 48)))
            requests.append((f"c{c}t{turn}", list(history), 32))
        got = run(engine, requests)["tokens"]
        for c, history in enumerate(histories):
            history.extend(got[f"c{c}t{turn}"])
            outputs.append(got[f"c{c}t{turn}"])
    after = engine.link.client.stats(pool)
    queries = after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens
    hits = after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens
    return {"ratio": hits / queries, "outputs": outputs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=257, help="8 full-length sequences")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(
            write_tiny_model(
                Path(tmp) / "mistral",
                arch="mistral",
                hidden_size=256,
                num_layers=6,
                num_heads=8,
                num_kv_heads=2,
                intermediate_size=512,
                sliding_window=args.window,
                max_position_embeddings=max(2048, args.max_model_len),
            )
        )
        usable = args.num_kv_blocks - 1
        bs = args.block_size
        per_seq = min(max_live_blocks(args.window, bs), -(-args.max_model_len // bs))
        concurrency = {
            "sliding": usable / per_seq,
            "full": usable * bs / args.max_model_len,
        }
        rows = {}
        vocab = 0
        for kind in ("sliding", "full"):
            engine = make_engine(args, model, kind == "sliding")
            vocab = engine.settings.vocab_size
            fill = run(engine, fill_workload(args, vocab))
            preemptions = engine.scheduler.num_preemptions
            turns = multi_turn(args, make_engine(args, model, kind == "sliding"), vocab)
            rows[kind] = (fill, preemptions, turns)
        same_fill = rows["sliding"][0]["tokens"] == rows["full"][0]["tokens"]
        same_turns = rows["sliding"][2]["outputs"] == rows["full"][2]["outputs"]
        out_tokens = args.num_requests * args.output_len
        print(
            f"# Sliding-window pool vs full pool: random Mistral (hidden 256, 6 layers, window "
            f"{args.window}), block size {bs}, {usable} usable blocks, max_model_len "
            f"{args.max_model_len}, {args.threads} threads\n"
        )
        print(
            "| pool | max concurrency at max_model_len | fill: output tok/s | fill: "
            "preemptions | fill: most blocks in use | multi-turn prompt-token hit ratio |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for kind in ("sliding", "full"):
            fill, preemptions, turns = rows[kind]
            print(
                f"| {kind} | {concurrency[kind]:.1f} | {out_tokens / fill['wall']:,.0f} | "
                f"{preemptions} | {fill['most_blocks']} | {turns['ratio']:.1%} |"
            )
        ratio = rows["sliding"][2]["ratio"] / rows["full"][2]["ratio"]
        print(
            f"\nconcurrency sliding / full: {concurrency['sliding'] / concurrency['full']:.2f}x; "
            f"multi-turn hit ratio sliding / full: {ratio:.1%}; same tokens: fill "
            f"{same_fill}, multi-turn {same_turns}"
        )
        return 0 if same_fill and same_turns else 1


if __name__ == "__main__":
    sys.exit(main())
