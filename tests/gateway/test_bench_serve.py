"""``pagedserve bench serve`` against the real stack, over each backend: every JSON field is
there and consistent with what was streamed, and the plots are real PNGs."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from PIL import Image

from bench.stack_bench import _drive
from pagedserve.testing.procs import wait_serving
from services.bench.datasets import BenchRequest
from services.bench.results import parse_goodput
from services.bench.serve import main
from tests.gateway.conftest import Stack

API_KEY = "bench-key-0123456789"

SUMMARY_FIELDS = [
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "request_goodput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")),
]


def _run(stack: Stack, tmp_path: Path, backend: str, *extra: str) -> dict:
    """A small benchmark of ``stack`` over ``backend`` that must succeed; its JSON result."""
    target = (
        ["--address", stack.gateway.address]
        if backend == "grpc"
        else ["--base-url", f"http://127.0.0.1:{stack.http_port}"]  # the root, as in vLLM
    )
    argv = [
        "--backend",
        backend,
        *target,
        "--tokenizer",
        str(stack.model_dir),
        "--num-prompts",
        "12",
        "--random-input-len",
        "24",
        "--random-output-len",
        "6",
        "--random-range-ratio",
        "0.5",
        "--request-rate",
        "40",
        "--max-concurrency",
        "4",
        "--ignore-eos",
        "--goodput",
        "ttft:60000",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "out.json",
        "--disable-tqdm",
        *extra,
    ]
    assert main(argv) == 0
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_a_small_run_reports_every_field_consistently(stack, tmp_path, backend) -> None:
    r = _run(stack, tmp_path, backend)
    for name in SUMMARY_FIELDS:
        assert name in r, name
    assert r["completed"] + r["failed"] == r["num_prompts"] == 12
    assert r["failed"] == 0 and not any(r["errors"])
    # ignore_eos: every request streamed exactly what it asked for, and the totals add up.
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert sum(r["timeline"]["output_tokens"]) == r["total_output_tokens"]
    assert r["total_input_tokens"] == sum(r["input_lens"])
    assert all(12 <= n <= 36 for n in r["input_lens"])  # 24 +- 50%
    assert 1 <= r["max_concurrent_requests"] <= 4  # --max-concurrency
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s TTFT SLO
    assert r["median_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert len(r["ttfts"]) == len(r["itls"]) == 12


def test_plots_and_a_rate_sweep_are_written(stack, tmp_path) -> None:
    argv_extra = ("--plot", "--sweep-request-rate", "20,inf")
    body = _run(stack, tmp_path, "grpc", *argv_extra)
    assert [r["request_rate"] for r in body["sweep"]] == [20.0, "inf"]
    for name in ("latency_cdf.png", "throughput_timeline.png", "latency_throughput.png"):
        with Image.open(tmp_path / name) as img:
            img.verify()
            assert img.format == "PNG"


def test_goodput_slos_are_parsed_and_checked() -> None:
    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(["itl:5"])


def _small_openai_run(tmp_path: Path, *target: str) -> int:
    """Four requests over ``--backend openai`` at ``target``; main's exit status."""
    return main(
        [
            "--backend",
            "openai",
            *target,
            "--random-input-len",
            "8",
            "--random-output-len",
            "2",
            "--num-prompts",
            "4",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "out.json",
            "--disable-tqdm",
        ]
    )


def test_openai_backend_takes_host_port_and_endpoint_and_sends_openai_api_key(
    stack, tmp_path, monkeypatch, capsys
) -> None:
    """As ``vllm bench serve``: no --base-url means http://--host:--port, --endpoint
    defaults to /v1/completions, the model comes from /v1/models, and OPENAI_API_KEY is the
    bearer token."""
    gateway = stack.start_gateway("--api-key", API_KEY)
    try:
        wait_serving(gateway.address)
        port = gateway.wait_for_event("http_listening")["http_port"]
        target = ["--host", "127.0.0.1", "--port", str(port), "--tokenizer", str(stack.model_dir)]
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        with pytest.raises(SystemExit) as refused:  # without the key: no model list
            _small_openai_run(tmp_path, *target)
        assert refused.value.code == 1
        assert "401" in capsys.readouterr().err
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
        assert _small_openai_run(tmp_path, *target) == 0
        result = json.loads((tmp_path / "out.json").read_text())
        assert result["completed"] == 4 and not any(result["errors"])
    finally:
        gateway.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--base-url", "http://127.0.0.1:8000/v1"], "--base-url is the server root"),
        (["--endpoint", "/v1/chat/completions"], "not chat completions"),
        (["--endpoint", "/v1/models"], "--endpoint must be a path such as /v1/completions"),
    ],
    ids=["base-url-ending-in-v1", "chat-endpoint", "not-a-completions-endpoint"],
)
def test_openai_urls_that_cannot_work_are_refused_before_sending(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--backend", "openai", "--model", "m", *flags])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


def _mooncake_trace(path: Path, num: int) -> Path:
    """A Mooncake-format trace of sessions whose turns extend their previous prompt: 512-token
    blocks, scaled by 1/32 to 16-token ones (one of the executor's blocks each)."""
    rng = random.Random(5)
    sessions: list[list[int]] = []
    next_id, lines = 0, []
    for i in range(num):
        if sessions and rng.random() < 0.6:
            s = rng.randrange(len(sessions))
            sessions[s] = hashes = sessions[s] + list(range(next_id, next_id + 2))
        else:
            hashes = list(range(next_id, next_id + rng.randint(1, 3)))
            sessions.append(hashes)
        next_id = max(next_id, max(hashes) + 1)
        length = (len(hashes) - 1) * 512 + rng.randint(1, 512)
        lines.append(
            {"timestamp": i, "input_length": length, "output_length": 64, "hash_ids": hashes}
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_a_trace_replayed_live_hits_what_offline_replay_predicts(stack, tmp_path, backend):
    """One request at a time, a working set well inside the executor's 255 blocks: the
    served prefix-hit ratio equals the offline replay's under the engine's rules. (A seed
    per backend: the shared stack's cache must not hold the other run's blocks.)"""
    trace = _mooncake_trace(tmp_path / "trace.jsonl", 30)
    r = _run(
        stack,
        tmp_path,
        backend,
        "--dataset-name",
        "mooncake",
        "--dataset-path",
        str(trace),
        "--num-prompts",
        "30",
        "--max-concurrency",
        "1",
        "--trace-time-scale",
        "1000",
        "--replay-capacity",
        "255b",
        "--seed",
        str(11 if backend == "grpc" else 12),
    )
    assert r["failed"] == 0 and r["completed"] == 30
    assert r["output_lens"] == [2] * 30  # 64 tokens scaled by 1/32
    assert r["prefix_hit_ratio"] > 0.2
    assert r["prefix_hit_ratio"] == pytest.approx(r["offline_prefix_hit_ratio"], abs=1e-9)


def test_a_300_request_live_replay_with_requests_in_flight_is_within_two_points_of_offline(
    stack, tmp_path
):
    """Eight in flight, through a cache of 255 blocks that the trace's working set outgrows
    (evictions live and offline): the served ratio stays within 2 points of the sequential
    prediction (prefixes still being computed, and eviction order, account for the rest)."""
    trace = _mooncake_trace(tmp_path / "trace.jsonl", 300)
    r = _run(
        stack,
        tmp_path,
        "grpc",
        "--dataset-name",
        "mooncake",
        "--dataset-path",
        str(trace),
        "--num-prompts",
        "300",
        "--max-concurrency",
        "8",
        "--trace-time-scale",
        "1000",
        "--replay-capacity",
        "255b",
        "--seed",
        "13",
    )
    assert r["failed"] == 0 and r["completed"] == 300
    assert r["prefix_hit_ratio"] > 0.2
    assert abs(r["prefix_hit_ratio"] - r["offline_prefix_hit_ratio"]) <= 0.02, (
        r["prefix_hit_ratio"],
        r["offline_prefix_hit_ratio"],
    )


def test_stack_bench_drives_the_stack_from_its_own_event_loop(stack: Stack) -> None:
    """``bench.stack_bench`` makes its gRPC client inside the loop that drives it (made
    before ``asyncio.run``, the client's first call failed: "attached to a different
    loop"): twice in a row, as its repeats do, every request completes."""
    requests = [BenchRequest([20 + i, 30, 40 + i], 3, 4) for i in range(3)]
    for _ in range(2):
        result = asyncio.run(_drive(stack.gateway.address, requests))
        assert result["completed"] == 3 and result["total_output_tokens"] == 12
