"""SMG (the SGLang / vLLM model gateway) routing two pagedserve executors over their
``vllm.grpc.engine`` service, with no change to SMG: prefix-aware (``cache_aware``) against
``round_robin`` on the same requests.

Two executors (the tiny Llama, fp32, each its own in-process block manager) and one SMG
router (``smg launch --backend vllm --worker-urls grpc://...``, the tokenizer from the
checkpoint) are started per policy. ``--groups`` groups of ``--per-group`` completions are
sent one at a time; the requests of a group share a ``--prefix-words``-word prefix. Printed per
policy: requests that succeeded, and each executor's prefix-cache hit rate and requests served
(its ``GetLoads`` and ``GetServerInfo``; the hit rate is cached / prompt tokens).

Needs an ``smg`` executable (``pip install smg`` in a separate virtual environment, or
``--smg PATH``); without one it prints why and exits 0.

    .venv/bin/python -m bench.smg_routing [--smg PATH] [--groups 4] [--per-group 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from pagedserve.testing.procs import ServiceProcess, cpu_executor_args, free_ports
from pagedserve.tools.tiny_model import write_tiny_model


def _router(
    smg: str, model: Path, policy: str, workers: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    (port,) = free_ports(1)
    args = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--model-path", str(model), "--backend", "vllm",
            "--worker-urls", *[f"grpc://{w}" for w in workers]]  # fmt: skip
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/v1/models", timeout=2)  # (healthy before its workers are)
            if r.status_code == 200 and r.json().get("data"):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    _stop(proc)
    raise RuntimeError(f"smg did not serve within 120 s ({' '.join(args)})")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _hit_rate(address: str) -> float:
    """The executor's prefix-cache hit rate so far (cached / prompt tokens)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VllmEngineStub(channel)
        return stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0].cache_hit_rate


def run(smg: str, model: Path, policy: str, args: argparse.Namespace) -> str:
    executors = [ServiceProcess(cpu_executor_args(model), "executor_ready") for _ in range(2)]
    try:
        router, url = _router(smg, model, policy, [e.address for e in executors])
        ok = 0
        try:
            for g in range(args.groups):
                prefix = " ".join(f"topic{g}word{i}" for i in range(args.prefix_words))
                for i in range(args.per_group):
                    body = {"model": model.name, "prompt": f"{prefix} question {i}",
                            "max_tokens": 4, "temperature": 0}  # fmt: skip
                    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                    ok += r.status_code == 200
                    if r.status_code != 200 and not ok:
                        print(f"{policy}: HTTP {r.status_code}: {r.text[:300]}", file=sys.stderr)
        finally:
            _stop(router)
        rates = [_hit_rate(e.address) for e in executors]
    finally:
        for e in executors:
            e.stop()
    served = [e.events().count("smg_request") for e in executors]
    subscribed = sum(e.events().count("smg_kv_events_subscribed") for e in executors)
    total = args.groups * args.per_group
    cells = " | ".join(f"{r:.0%} / {n}" for r, n in zip(rates, served, strict=True))
    return f"| {policy} | {ok}/{total} | {cells} | {subscribed} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smg", default=shutil.which("smg"), help="the smg executable")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=4)
    p.add_argument("--prefix-words", type=int, default=25)
    p.add_argument("--policies", default="cache_aware,round_robin")
    args = p.parse_args(argv)
    if not args.smg or not Path(args.smg).exists():
        print("skipped: no smg executable (pip install smg in another venv; --smg PATH)")
        return 0
    with tempfile.TemporaryDirectory(prefix="smg_routing_") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-llama")
        print(
            f"# SMG ({args.smg}) over two executors: {args.groups} groups of "
            f"{args.per_group} completions sharing a {args.prefix_words}-word prefix\n"
        )
        print(
            "| policy | succeeded | executor 1: hit rate / requests | executor 2 "
            "| KV-event subscriptions |"
        )
        print("|---|---:|---:|---:|---:|")
        for policy in args.policies.split(","):
            print(run(args.smg, model, policy, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
