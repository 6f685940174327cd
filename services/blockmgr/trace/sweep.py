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
from dataclasses import asdict, dataclass
from pathlib import Path

from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    Commit,
    EvictionPolicyName,
    Free,
    Grow,
    OpStatus,
    PoolSpec,
)
from services.blockmgr.pool.manager import KVBlockManager
from services.blockmgr.trace.public import FORMATS, PublicTrace, read_public_trace

__all__ = ["Point", "main", "parse_capacity", "replay_sequential"]

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


@dataclass
class Point:
    """One replay: the JSON's names (scripts and tests read them)."""

    policy: str
    capacity_tokens: int | None  # None: unbounded
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_ratio: float = 0.0
    max_hit_ratio: float = 0.0  # the trace's, at unbounded capacity
    num_requests: int = 0
    num_refused: int = 0  # requests larger than the pool
    num_evicted_blocks: int = 0
    seconds: float = 0.0


def replay_sequential(
    trace: PublicTrace, capacity_tokens: int | None, policy: str, block_size: int | None = None
) -> Point:
    """Replay ``trace`` one request after another (see the module docstring)."""
    bs = block_size or trace.block_tokens
    if trace.block_tokens % bs:
        raise ValueError(
            f"--block-size {bs} does not divide the trace's blocks of {trace.block_tokens} tokens"
        )
    sub = trace.block_tokens // bs
    start = time.perf_counter()
    if capacity_tokens is None:  # room for every distinct block and the largest request
        distinct = len({h for r in trace.requests for h in r.hash_ids}) * sub
        largest = max(
            (len(r.hash_ids) * sub + 1 + _blocks(r.output_length, bs) for r in trace.requests),
            default=1,
        )
        num_blocks = distinct + largest + 2
    else:
        num_blocks = capacity_tokens // bs + 1  # (the null block)
    manager = KVBlockManager(
        PoolSpec(num_blocks, bs, eviction_policy=EvictionPolicyName.parse(policy))
    )
    point = Point(policy, capacity_tokens, num_requests=len(trace.requests))
    keys: dict[int, list[bytes]] = {}
    step = manager.step
    for seq, r in enumerate(trace.requests):
        # Its trace blocks whole (the last one may be partial: held and hit whole).
        hashes = [k for h in r.hash_ids for k in _keys(keys, h, sub)]
        prompt = len(hashes) * bs + 1  # every block can hit (a hit never covers the last token)
        point.prompt_tokens += r.input_length
        (admitted,) = step([Admit(seq, prompt, prompt, tuple(hashes))])
        assert isinstance(admitted, AdmitResult)
        if admitted.status is not OpStatus.OK:
            point.num_refused += 1
            continue
        hit = admitted.num_cached_tokens // bs
        point.hit_tokens += min(hit * bs, r.input_length)
        step(
            [
                Commit(seq, hit, tuple(hashes[hit:])),
                Grow((seq,), (r.output_length,)),
                Free((seq,)),
            ]
        )
    point.hit_ratio = point.hit_tokens / point.prompt_tokens if point.prompt_tokens else 0.0
    point.max_hit_ratio = trace.max_hit_tokens / trace.prompt_tokens if trace.prompt_tokens else 0.0
    point.num_evicted_blocks = manager.pool.num_evicted
    point.seconds = time.perf_counter() - start
    return point


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def _keys(cache: dict[int, list[bytes]], h: int, sub: int) -> list[bytes]:
    """Our blocks' hashes for the trace's hash id ``h``: (h, j) for its j-th block."""
    keys = cache.get(h)
    if keys is None:
        base = h.to_bytes(8, "little", signed=True)
        keys = cache[h] = [base + j.to_bytes(24, "little") for j in range(sub)]  # 32 bytes
    return keys


_TRACE: PublicTrace | None = None  # a worker's copy (forked)


def _run(job: tuple[int | None, str, int | None]) -> Point:
    assert _TRACE is not None
    return replay_sequential(_TRACE, *job)


def sweep(
    trace: PublicTrace,
    capacities: Sequence[int | None],
    policies: Sequence[str],
    block_size: int | None = None,
    workers: int = 1,
) -> list[Point]:
    """Every (capacity, policy) point, in that order, on ``workers`` processes."""
    global _TRACE
    jobs = [(c, p, block_size) for c in capacities for p in policies]
    _TRACE = trace
    if workers <= 1 or len(jobs) == 1:
        return [_run(job) for job in jobs]
    with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
        return pool.map(_run, jobs, chunksize=1)


def plot(points: Sequence[Point], path: Path, title: str) -> None:
    """Hit ratio against capacity per policy, log x, the trace's maximum as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for policy in dict.fromkeys(p.policy for p in points):
        pts = sorted(
            (p.capacity_tokens, p.hit_ratio)
            for p in points
            if p.policy == policy and p.capacity_tokens
        )
        ax.plot([c for c, _ in pts], [h for _, h in pts], marker="o", label=policy)
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
    p.add_argument("--sequential", action="store_true", help="the (default) sequential mode")
    p.add_argument(
        "--capacity", default="unbounded", help="comma-separated: 3M, 250000, 5859b, unbounded"
    )
    p.add_argument(
        "--policy",
        default="lru",
        help=f"comma-separated, of {[x.value for x in EvictionPolicyName]}",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="tokens per block (default: the format's)"
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, default=None, help="write every point to this file")
    p.add_argument("--plot", type=Path, default=None, help="write the hit-ratio plot (PNG)")
    args = p.parse_args(argv)
    bs = args.block_size or FORMATS[args.format]
    try:
        policies = [
            EvictionPolicyName.parse(x.strip()).value for x in args.policy.split(",") if x.strip()
        ]
        capacities = [parse_capacity(x, bs) for x in args.capacity.split(",") if x.strip()]
        if FORMATS[args.format] % bs:
            raise ValueError(
                f"--block-size {bs} does not divide the format's {FORMATS[args.format]} "
                "tokens per hash"
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
    points = sweep(trace, capacities, policies, args.block_size, args.workers)
    print(
        "| policy | capacity (tokens) | hit ratio | of the maximum | refused | evicted blocks "
        "| replay s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for pt in points:
        cap = "unbounded" if pt.capacity_tokens is None else f"{pt.capacity_tokens:,}"
        share = pt.hit_ratio / pt.max_hit_ratio if pt.max_hit_ratio else 0.0
        print(
            f"| {pt.policy} | {cap} | {pt.hit_ratio:.1%} | {share:.0%} | {pt.num_refused:,} "
            f"| {pt.num_evicted_blocks:,} | {pt.seconds:.1f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(pt) for pt in points], indent=1) + "\n")
    if args.plot is not None:
        plot(points, args.plot, f"{Path(args.trace).name} ({args.format}), sequential")
    return 1 if trace.bad_lines and not trace.requests else 0


if __name__ == "__main__":
    sys.exit(main())
