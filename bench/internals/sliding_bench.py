"""Sliding-window models served from KV-cache groups (the blocks out of the window go back to
the block manager) and from a full pool (every block of every layer kept), with the same
KV-cache memory:

- ``mistral``: every layer slides (one sliding group vs one full group);
- ``gemma3``: a Gemma-3-shaped model, 5 sliding layers to 1 global (a hybrid pool of 6 groups,
  one layer each, vs ``--disable-hybrid-kv-cache-manager``).

    .venv/bin/python -m bench.internals.sliding_bench [--family mistral|gemma3|both] [--window 64]

The engine runs in-process over a tiny random model (CPU, fp32, 2 torch threads), greedy,
``ignore_eos``. Reported per pool kind:

- the max concurrency at ``max_model_len`` (what the executor logs at start-up);
- a workload that fills the cache: 64 requests, prompts 256-448 tokens, 64 output tokens
  each, all at once: output tok/s, preemptions, the most blocks in use;
- multi-turn prefix hits: 32 conversations x 4 turns, each turn the whole history (its
  prompts and outputs) plus a new message, turns sent in rounds; the share of prompt tokens
  served from the prefix cache.

Both pools must produce the same tokens (checked). Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedserve.tools.tiny_model import write_tiny_model
from services.blockmgr.client import InProcessClient
from services.common.blocks import usable_blocks
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey
from services.executor.model.config import ModelConfig
from services.executor.model.kv_cache import bytes_per_block
from services.executor.model.launch import build_runner
from services.executor.service import startup
from services.executor.service.config import ExecutorConfig


def make_engine(args: argparse.Namespace, model: str, sliding: bool, memory: int) -> Engine:
    config = ExecutorConfig(
        model=model,
        dtype="float32",
        device="cpu",
        block_size=args.block_size,
        kv_cache_memory=memory,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=256,
        cpu_threads=args.threads,
        disable_hybrid_kv_cache_manager=not sliding,
    )
    groups = startup.kv_cache_groups
    if not sliding:  # the same model, its pool registered with no groups: every block kept
        startup.kv_cache_groups = lambda layout: ()  # type: ignore[assignment]
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
        counters = engine.link.client.stats(engine.link.pool_id).counters
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
    pool = engine.link.pool_id
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


def write_model(family: str, args: argparse.Namespace, tmp: str) -> str:
    sizes = {
        "hidden_size": 256,
        "num_layers": 6,
        "num_heads": 8,
        "num_kv_heads": 2,
        "intermediate_size": 512,
        "sliding_window": args.window,
        "max_position_embeddings": max(2048, args.max_model_len),
    }
    if family == "gemma3":
        sizes |= {"head_dim": 32, "sliding_window_pattern": 6}  # 5 sliding, 1 global
    return str(write_tiny_model(Path(tmp) / family, arch=family, **sizes))


def concurrency(engine: Engine, args: argparse.Namespace) -> float:
    """Sequences of max_model_len tokens the cache holds, groups counted (as logged)."""
    layout = engine.runner.model.kv_layout
    if not engine.scheduler.config.sliding_window:  # registered without groups
        return usable_blocks(engine.runner.num_blocks) / (
            layout.num_groups * -(-args.max_model_len // args.block_size)
        )
    per_seq = layout.blocks_per_sequence(args.max_model_len, args.block_size)
    return usable_blocks(engine.runner.num_blocks) / per_seq


def bench_family(family: str, args: argparse.Namespace, tmp: str) -> bool:
    model = write_model(family, args, tmp)
    mc = ModelConfig.from_hf_config(json.loads((Path(model) / "config.json").read_text()))
    # The same bytes either way: num_kv_blocks blocks of every layer.
    memory = args.num_kv_blocks * bytes_per_block(mc, args.block_size, torch.float32)
    kinds = ("hybrid" if family == "gemma3" else "sliding", "full")
    rows = {}
    vocab = 0
    for kind in kinds:
        engine = make_engine(args, model, kind != "full", memory)
        vocab = engine.settings.vocab_size
        fill = run(engine, fill_workload(args, vocab))
        preemptions = engine.scheduler.num_preemptions
        turns = multi_turn(args, make_engine(args, model, kind != "full", memory), vocab)
        rows[kind] = (concurrency(engine, args), fill, preemptions, turns, engine)
    grouped, full = kinds
    same_fill = rows[grouped][1]["tokens"] == rows[full][1]["tokens"]
    same_turns = rows[grouped][3]["outputs"] == rows[full][3]["outputs"]
    out_tokens = args.num_requests * args.output_len
    shape = "5 sliding + 1 global layers" if family == "gemma3" else "6 sliding layers"
    print(
        f"## {family}: hidden 256, {shape}, window {args.window}, block size "
        f"{args.block_size}, KV memory of {args.num_kv_blocks} full blocks, max_model_len "
        f"{args.max_model_len}, {args.threads} threads\n"
    )
    print(
        "| pool | KV-cache groups | usable blocks | max concurrency at max_model_len | fill: "
        "output tok/s | fill: preemptions | fill: most blocks in use | multi-turn prompt-token "
        "hit ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        conc, fill, preemptions, turns, engine = rows[kind]
        print(
            f"| {kind} | {len(engine.link.pool.groups)} | "
            f"{usable_blocks(engine.runner.num_blocks)} | {conc:.1f} | "
            f"{out_tokens / fill['wall']:,.0f} | {preemptions} | {fill['most_blocks']} | "
            f"{turns['ratio']:.1%} |"
        )
    ratio = rows[grouped][3]["ratio"] / rows[full][3]["ratio"]
    print(
        f"\nconcurrency {grouped} / full: {rows[grouped][0] / rows[full][0]:.2f}x; multi-turn "
        f"hit ratio {grouped} / full: {ratio:.1%}; same tokens: fill {same_fill}, multi-turn "
        f"{same_turns}\n"
    )
    return same_fill and same_turns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=["mistral", "gemma3", "both"], default="both")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-kv-blocks", type=int, default=257, help="KV memory: 8 full-length sequences"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    families = ["mistral", "gemma3"] if args.family == "both" else [args.family]
    with tempfile.TemporaryDirectory() as tmp:
        ok = [bench_family(family, args, tmp) for family in families]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
