"""Routing policies across several executors, on a workload of repeated system prompts.

    .venv/bin/python -m bench.routing_bench [--executors 4] [--blocks 192] [--prefixes 32]
        [--per-prefix 16] [--prefix-len 256] [--rate 40] [--policies ...] [--load-weights ...]

Set-up: a block manager, ``--executors`` executors (tiny random Llama, CPU, one torch thread
each) with ``--blocks`` KV blocks each (too few to hold every prefix), and a gateway with
``--routing`` set to each policy in turn, each on fresh processes (cold caches). The
reference is one executor with ``executors x blocks`` blocks (it can hold every prefix).

Workload: ``--prefixes`` distinct ``--prefix-len``-token system prompts x ``--per-prefix``
requests each (plus a distinct 16-token user part), in a seeded random interleaved order, with
Poisson arrivals at ``--rate`` requests/s; greedy, ``ignore_eos``, ``--output-len`` tokens.

Reported per policy: prefix hit ratio (cached / prompt tokens, as the executors report it),
prompt tokens computed, output tok/s over the run, TTFT p50 / p99, and load imbalance (the
most requests one executor got / the mean). Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.common.stats import percentile
from pagedserve.testing.procs import ServiceProcess, gateway_args, wait_serving
from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc

SUFFIX_LEN = 16


@dataclass
class Result:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(10, 600) for _ in range(args.prefix_len)] for _ in range(args.prefixes)
    ]
    prompts = [
        [*p, *(rng.randrange(10, 600) for _ in range(SUFFIX_LEN))]
        for p in prefixes
        for _ in range(args.per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts


def start(
    model: Path, args: argparse.Namespace, num_executors: int, blocks: int, routing: list[str]
) -> list[ServiceProcess]:
    procs = [ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")]
    try:
        _start_rest(procs, model, num_executors, blocks, routing)
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    return procs


def _start_rest(
    procs: list[ServiceProcess], model: Path, num_executors: int, blocks: int, routing: list[str]
) -> None:
    bm = procs[0].address
    for i in range(num_executors):
        procs.append(
            ServiceProcess(
                [
                    "executor",
                    "--model",
                    str(model),
                    "--port",
                    "0",
                    "--pool-id",
                    f"bench-{i}",
                    "--blockmgr-address",
                    bm,
                    "--num-kv-blocks",
                    str(blocks),
                    "--block-size",
                    "16",
                    "--max-model-len",
                    "512",
                ],
                "executor_ready",
            )
        )
    more = [a for p in procs[2:] for a in ("--executor", p.address)]
    gateway = ServiceProcess(
        gateway_args(
            model,
            procs[1].address,
            *more,
            "--metrics-port",  # the last one given wins
            "0",
            "--max-concurrent-requests",
            "4096",
            "--blockmgr-address",
            bm,
            *routing,
        ),
        "gateway_listening",
    )
    procs.append(gateway)
    wait_serving(gateway.address)


def metrics(port: int) -> dict[str, dict[tuple[str, ...], float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(s.labels.values())] = s.value
    return out


async def drive(address: str, prompts: list[list[int]], args: argparse.Namespace) -> list[Result]:
    rng = random.Random(args.seed + 1)
    channel = grpc.aio.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)

    async def one(prompt: list[int]) -> Result:
        t0 = time.perf_counter()
        ttft = None
        final = None
        request = G.GenerateRequest(
            prompt_token_ids=G.TokenIds(ids=prompt),
            sampling_params=G.SamplingParams(
                max_tokens=args.output_len, temperature=0, ignore_eos=True
            ),
        )
        async for r in stub.Generate(request, timeout=600):
            if ttft is None and r.token_ids:
                ttft = time.perf_counter() - t0
            final = r
        assert final is not None and ttft is not None
        u = final.usage
        return Result(ttft, u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens)

    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.sleep(rng.expovariate(args.rate))
    results = await asyncio.gather(*tasks)
    await channel.close()
    return results


def run(model: Path, args: argparse.Namespace, name: str, routing: list[str], ref: bool) -> dict:
    n = 1 if ref else args.executors
    blocks = args.blocks * args.executors if ref else args.blocks
    procs = start(model, args, n, blocks, routing)
    try:
        gateway = procs[-1]
        port = int(gateway.wait_for_event("metrics_listening")["metrics_port"])
        if "prefix-aware" in routing:  # wait until every executor's KV events are followed
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                live = metrics(port).get("pagedserve_routing_kv_events_live", {})
                if len(live) == n and all(v == 1 for v in live.values()):
                    break
                time.sleep(0.1)
        t0 = time.perf_counter()
        results = asyncio.run(drive(gateway.address, workload(args), args))
        wall = time.perf_counter() - t0
        routed = metrics(port).get("pagedserve_routed_requests_total", {})
    finally:
        for p in reversed(procs):
            p.stop()
    per_executor: dict[str, float] = {}
    for (executor, _policy), v in routed.items():
        per_executor[executor] = per_executor.get(executor, 0) + v
    counts = [per_executor.get(p.address, 0) for p in procs[1:-1]]
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    ttfts = sorted(r.ttft for r in results)
    return {
        "name": name,
        "hit": cached / prompt,
        "computed": prompt - cached,
        "tok_s": sum(r.output_tokens for r in results) / wall,
        "ttft_p50": statistics.median(ttfts) * 1e3,
        "ttft_p99": percentile(ttfts, 0.99) * 1e3,
        "imbalance": max(counts) / statistics.mean(counts),
        "counts": counts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executors", type=int, default=4)
    p.add_argument("--blocks", type=int, default=192, help="KV blocks per executor")
    p.add_argument("--prefixes", type=int, default=32)
    p.add_argument("--per-prefix", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=40.0, help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies",
        nargs="+",
        default=["round-robin", "least-loaded", "prefix-aware", "reference"],
    )
    p.add_argument(
        "--load-weights",
        type=float,
        nargs="+",
        default=None,
        help="run prefix-aware once per --routing-load-weight (default: the gateway's)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-llama")
        rows = []
        for policy in args.policies:
            if policy == "reference":
                label = f"reference (1 executor, {args.executors}x cache)"
                rows.append(run(model, args, label, ["--routing", "least-loaded"], True))
            elif policy == "prefix-aware" and args.load_weights:
                for w in args.load_weights:
                    routing = ["--routing", policy, "--routing-load-weight", str(w)]
                    rows.append(run(model, args, f"prefix-aware (weight {w})", routing, False))
            else:
                rows.append(run(model, args, policy, ["--routing", policy], False))
            r = rows[-1]
            print(f"# {r['name']}: per-executor requests {r['counts']}", file=sys.stderr)
    print(
        f"{args.executors} executors x {args.blocks} blocks of 16; {args.prefixes} prefixes x "
        f"{args.per_prefix} requests, prefix {args.prefix_len} + {SUFFIX_LEN} tokens, "
        f"output {args.output_len}, Poisson {args.rate}/s, seed {args.seed}\n"
    )
    print(
        "| policy | prefix hit ratio | prompt tokens computed | output tok/s "
        "| TTFT p50 ms | TTFT p99 ms | imbalance (max/mean requests) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['name']} | {r['hit']:.3f} | {r['computed']:,} | {r['tok_s']:.0f} "
            f"| {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['imbalance']:.2f} |"
        )


if __name__ == "__main__":
    main()
