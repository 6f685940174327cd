"""A cache experiment on a public trace: its requests replayed through the real
:class:`KVBlockManager`, at several capacities and eviction policies.

    pagedserve blockmgr replay --format mooncake FILE --capacity 3M,50M,unbounded \\
        --policy lru,arc [--block-size 16] [--json points.json] [--plot hits.png]

**Sequential** (the papers' "theoretical" setting, Mooncake's Fig. 9): each request ends before
the next begins, as an engine would send it: admit the prompt (its leading blocks hit the
cache, the rest allocated), commit the prompt's blocks under the trace's hashes, grow by the
output, free. A hash id of the trace (512 tokens for Mooncake, 16 for Bailian) becomes whole
blocks of ``--block-size`` tokens (default: the format's), the j-th of hash h keyed by (h, j).

**Hit accounting**: a request's hit is the longest run of its leading blocks already cached,
in tokens, capped at its ``input_length`` (the prompt's last block may be partial: it is
held and hit whole); the hit ratio is hit tokens over prompt tokens. At unbounded capacity
this is exactly the trace's maximum (:attr:`PublicTrace.max_hit_tokens`). A request larger
than the whole pool is refused (counted), its prompt tokens looked up without a hit.

**Timed** (``--timed``, :mod:`.timed`): requests arrive at their timestamps and hold their
blocks for a service time from a stated model (``--prefill-rate``, ``--decode-rate``,
``--max-concurrency``, ``--time-scale``); admissions wait as an engine's would.

Points of a sweep run in parallel worker processes, one per core.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from services.blockmgr.api.types import EvictionPolicyName
from services.blockmgr.trace.public import FORMATS, PublicTrace, read_public_trace
from services.blockmgr.trace.timed import ServiceModel, TimedPoint, replay_timed
from services.blockmgr.trace.trace_pool import Point, TracePool, finish

__all__ = ["main", "parse_capacity", "replay_sequential", "sweep"]

PIN_BUDGET = 0.1  # of the blocks, as the executor's --session-pin-budget default
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG]?)(b?)")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_capacity(text: str, block_size: int) -> int | None:
    """A device capacity in tokens: ``3M``, ``250000``, ``5859b`` (blocks of ``block_size``),
    or ``unbounded`` (None). ValueError naming the value otherwise."""
    if text.strip().lower() == "unbounded":
        return None
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"--capacity {text!r}: tokens (3M, 250000), blocks (5859b) or unbounded")
    amount = float(m.group(1)) * _UNITS[m.group(2).lower()]
    tokens = int(amount) * block_size if m.group(3) else int(amount)
    if tokens < block_size:
        raise ValueError(f"--capacity {text!r} holds no block of {block_size} tokens")
    return tokens


def replay_sequential(
    trace: PublicTrace,
    capacity_tokens: int | None,
    policy: str,
    block_size: int | None = None,
    engine_rules: bool = False,
    host_tokens: int = 0,
    pin_ttl_s: float = 0.0,
    pin_budget: float = PIN_BUDGET,
) -> Point:
    """Replay ``trace`` one request after another (see the module docstring; with
    ``engine_rules``, a live engine's hit rules; over a host tier of ``host_tokens``:
    :class:`TracePool`). ``pin_ttl_s``: every request a later turn continues
    (:meth:`PublicTrace.followed`) is pinned that long on the trace's clock, within
    ``pin_budget`` of the blocks."""
    start = time.perf_counter()
    budget = pin_budget if pin_ttl_s else 0.0
    pool = TracePool(trace, capacity_tokens, policy, block_size, engine_rules, host_tokens, budget)
    point = Point(policy, capacity_tokens, num_requests=len(trace.requests))
    point.host_capacity_tokens, point.pin_ttl_s = host_tokens, pin_ttl_s
    followed = trace.followed() if pin_ttl_s else [False] * len(trace.requests)
    for seq, r in enumerate(trace.requests):
        point.prompt_tokens += r.input_length
        pool.now = r.timestamp_s
        hit = pool.admit(seq, r, pin_ttl_s if followed[seq] else 0.0)
        if hit is None:  # larger than the whole pool (nothing else holds blocks)
            point.num_refused += 1
            continue
        point.hit_tokens += hit
        pool.free(seq)
    return finish(point, trace, pool, start)


_TRACE: PublicTrace | None = None  # a worker's copy (forked)


def _run(job: tuple[int | None, int, str, int | None, ServiceModel | None, float]) -> Point:
    assert _TRACE is not None
    capacity, host, policy, block_size, model, pin_ttl_s = job
    if model is not None:
        return replay_timed(_TRACE, capacity, policy, block_size, model, host)
    return replay_sequential(
        _TRACE, capacity, policy, block_size, host_tokens=host, pin_ttl_s=pin_ttl_s
    )


def sweep(
    trace: PublicTrace,
    capacities: Sequence[int | None],
    policies: Sequence[str],
    block_size: int | None = None,
    workers: int = 1,
    model: ServiceModel | None = None,
    progress: bool = False,
    host_capacities: Sequence[int] = (0,),
    pin_ttls: Sequence[float] = (0.0,),
) -> list[Point]:
    """Every (capacity, host tier, policy, session pin) point, in that order, on ``workers``
    processes; timed under ``model`` if given, else sequential; a progress bar on stderr if
    ``progress``."""
    global _TRACE
    jobs = [
        (c, h, p, block_size, model, ttl)
        for c in capacities
        for h in host_capacities
        for p in policies
        for ttl in pin_ttls
    ]
    _TRACE = trace
    bar = tqdm(total=len(jobs), unit="point", disable=not progress, file=sys.stderr)
    if workers <= 1 or len(jobs) == 1:
        points = []
        for job in jobs:
            points.append(_run(job))
            bar.update()
        bar.close()
        return points
    with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
        points = []
        for point in pool.imap(_run, jobs, chunksize=1):  # (in order)
            points.append(point)
            bar.update()
    bar.close()
    return points


def plot(points: Sequence[Point], path: Path, title: str) -> None:
    """Hit ratio against capacity per policy, log x, the trace's maximum as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key in dict.fromkeys((p.policy, p.host_capacity_tokens, p.pin_ttl_s) for p in points):
        policy, host, pin = key
        pts = sorted(
            (p.capacity_tokens, p.hit_ratio)
            for p in points
            if (p.policy, p.host_capacity_tokens, p.pin_ttl_s) == key and p.capacity_tokens
        )
        label = f"{policy} + host {host:,}" if host else policy
        label += f", sessions pinned {pin:g} s" if pin else ""
        ax.plot([c for c, _ in pts], [h for _, h in pts], marker="o", label=label)
    ax.axhline(points[0].max_hit_ratio, color="grey", linestyle="--", label="trace maximum")
    ax.set_xscale("log")
    ax.set_xlabel("device KV capacity (tokens)")
    ax.set_ylabel("prefix hit ratio (tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pagedserve blockmgr replay --format mooncake|bailian",
        description="Replay a public trace sequentially at several capacities and policies.",
    )
    p.add_argument("trace", help="the trace file (JSON lines)")
    p.add_argument("--format", required=True, choices=sorted(FORMATS))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sequential", action="store_true", help="one request at a time (default)")
    mode.add_argument("--timed", action="store_true", help="arrivals at the trace's times")
    defaults = ServiceModel()
    p.add_argument("--time-scale", type=float, default=defaults.time_scale)
    p.add_argument(
        "--prefill-rate",
        type=float,
        default=defaults.prefill_tokens_per_s,
        help="--timed: uncached prompt tokens per second",
    )
    p.add_argument(
        "--decode-rate",
        type=float,
        default=defaults.decode_tokens_per_s,
        help="--timed: output tokens per second of each running request",
    )
    p.add_argument("--max-concurrency", type=int, default=defaults.max_concurrency)
    p.add_argument(
        "--capacity", default="unbounded", help="comma-separated: 3M, 250000, 5859b, unbounded"
    )
    p.add_argument(
        "--host-capacity",
        default="0",
        help="comma-separated host-tier sizes under the device cache (as --capacity; 0: none)",
    )
    p.add_argument(
        "--policy",
        default="lru",
        help=f"comma-separated, of {[x.value for x in EvictionPolicyName]}",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="tokens per block (default: the format's)"
    )
    p.add_argument(
        "--pin-sessions",
        default="0",
        metavar="TTL[,TTL...]",
        help="pin every request a later turn continues for TTL seconds of the trace's clock "
        f"(sequential mode; within {PIN_BUDGET:.0%} of the blocks); a list compares them, 0: none",
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", type=Path, default=None, help="write every point to this file")
    p.add_argument("--plot", type=Path, default=None, help="write the hit-ratio plot (PNG)")
    args = p.parse_args(argv)
    bs = args.block_size or FORMATS[args.format]
    try:
        policies = [
            EvictionPolicyName.parse(x.strip()).value for x in args.policy.split(",") if x.strip()
        ]
        capacities = [parse_capacity(x, bs) for x in args.capacity.split(",") if x.strip()]
        hosts = [
            0 if x.strip() == "0" else parse_capacity(x, bs) or 0
            for x in args.host_capacity.split(",")
            if x.strip()
        ]
        pin_ttls = [float(x) for x in args.pin_sessions.split(",") if x.strip()]
        if any(not 0 <= t <= 86_400 for t in pin_ttls) or (args.timed and any(pin_ttls)):
            raise ValueError("--pin-sessions: seconds in [0, 86400], sequential mode only")
        if any(h and h < bs for h in hosts):
            raise ValueError("--host-capacity holds no block")
        if FORMATS[args.format] % bs:
            raise ValueError(
                f"--block-size {bs} does not divide the format's {FORMATS[args.format]} "
                "tokens per hash"
            )
        model = (
            ServiceModel(args.prefill_rate, args.decode_rate, args.max_concurrency, args.time_scale)
            if args.timed
            else None
        )
    except ValueError as exc:
        p.error(str(exc))
    try:
        trace = read_public_trace(args.trace, args.format)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for bad in trace.bad_lines[:10]:
        print(f"{args.trace}:{bad.line}: skipped: {bad.reason}", file=sys.stderr)
    print(
        f"trace {args.trace} ({args.format}): {len(trace.requests):,} requests, "
        f"{trace.prompt_tokens:,} prompt tokens, {len(trace.bad_lines)} bad lines; "
        f"maximum hit ratio {trace.max_hit_tokens / max(1, trace.prompt_tokens):.1%}\n"
    )
    points = sweep(
        trace,
        capacities,
        policies,
        args.block_size,
        args.workers,
        model,
        not args.no_progress,
        hosts,
        pin_ttls,
    )
    timed = " mean wait s | longest queue |" if args.timed else ""
    tiers = any(hosts)
    tier = " host tier (tokens) | host hit tokens |" if tiers else ""
    pins = any(pin_ttls)
    print(
        "| policy | capacity (tokens) | hit ratio | of the maximum | refused | evicted blocks "
        f"| replay s |{timed}{tier}{' session pins (s) |' if pins else ''}"
    )
    print(
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * (args.timed + tiers) + "---:|" * pins
    )
    for pt in points:
        cap = "unbounded" if pt.capacity_tokens is None else f"{pt.capacity_tokens:,}"
        share = pt.hit_ratio / pt.max_hit_ratio if pt.max_hit_ratio else 0.0
        waits = (
            f" {pt.mean_wait_s:.2f} | {pt.max_waiting:,} |" if isinstance(pt, TimedPoint) else ""
        )
        host = f" {pt.host_capacity_tokens:,} | {pt.host_hit_tokens:,} |" if tiers else ""
        print(
            f"| {pt.policy} | {cap} | {pt.hit_ratio:.1%} | {share:.0%} | {pt.num_refused:,} "
            f"| {pt.num_evicted_blocks:,} | {pt.seconds:.1f} |{waits}{host}"
            + (f" {pt.pin_ttl_s:g} |" if pins else "")
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(pt) for pt in points], indent=1) + "\n")
    if args.plot is not None:
        where = f"{Path(args.trace).name} ({args.format})"
        plot(points, args.plot, f"{where}, {'timed' if args.timed else 'sequential'}")
    return 1 if trace.bad_lines and not trace.requests else 0


if __name__ == "__main__":
    sys.exit(main())
