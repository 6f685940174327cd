"""Multi-turn chat against the KV-cache tiers: no tier, a host tier, a smaller host tier over a
disk tier, and an "infinite" device cache, in one run.

    .venv/bin/python -m bench.internals.multiturn_bench [--conversations 48] [--turns 6]
        [--small-host 0.05] [--fills-beside] [--alternate 3]

N conversations of T turns. Each turn sends the conversation's whole history plus a new user
message of 100-300 tokens and asks for 50-150 tokens (greedy, ``ignore_eos``); every
conversation's turn ``t`` is sent at once, then turn ``t + 1`` once they are all answered, so
the conversations interleave and the working set (every history) grows to several times the
device cache. The engine runs in-process over a random Llama (hidden 256, 4 layers, CPU,
fp32), its block manager in-process.

- ``no tier``: a device cache of ``--device-share`` of the final working set;
- ``host tier``: the same device cache and a host tier ``--host-factor`` times its size;
- ``host + disk``: the same device cache, a host tier of the device cache's size and a disk
  tier (a file in a temporary directory) making up the rest of ``--host-factor``;
- ``infinite``: a device cache holding every history;
- with ``--small-host S``, ``small host + disk``: a host tier of ``S`` times the device cache
  (smaller than what one Step evicts: the offloads its slots cannot take go straight to the
  disk) over a disk tier making up the rest;
- with ``--fills-beside``, each tier again with its fills beside the forward (the CUDA
  default), the chunks that read them held back a step.

Reported per configuration: the prompt-token hit ratio (and its host share), prompt tokens
computed, TTFT p50 / p99 (from a turn's submission to its first token, in-process), output
tok/s over the run, and whether the tokens equal the infinite cache's. Prints markdown.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.stats import percentile
from bench.common.workloads import final_lengths, turn_plan
from pagedserve.tools.tiny_model import write_tiny_model
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.model.config import ModelConfig
from services.executor.model.kv_cache import bytes_per_block
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

TIERED = ("host tier", "host + disk", "small host + disk")


def run(
    config: ExecutorConfig,
    plan: list[list[tuple[int, int]]],
    seed: int,
    fills_async: bool | None = None,
) -> dict[str, Any]:
    runner = build_runner(config.runner_config())
    if fills_async is not None and runner.host is not None:
        runner.fills_async = fills_async  # (the engine reads it when built)
    engine, _ = build_engine(config, runner=runner, blockmgr=InProcessClient())
    rng = random.Random(seed)
    vocab = engine.settings.vocab_size
    histories = [[1] for _ in plan]
    ttfts: list[float] = []
    outputs: dict[str, list[int]] = {}
    num_output = 0
    start = time.perf_counter()
    for turn in range(len(plan[0])):
        sent: dict[str, float] = {}
        for c, conv in enumerate(plan):
            message, n = conv[turn]
            histories[c].extend(rng.randrange(3, vocab) for _ in range(message))
            rid = f"c{c}t{turn}"
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(RequestKey(0, rid), list(histories[c]), params)
            sent[rid] = time.perf_counter()
        while engine.has_work:
            for o in engine.step():
                rid = o.req_id.request_id
                if rid not in outputs:
                    ttfts.append(time.perf_counter() - sent[rid])
                outputs.setdefault(rid, []).extend(o.token_ids)
                num_output += len(o.token_ids)
        for c in range(len(plan)):
            histories[c].extend(outputs[f"c{c}t{turn}"])
    wall = time.perf_counter() - start
    stats = engine.link.client.stats(engine.link.pool_id)
    ttfts.sort()
    return {
        "hit": stats.prefix_cache_hits_tokens / stats.prefix_cache_queries_tokens,
        "host_hit": stats.host_hits_tokens / stats.prefix_cache_queries_tokens,
        "disk_hit": stats.disk_hits_tokens / stats.prefix_cache_queries_tokens,
        "spilled": stats.num_spilled_blocks,
        "loaded": stats.num_loaded_blocks,
        "computed": stats.prefix_cache_queries_tokens - stats.prefix_cache_hits_tokens,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": percentile(ttfts, 0.99),
        "tok_s": num_output / wall,
        "outputs": outputs,
        "offloaded": stats.num_offloaded_blocks,
        "onboarded": stats.num_onboarded_blocks,
        "preemptions": engine.scheduler.num_preemptions,
        "held_back": engine.scheduler.num_chunks_held_back,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-share", type=float, default=0.25)
    p.add_argument("--host-factor", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--small-host",
        type=float,
        default=0.0,
        help="also run a host tier of this share of the device cache (e.g. 0.05) over a disk "
        "tier making up the rest: smaller than one Step's evictions, offloads go to disk",
    )
    p.add_argument(
        "--fills-beside",
        action="store_true",
        help="also run each tier with its fills beside the forward (on a worker thread, the "
        "chunks that read them held back a step: the CUDA default) rather than in line",
    )
    p.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="instead: run no tier and the host tier alternately this many times (the output "
        "tok/s ratio measured pair by pair, as the machine's speed drifts)",
    )
    args = p.parse_args()
    rng = random.Random(args.seed)
    bs = args.block_size
    plan = turn_plan(rng, args.conversations, args.turns)
    finals = [1 + n for n in final_lengths(plan)]  # BOS included
    working_set = sum(-(-n // bs) for n in finals)
    device = max(int(working_set * args.device_share), 2 * (max(finals) // bs + 2))
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(
            Path(tmp) / "llama",
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            intermediate_size=512,
            max_position_embeddings=4096,
        )
        common: dict[str, Any] = {
            "model": str(model),
            "dtype": "float32",
            "device": "cpu",
            "block_size": bs,
            "max_model_len": max(finals) + 16,
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 64,
            "cpu_threads": args.threads,
        }
        mc = ModelConfig.from_hf_config(json.loads((Path(model) / "config.json").read_text()))
        host_gib = args.host_factor * device * bytes_per_block(mc, bs, torch.float32) / 2**30
        configs = {
            "no tier": ExecutorConfig(**common, num_kv_blocks=device + 1),
            "host tier": ExecutorConfig(
                **common, num_kv_blocks=device + 1, kv_offloading_size=host_gib
            ),
            "host + disk": ExecutorConfig(
                **common,
                num_kv_blocks=device + 1,
                kv_offloading_size=host_gib / args.host_factor,
                kv_offloading_disk_path=str(Path(tmp) / "disk-tier"),
                kv_offloading_disk_size=host_gib * (args.host_factor - 1) / args.host_factor,
            ),
            "infinite": ExecutorConfig(**common, num_kv_blocks=2 * working_set + 1),
        }
        if args.small_host:
            small = args.small_host * host_gib / args.host_factor
            configs = {
                **{k: v for k, v in configs.items() if k != "infinite"},
                "small host + disk": ExecutorConfig(
                    **common,
                    num_kv_blocks=device + 1,
                    kv_offloading_size=small,
                    kv_offloading_disk_path=str(Path(tmp) / "disk-tier-small"),
                    kv_offloading_disk_size=host_gib - small,
                ),
                "infinite": configs["infinite"],
            }
        runs: list[tuple[str, ExecutorConfig, bool | None]] = [
            (name, cfg, None) for name, cfg in configs.items()
        ]
        if args.fills_beside:
            tiers = [(f"{n}, fills beside", c, True) for n, c, _ in runs if n in TIERED]
            runs[-1:-1] = tiers
        if args.alternate:
            return _alternate(configs["no tier"], configs["host tier"], plan, args)
        results = {name: run(cfg, plan, args.seed, fills) for name, cfg, fills in runs}
    print(
        f"# Multi-turn: {args.conversations} conversations x {args.turns} turns, working set "
        f"{working_set} blocks of {bs}; device cache {device} blocks "
        f"({args.device_share:.0%}), host tier {args.host_factor:g}x the device cache\n"
    )
    print(
        "| configuration | prompt-token hit ratio | of which from host / disk | prompt tokens "
        "computed | TTFT p50 / p99 s | output tok/s | offloaded / onboarded blocks | spilled / "
        "loaded blocks | preemptions | chunks held back for fills | same tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    reference = results["infinite"]["outputs"]
    for name, r in results.items():
        print(
            f"| {name} | {r['hit']:.1%} | {r['host_hit']:.1%} / {r['disk_hit']:.1%} | "
            f"{r['computed']:,} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
            f"{r['tok_s']:,.0f} | {r['offloaded']:,} / {r['onboarded']:,} | "
            f"{r['spilled']:,} / {r['loaded']:,} | {r['preemptions']} | {r['held_back']:,} | "
            f"{r['outputs'] == reference} |"
        )
    none, inf = results["no tier"], results["infinite"]
    for name in (n for n in results if n.startswith(TIERED)):
        r = results[name]
        print(
            f"\n{name} vs infinite hit ratio: {r['hit'] / inf['hit']:.1%}; prompt tokens "
            f"computed vs no tier: {r['computed'] / none['computed']:.1%}; output tok/s vs no "
            f"tier: {r['tok_s'] / none['tok_s']:.2f}x"
        )
    same = all(r["outputs"] == reference for r in results.values())
    return 0 if same else 1


def _alternate(
    none: ExecutorConfig, host: ExecutorConfig, plan: list[list[tuple[int, int]]], args: Any
) -> int:
    print("| pair | no tier tok/s | host tier tok/s | ratio |\n|---:|---:|---:|---:|")
    for i in range(args.alternate):
        a, b = run(none, plan, args.seed), run(host, plan, args.seed)
        ratio = b["tok_s"] / a["tok_s"]
        print(f"| {i + 1} | {a['tok_s']:,.0f} | {b['tok_s']:,.0f} | {ratio:.2f}x |", flush=True)
        if a["outputs"] != b["outputs"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
