"""The served stack against the in-process engine, on the same requests, in one run.

The CPU bench's model (``bench.common.models.write_cpu_model``: a random Llama, hidden 512,
4 layers, fp32)
and the requests ``pagedserve bench serve --random-input-len 145 --random-range-ratio 0.75
--random-output-len 64 --num-prompts 64 --ignore-eos`` sends (the same seed, so the same
token ids and lengths), all at once:

- **in-process**: the engine of ``bench.engine_bench`` (no gRPC, no gateway, no block
  manager process), on every core;
- **stack**: ``pagedserve serve`` (block manager, executor and gateway, three processes on
  loopback) with each ``--variant``'s executor flags, driven by this process through
  ``pagedserve bench serve``'s gRPC client, one stream per request.

Each variant gets its own stack. After a warm-up run of each, ``--repeats`` runs alternate
between the two, so both see the same machine; the table gives medians: output tok/s, the
stack's share of the in-process figure, TTFT and TPOT, and the cores each process used
during the stack's runs (Linux ``/proc``; the client is this process).

    .venv/bin/python -m bench.stack_bench [--repeats 3] \\
        [--variant default=] [--variant "sync=--no-async-scheduling"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.engines import EngineSystem
from bench.common.models import write_cpu_model
from bench.common.serving import drive
from bench.common.workloads import Req
from bench.engine_bench import our_system, run_ours
from pagedserve.testing.procs import ROOT, free_ports, wait_serving
from services.bench.backends import GrpcBackend
from services.bench.datasets import BenchRequest, random_requests
from services.common.logging import configure_logging
from services.executor.api import available_cores

VOCAB = 621  # the tiny tokenizer's, as the gateway reports it


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=145)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.75)
    p.add_argument("--seed", type=int, default=0)  # pagedserve bench serve's default
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=EXECUTOR FLAGS for pagedserve serve (repeatable; default: default=)",
    )
    return p.parse_args(argv)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> dict[str, int]:
    """The services ``pagedserve serve`` started: name (its CLI subcommand) -> pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == pid and b"services.cli" in argv:
            found[argv[argv.index(b"services.cli") + 1].decode()] = int(entry.name)
    return found


class Stack:
    """``pagedserve serve`` on free loopback ports, with ``executor_flags`` after ``--``."""

    def __init__(self, model: Path, executor_flags: list[str]) -> None:
        port, exec_port, bm_port = free_ports(3)
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "services.cli", "serve", "--model", str(model)),
                *("--port", str(port), "--executor-port", str(exec_port)),
                *("--blockmgr-port", str(bm_port), "--metrics-port", "-1", "--http-port", "-1"),
                *("--log-level", "ERROR", "--", *executor_flags),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_serving(self.address, timeout=120)
        except BaseException:
            self.stop()
            raise
        self.services = _children(self.proc.pid)

    def cpu(self) -> dict[str, float]:
        return {name: _cpu_seconds(pid) for name, pid in self.services.items()}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _drive(address: str, requests: list[BenchRequest]) -> dict[str, object]:
    # The client is made in the loop that drives it: a grpc.aio channel made outside a
    # running loop is bound to another, and its first call fails ("attached to a different
    # loop").
    return await drive(GrpcBackend(address, None), requests)


def _stack_run(stack: Stack, requests: list[BenchRequest]) -> dict[str, float]:
    cpu0, client0, t0 = stack.cpu(), time.process_time(), time.perf_counter()
    result = asyncio.run(_drive(stack.address, requests))
    wall = time.perf_counter() - t0
    cpu1, client1 = stack.cpu(), time.process_time()
    cores = {f"{name} cores": (cpu1[name] - cpu0[name]) / wall for name in cpu0}
    return {
        "tok/s": float(result["output_throughput"]),  # type: ignore[arg-type]
        "TTFT ms": float(result["mean_ttft_ms"]),  # type: ignore[arg-type]
        "TPOT ms": float(result["mean_tpot_ms"]),  # type: ignore[arg-type]
        **cores,
        "client cores": (client1 - client0) / wall,
    }


def _engine_run(system: EngineSystem, reqs: list[Req]) -> float:
    t0 = time.perf_counter()
    res = run_ours(system, [reqs], pad_to_batch_max=False)
    wall = time.perf_counter() - t0
    return sum(len(t) for t in res.outputs.values()) / wall


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("stack_bench", "ERROR")
    variants = [v.split("=", 1) for v in args.variant or ["default="]]
    if any(len(v) != 2 for v in variants):
        raise SystemExit("--variant takes NAME=EXECUTOR FLAGS")
    requests = random_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, VOCAB, args.seed
    )
    reqs = [Req(f"r{i}", list(r.prompt), r.output_len) for i, r in enumerate(requests)]
    threads = available_cores()
    with tempfile.TemporaryDirectory(prefix="stack_bench_") as tmp:
        model = write_cpu_model(Path(tmp) / "model")
        system = our_system(str(model), 512, 4096, 256, None, cpu_threads=threads)
        print(
            f"# Stack against in-process: {args.num_prompts} requests at once, prompts "
            f"{min(r.prompt_len for r in requests)}-{max(r.prompt_len for r in requests)}, "
            f"outputs {min(r.output_len for r in requests)}-"
            f"{max(r.output_len for r in requests)} tokens (ignore_eos), greedy; "
            f"{threads} cores; medians of {args.repeats} alternating runs\n"
        )
        rows = []
        for name, flags in variants:
            stack = Stack(model, flags.split())
            try:
                _engine_run(system, reqs), _stack_run(stack, requests)  # warm-up
                engine, served = [], []
                for _ in range(args.repeats):
                    engine.append(_engine_run(system, reqs))
                    served.append(_stack_run(stack, requests))
            finally:
                stack.stop()
            med = {k: statistics.median(s[k] for s in served) for k in served[0]}
            rows.append((name, flags, statistics.median(engine), med))
        keys = [k for k in rows[0][3] if k.endswith("cores")]
        print(
            "| variant | executor flags | in-process tok/s | stack tok/s | stack / in-process "
            "| TTFT ms | TPOT ms | " + " | ".join(keys) + " |"
        )
        print("|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(keys))
        for name, flags, engine_rate, m in rows:
            print(
                f"| {name} | `{flags or '(none)'}` | {engine_rate:.0f} | {m['tok/s']:.0f} | "
                f"{m['tok/s'] / engine_rate:.0%} | {m['TTFT ms']:.0f} | {m['TPOT ms']:.1f} | "
                + " | ".join(f"{m[k]:.2f}" for k in keys)
                + " |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
