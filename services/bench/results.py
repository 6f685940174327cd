"""From timed requests to ``vllm bench serve``'s numbers: throughput, peaks, latency
statistics and goodput. Pure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from services.bench.backends import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> SLOs in milliseconds."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


def _tpot(o: RequestOutput) -> float | None:
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else None


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def timeline(outputs: Sequence[RequestOutput], t0: float, duration: float) -> dict[str, list]:
    """Per second of the run: output tokens received, and requests in flight (at most)."""
    n = max(1, math.ceil(duration))
    tokens = [0] * n
    inflight = [0] * n
    for o in outputs:
        for t, k in o.token_times:
            tokens[min(n - 1, max(0, int(t - t0)))] += k
        first, last = int(o.start - t0), int(o.start + o.latency - t0)
        for s in range(max(0, first), min(n - 1, last) + 1):
            inflight[s] += 1
    return {"second": list(range(n)), "output_tokens": tokens, "inflight": inflight}


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    edges = sorted(
        [(o.start, 1) for o in outputs] + [(o.start + o.latency, -1) for o in outputs],
        key=lambda e: (e[0], e[1]),
    )
    now = peak = 0
    for _, d in edges:
        now += d
        peak = max(peak, now)
    return peak


def summarize(
    outputs: Sequence[RequestOutput],
    duration: float,
    t0: float,
    *,
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    percentiles: Sequence[float] = (99,),
    goodput: dict[str, float] | None = None,
) -> dict[str, object]:
    ok = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    samples = {
        "ttft": [o.ttft * 1e3 for o in ok if o.output_tokens],
        "tpot": [t * 1e3 for o in ok if (t := _tpot(o)) is not None],
        "itl": [g * 1e3 for o in ok for g in o.itl],
        "e2el": [o.latency * 1e3 for o in ok],
    }
    line = timeline(outputs, t0, duration)
    result: dict[str, object] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": max(line["output_tokens"], default=0),
        "max_concurrent_requests": peak_concurrency(outputs),
    }
    if goodput:
        good = 0
        for o in ok:
            tpot = _tpot(o)
            if (
                o.ttft * 1e3 <= goodput.get("ttft", math.inf)
                and (tpot is None or tpot * 1e3 <= goodput.get("tpot", math.inf))
                and o.latency * 1e3 <= goodput.get("e2el", math.inf)
            ):
                good += 1
        result["request_goodput"] = good / duration
    for name in percentile_metrics:
        values = samples[name]
        result[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        result[f"median_{name}_ms"] = statistics.median(values) if values else 0.0
        result[f"std_{name}_ms"] = statistics.pstdev(values) if values else 0.0
        for q in percentiles:
            result[f"p{q:g}_{name}_ms"] = _percentile(values, q)
    return result
