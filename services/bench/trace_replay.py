"""Live replay of a public trace (``bench serve --dataset-name mooncake|bailian``): the trace's
requests as real prompts (:func:`~services.bench.datasets.trace_requests`) sent at their
timestamps, and the prefix-cache hit ratio the server reports (each response's cached prompt
tokens) beside what offline replay of the same scaled trace predicts
(:func:`services.blockmgr.trace.sweep.replay_sequential` under the engine's own rules: only
a prompt's full blocks are cached, a hit never covers its last token). The prediction is
sequential, so a live run with requests in flight together may hit less (a prefix still being
computed is not a hit yet) or see other evictions."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from services.bench.backends import RequestOutput
from services.bench.datasets import BenchRequest, trace_requests
from services.blockmgr.trace.public import FORMATS, PublicTrace, read_public_trace
from services.blockmgr.trace.sweep import parse_capacity, replay_sequential

__all__ = ["TRACE_DATASETS", "add_arguments", "check", "hit_summary", "load", "table_lines"]

TRACE_DATASETS = tuple(sorted(FORMATS))


def add_arguments(a: Callable[..., Any]) -> None:
    a("--trace-scale", type=float, default=1 / 32, help="trace datasets: lengths times this")
    a("--trace-time-scale", type=float, default=1.0, help="trace datasets: times over this")
    a(
        "--replay-capacity",
        default="unbounded",
        help="trace datasets: the offline prediction's cache (3M, 5859b, unbounded)",
    )
    a("--replay-block-size", type=int, default=16, help="the server's tokens per block")
    a("--replay-policy", default="lru", help="the offline prediction's eviction policy")


def check(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a trace dataset without a file, or a bad scale."""
    if args.dataset_name not in TRACE_DATASETS:
        return
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.trace_scale <= 0 or args.trace_time_scale <= 0:
        raise ValueError("--trace-scale and --trace-time-scale must be > 0")
    parse_capacity(args.replay_capacity, args.replay_block_size)


def load(args: argparse.Namespace, vocab_size: int) -> tuple[list[BenchRequest], PublicTrace]:
    """The first ``--num-prompts`` requests of the trace, scaled, and the scaled trace."""
    trace = read_public_trace(args.dataset_path, args.dataset_name)
    if trace.bad_lines:
        first = trace.bad_lines[0]
        print(
            f"{args.dataset_path}: {len(trace.bad_lines)} bad lines (line {first.line}: "
            f"{first.reason})"
        )
    scaled = trace.scaled(args.num_prompts, args.trace_scale, args.trace_time_scale)
    if len(scaled.requests) < args.num_prompts:
        raise ValueError(
            f"{args.dataset_path} holds only {len(scaled.requests)} requests, "
            f"{args.num_prompts} asked"
        )
    return trace_requests(scaled, vocab_size, args.seed), scaled


def hit_summary(
    outputs: Sequence[RequestOutput], trace: PublicTrace | None, args: argparse.Namespace
) -> dict[str, Any]:
    """The served prefix-hit ratio (cached prompt tokens over prompt tokens, successful
    requests), and for a trace dataset the offline replay's prediction for the same requests
    (``outputs`` in ``trace``'s order)."""
    ok = [o for o in outputs if o.success]
    prompt = sum(o.prompt_len for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    out: dict[str, Any] = {
        "cached_prompt_tokens": cached,
        "prefix_hit_ratio": cached / prompt if prompt else 0.0,
    }
    if trace is not None:  # the requests served (a failed one cached nothing)
        served = [r for r, o in zip(trace.requests, outputs, strict=True) if o.success]
        trace = PublicTrace(trace.format, trace.block_tokens, served)
        capacity = parse_capacity(args.replay_capacity, args.replay_block_size)
        point = replay_sequential(
            trace, capacity, args.replay_policy, args.replay_block_size, engine_rules=True
        )
        out["offline_prefix_hit_ratio"] = point.hit_ratio
    return out


def table_lines(result: dict[str, Any]) -> list[str]:
    lines = ["{s:{c}^60}".format(s=" Prefix Cache ", c="-")]
    lines.append(f"{'Cached prompt tokens:':<44}{result['cached_prompt_tokens']:>16}")
    lines.append(f"{'Prefix hit ratio (%):':<44}{result['prefix_hit_ratio'] * 100:>16.2f}")
    if "offline_prefix_hit_ratio" in result:
        offline = result["offline_prefix_hit_ratio"] * 100
        lines.append(f"{'Offline replay predicts (%):':<44}{offline:>16.2f}")
    return lines
