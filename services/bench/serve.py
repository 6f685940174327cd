"""``pagedserve bench serve``: load a running deployment the way ``vllm bench serve`` does.

Requests from a dataset are sent at ``--request-rate`` (Poisson when ``--burstiness`` is 1,
gamma arrivals otherwise; ``inf`` sends them all at once), at most ``--max-concurrency`` in
flight, over gRPC or the OpenAI HTTP API. While it runs a progress bar counts finished
requests; then vLLM's summary table is printed. ``--save-result`` writes every figure and
every request's timings as JSON; ``--plot`` writes PNGs (TTFT / ITL CDFs, output tok/s and
requests in flight over time, and with ``--sweep-request-rate`` the latency-throughput curve).

As in vLLM, ``--backend openai`` sends to ``--base-url`` (the server root, e.g.
``http://127.0.0.1:8000``; default ``http://--host:--port``) plus ``--endpoint`` (default
``/v1/completions``), resolves the model from ``/v1/models`` unless ``--model`` names it, and
sends ``OPENAI_API_KEY`` from the environment as ``Authorization: Bearer`` (``--api-key``
overrides it; the gRPC backend sends the same key).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from services.bench import trace_replay
from services.bench.backends import GrpcBackend, ModelListError, OpenAIBackend, RequestOutput
from services.bench.datasets import (
    BenchRequest,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from services.bench.results import METRICS, parse_goodput, summarize, timeline
from services.bench.spec_metrics import scrape
from services.bench.spec_metrics import summary as spec_summary

Backend = GrpcBackend | OpenAIBackend
API_KEY_ENV = "OPENAI_API_KEY"  # what vLLM's benchmark sends as the bearer token
DEFAULT_ENDPOINT = "/v1/completions"
MODELS_PATH = "/v1/models"  # where vLLM's benchmark finds the model to use


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench serve", description=__doc__)
    a = p.add_argument
    a("--backend", choices=["grpc", "openai"], default="grpc")
    a("--address", default="127.0.0.1:50051", help="gateway gRPC host:port (--backend grpc)")
    a(
        "--base-url",
        default=None,
        help="server root of the OpenAI-compatible API, e.g. http://127.0.0.1:8000, as in "
        "vllm bench serve: --endpoint is appended (--backend openai; default "
        "http://HOST:PORT from --host and --port)",
    )
    a("--host", default="127.0.0.1", help="OpenAI API host when no --base-url is given")
    a("--port", type=int, default=8000, help="OpenAI API port when no --base-url is given")
    a(
        "--endpoint",
        default=DEFAULT_ENDPOINT,
        help="path of the completions API under the base URL (default %(default)s)",
    )
    a("--model", default=None, help="model name for the OpenAI API (default: /v1/models)")
    a("--tokenizer", default=None, help="checkpoint dir: vocabulary, and ShareGPT lengths")
    a(
        "--api-key",
        default=None,
        help=f"sent as `authorization: Bearer` (default: the {API_KEY_ENV} environment "
        "variable, as in vllm bench serve)",
    )
    a(
        "--dataset-name",
        choices=["random", "prefix-repetition", "sharegpt", *trace_replay.TRACE_DATASETS],
        default="random",
    )
    a("--dataset-path", default=None, help="ShareGPT JSON file, or a mooncake/bailian trace")
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--prefix-repetition-prefix-len", type=int, default=256)
    a("--prefix-repetition-suffix-len", type=int, default=256)
    a("--prefix-repetition-num-prefixes", type=int, default=10)
    a("--prefix-repetition-output-len", type=int, default=128)
    trace_replay.add_arguments(a)
    a("--num-prompts", type=int, default=1000)
    a("--request-rate", type=float, default=math.inf, help="requests/s (default inf)")
    a("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a("--max-concurrency", type=int, default=None)
    a("--ignore-eos", action="store_true")
    a("--seed", type=int, default=0)
    a("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft, tpot, e2el")
    a("--percentile-metrics", default="ttft,tpot,itl", help=f"some of {','.join(METRICS)}")
    a("--metric-percentiles", default="99", help="comma-separated percentiles")
    a("--save-result", action="store_true")
    a("--result-dir", default=".")
    a("--result-filename", default=None)
    a("--plot", action="store_true", help="write PNG plots to --result-dir")
    a("--sweep-request-rate", default=None, help="e.g. 1,2,4,8,inf: one run per rate")
    a("--disable-tqdm", action="store_true")
    return p


def _check(args: argparse.Namespace) -> None:
    metrics = args.percentile_metrics.split(",")
    if unknown := [m for m in metrics if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; use {list(METRICS)}")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    parse_goodput(args.goodput)
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.dataset_name == "sharegpt" and not (args.dataset_path and args.tokenizer):
        raise ValueError("--dataset-name sharegpt needs --dataset-path and --tokenizer")
    trace_replay.check(args)
    if args.backend == "openai":
        openai_urls(args)


def openai_urls(args: argparse.Namespace) -> tuple[str, str]:
    """``(completions URL, models URL)`` as ``vllm bench serve`` builds them: ``--base-url``
    (else ``http://--host:--port``) followed by ``--endpoint``, and by ``/v1/models``.
    Raises ``ValueError`` for an endpoint that is not a completions API, or a base URL ending
    in ``/v1`` (the old convention here) in front of an endpoint that starts with it."""
    root = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must be an http(s) URL, got {args.base_url!r}")
    if not endpoint.startswith("/") or not endpoint.endswith("completions"):
        raise ValueError(f"--endpoint must be a path such as {DEFAULT_ENDPOINT}, got {endpoint!r}")
    if endpoint.endswith("chat/completions"):
        raise ValueError("--backend openai benchmarks the completions API, not chat completions")
    if root.endswith("/v1") and endpoint.startswith("/v1/"):
        raise ValueError(
            f"--base-url is the server root, as in vllm bench serve: {root[: -len('/v1')]} "
            f"(--endpoint adds {endpoint}), not {args.base_url}"
        )
    return root + endpoint, root + MODELS_PATH


async def _dataset(args: argparse.Namespace, backend: Backend) -> list[BenchRequest]:
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    if args.dataset_name == "sharegpt":
        assert tokenizer is not None
        return sharegpt_requests(Path(args.dataset_path), args.num_prompts, tokenizer, args.seed)
    if tokenizer is not None:
        vocab = len(tokenizer)
    elif isinstance(backend, GrpcBackend):
        vocab = await backend.vocab_size()
    else:
        raise ValueError("--backend openai with token-id datasets needs --tokenizer")
    if args.dataset_name in trace_replay.TRACE_DATASETS:
        requests, args.scaled_trace = trace_replay.load(args, vocab)
        return requests
    if args.dataset_name == "random":
        return random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            vocab,
            args.seed,
        )
    return prefix_repetition_requests(
        args.num_prompts,
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
        args.prefix_repetition_num_prefixes,
        args.prefix_repetition_output_len,
        vocab,
        args.seed,
    )


def _gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Waits between arrivals: gamma with shape ``burstiness`` and mean ``1 / rate``."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1 / (rate * burstiness)) for _ in range(n)]


async def _run_once(
    args: argparse.Namespace, backend: Backend, requests: list[BenchRequest], rate: float
) -> tuple[list[RequestOutput], float, float]:
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc=f"rate {rate:g}/s")

    async def one(req: BenchRequest) -> RequestOutput:
        async with limit:
            out = await backend.send(req, args.ignore_eos)
        bar.update(1)
        return out

    t0 = time.perf_counter()
    tasks = []
    for req, gap in zip(
        requests, _gaps(len(requests), rate, args.burstiness, args.seed), strict=True
    ):
        if req.arrival_s is not None:  # a trace's time, not the request rate's
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            gap = 0.0
        tasks.append(asyncio.create_task(one(req)))
        if gap:
            await asyncio.sleep(gap)
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return list(outputs), duration, t0


def _metrics_url(args: argparse.Namespace) -> str | None:
    """The server's metrics page: the OpenAI front's ``/metrics`` (none for the gRPC
    backend, whose address is not an HTTP server)."""
    if args.backend == "grpc":
        return None
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/") + "/metrics"


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _table(result: dict[str, Any], args: argparse.Namespace) -> str:
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Maximum request concurrency:", args.max_concurrency),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
    ]
    if "request_goodput" in result:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s):", f"{result['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests:", result["max_concurrent_requests"]),
        ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<44}{v!s:>16}" for k, v in rows]
    for m in args.percentile_metrics.split(","):
        lines.append("{s:{c}^60}".format(s=f" {titles[m]} ", c="-"))
        u = m.upper()
        lines.append(f"{f'Mean {u} (ms):':<44}{result[f'mean_{m}_ms']:>16.2f}")
        lines.append(f"{f'Median {u} (ms):':<44}{result[f'median_{m}_ms']:>16.2f}")
        for q in _percentiles(args):
            lines.append(f"{f'P{q:g} {u} (ms):':<44}{result[f'p{q:g}_{m}_ms']:>16.2f}")
    if "spec_decode_num_drafts" in result:
        lines.append("{s:{c}^60}".format(s=" Speculative Decoding ", c="-"))
        lines.append(
            f"{'Acceptance rate (%):':<44}{result['spec_decode_acceptance_rate'] * 100:>16.2f}"
        )
        lines.append(f"{'Acceptance length:':<44}{result['spec_decode_acceptance_length']:>16.2f}")
        lines.append(f"{'Drafts:':<44}{result['spec_decode_num_drafts']:>16}")
        lines.append(f"{'Draft tokens:':<44}{result['spec_decode_draft_tokens']:>16}")
        lines.append(f"{'Accepted tokens:':<44}{result['spec_decode_accepted_tokens']:>16}")
        rates = result["spec_decode_per_position_acceptance_rate"]
        lines.append(
            f"{'Per-position acceptance (%):':<44}{' '.join(f'{r * 100:.1f}' for r in rates):>16}"
        )
    lines += trace_replay.table_lines(result)
    lines.append("=" * 60)
    return "\n".join(lines)


def _percentiles(args: argparse.Namespace) -> list[float]:
    return [float(q) for q in args.metric_percentiles.split(",")]


def _record(
    args: argparse.Namespace,
    rate: float,
    outputs: list[RequestOutput],
    duration: float,
    t0: float,
) -> dict[str, Any]:
    result = summarize(
        outputs,
        duration,
        t0,
        percentile_metrics=args.percentile_metrics.split(","),
        percentiles=_percentiles(args),
        goodput=parse_goodput(args.goodput) if args.goodput else None,
    )
    ok = [o for o in outputs if o.success]
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **result,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in ok],
        "itls": [o.itl for o in ok],
        "errors": [o.error for o in outputs],
        "timeline": timeline(outputs, t0, duration),
        **trace_replay.hit_summary(outputs, getattr(args, "scaled_trace", None), args),
    }


def _plots(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pagedserve[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    last = records[-1]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, values) in zip(
        axes,
        [
            ("TTFT", [t * 1e3 for t in last["ttfts"]]),
            ("ITL", [g * 1e3 for i in last["itls"] for g in i]),
        ],
        strict=True,
    ):
        s = sorted(values)
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))] if s else [])
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / "latency_cdf.png"))
    line = last["timeline"]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(line["second"], line["output_tokens"], label="output tok/s")
    ax.set(xlabel="time (s)", ylabel="output tokens/s", title="Throughput and load over time")
    ax2 = ax.twinx()
    ax2.plot(line["second"], line["inflight"], color="tab:orange", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    fig.legend(loc="upper center", ncols=2)
    paths.append(_save(fig, out_dir / "throughput_timeline.png"))
    if len(records) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [r["output_throughput"] for r in records]
        for key, label in (("mean_ttft_ms", "mean TTFT"), ("median_tpot_ms", "median TPOT")):
            if key in last:
                ax.plot(x, [r[key] for r in records], marker="o", label=label)
        for r, xi in zip(records, x, strict=True):
            ax.annotate(f"{r['request_rate']}/s", (xi, r.get("mean_ttft_ms", 0)), fontsize=8)
        ax.set(xlabel="output tokens/s", ylabel="latency (ms)", title="Latency vs throughput")
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out_dir / "latency_throughput.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    backend: Backend
    if args.backend == "grpc":
        backend = GrpcBackend(args.address, args.api_key)
    else:
        api_url, models_url = openai_urls(args)
        backend = OpenAIBackend(api_url, models_url, args.model, args.api_key)
    try:
        if isinstance(backend, OpenAIBackend):
            await backend.resolve_model()
        requests = await _dataset(args, backend)
        rates = (
            [float(r) for r in args.sweep_request_rate.split(",")]
            if args.sweep_request_rate
            else [args.request_rate]
        )
        records = []
        metrics_url = _metrics_url(args)
        async with httpx.AsyncClient(timeout=10.0, headers=_auth(args)) as client:
            for rate in rates:
                before = await scrape(client, metrics_url) if metrics_url else None
                outputs, duration, t0 = await _run_once(args, backend, requests, rate)
                after = None
                if metrics_url and before is not None:
                    after = await scrape(client, metrics_url)
                record = _record(args, rate, outputs, duration, t0)
                record.update(spec_summary(before, after))
                print(_table(record, args), flush=True)
                records.append(record)
        return records
    finally:
        await backend.close()


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    # Read here, not as the flag's default: the generated flag reference must not show it.
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV)
    try:
        _check(args)
    except ValueError as exc:
        p.error(str(exc))
    try:
        records = asyncio.run(_main(args))
    except ModelListError as exc:
        p.exit(1, f"{p.prog}: error: {exc}\n")
    out_dir = Path(args.result_dir)
    if args.save_result or args.plot:
        out_dir.mkdir(parents=True, exist_ok=True)
    if args.save_result:
        name = (
            args.result_filename or f"{args.backend}-{args.dataset_name}-{records[0]['date']}.json"
        )
        body: Any = records[0] if len(records) == 1 else {"sweep": records}
        (out_dir / name).write_text(json.dumps(body, indent=1))
        print(f"results: {out_dir / name}")
    if args.plot:
        for path in _plots(records, out_dir):
            print(f"plot: {path}")
    return 0 if all(r["failed"] == 0 for r in records) else 1
