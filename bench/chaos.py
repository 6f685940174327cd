"""Chaos run of the whole stack: streams under load while each service is killed in turn.

    .venv/bin/python -m bench.chaos [--streams 32] [--max-tokens 128] [--executors 2]
        [--seeded] [--soak-s 600]

The services run as processes on loopback with an internal token, like `pagedserve serve`:
a block manager, ``--executors`` executors (each its own pool) and a gateway over them.
First a fault-free round of ``--streams`` concurrent streams (ignore_eos; greedy, or with
``--seeded`` temperature 0.8 and a seed per stream) gives the reference outputs. Then, for
each service: the same streams start, the service (the first executor, for executors) is
killed with SIGKILL ``--kill-after-s`` in and started again on its port, and each stream is
compared with the reference (identical, or failed with which status); "serving again" is
the time from the restart until the gateway is SERVING, "resumed" the streams the gateway
carried on after losing their executor, "longest stall" the longest wait between two
messages of one stream (client side). Last, a soak of ``--soak-s`` seconds of streams with
30% cancelled early and random deadlines. Reported: the above, KV blocks still in use once
idle, and each process's RSS growth over the soak. Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from pagedserve.testing.procs import ROOT, free_ports
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc
from services.blockmgr.client import GrpcClient
from services.common.healthcheck import check

TOKEN = "chaos-token"


class Service:
    def __init__(self, name: str, args: list[str], port: int, log_dir: Path) -> None:
        self.name, self.args, self.port, self.log_dir = name, args, port, log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"{self.name}-{self.starts}.log", "wb")  # noqa: SIM115
        env = {**os.environ, "PAGEDSERVE_INTERNAL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", self.name, *self.args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
        )

    def wait_serving(self, timeout: float = 120) -> float:
        t0 = time.monotonic()
        while not check(self.address, timeout=1.0)[0]:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{self.name} never became SERVING")
            time.sleep(0.05)
        return time.monotonic() - t0

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    words = [
        "paged",
        "attention",
        "serves",
        "many",
        "requests",
        "at",
        "once",
        "with",
        "blocks",
        "of",
        "cache",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(n)]


def run_streams(
    address: str, texts: list[str], max_tokens: int, seeded: bool = False
) -> tuple[list[object], float]:
    """Every text as its own stream, all at once (greedy; ``seeded``: temperature 0.8 with
    seed i for stream i): token ids, or the failing status, per stream; and the longest
    wait between two messages of one stream, in seconds."""
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    out: list[object] = [None] * len(texts)
    stalls = [0.0] * len(texts)

    def one(i: int) -> None:
        params = G.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if seeded:
            params.temperature, params.seed = 0.8, i
        req = G.GenerateRequest(prompt=texts[i], sampling_params=params)
        tokens: list[int] = []
        last = None
        try:
            for r in stub.Generate(req, timeout=120):
                now = time.monotonic()
                if last is not None:
                    stalls[i] = max(stalls[i], now - last)
                last = now
                tokens += r.token_ids
            out[i] = tokens
        except grpc.RpcError as exc:
            out[i] = exc.code().name

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, max(stalls)


def resumed_total(metrics_port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    return sum(
        float(line.split()[-1])
        for line in body.decode().splitlines()
        if line.startswith("pagedserve_requests_resumed_total{")
    )


def blocks_in_use(blockmgr: Service) -> int:
    client = GrpcClient(blockmgr.address, internal_token=TOKEN)
    try:
        return sum(client.stats(p.pool_id).counters.num_in_use_blocks for p in client.info().pools)
    finally:
        client.close()


def soak(address: str, seconds: float, texts: list[str]) -> Counter[str]:
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    rng = random.Random(1)
    outcomes: Counter[str] = Counter()
    stop = time.monotonic() + seconds

    def worker(seed: int) -> None:
        r = random.Random(seed)
        while time.monotonic() < stop:
            req = G.GenerateRequest(
                prompt=r.choice(texts),
                sampling_params=G.SamplingParams(
                    max_tokens=r.randint(4, 64), temperature=r.choice([0.0, 0.8])
                ),
            )
            timeout = r.choice([0.2, 0.5, 2.0, 30.0])
            try:
                call = stub.Generate(req, timeout=timeout)
                for i, _ in enumerate(call):
                    if r.random() < 0.3 and i == 2:
                        call.cancel()
                        break
                outcomes["ok"] += 1
            except grpc.RpcError as exc:
                outcomes[exc.code().name] += 1

    threads = [threading.Thread(target=worker, args=(rng.random(),)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--executors", type=int, default=1, choices=(1, 2))
    ap.add_argument("--seeded", action="store_true", help="temperature 0.8, seed i for stream i")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--kill-after-s",
        type=float,
        default=0.3,
        help="the victim is killed this long after the streams start",
    )
    ap.add_argument("--soak-s", type=float, default=600)
    ap.add_argument("--model", default=None, help="checkpoint (default: a tiny one, written)")
    ap.add_argument(
        "--executor-arg",
        action="append",
        default=[],
        help="an extra executor flag (repeatable), e.g. --executor-arg=--async-scheduling",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    model = args.model
    if model is None:
        from pagedserve.tools.tiny_model import write_tiny_model

        model = str(write_tiny_model(tmp / "model"))
    bm_port, gw_port, metrics_port, *ex_ports = free_ports(3 + args.executors)
    executors = {
        f"executor{'' if i == 0 else i + 1}": Service(
            "executor",
            [
                "--model",
                model,
                "--port",
                str(port),
                "--blockmgr-address",
                f"127.0.0.1:{bm_port}",
                "--pool-id",
                f"chaos{i}",
                *args.executor_arg,
            ],
            port,
            tmp,
        )
        for i, port in enumerate(ex_ports)
    }
    services = {
        "blockmgr": Service("blockmgr", ["--port", str(bm_port)], bm_port, tmp),
        **executors,
        "gateway": Service(
            "gateway",
            [
                "--model",
                model,
                "--port",
                str(gw_port),
                "--host",
                "127.0.0.1",
                "--metrics-port",
                str(metrics_port),
                "--http-port",
                "0",
                *(a for port in ex_ports for a in ("--executor", f"127.0.0.1:{port}")),
            ],
            gw_port,
            tmp,
        ),
    }
    rows = []
    try:
        for s in services.values():
            s.start()
            s.wait_serving()
        gw = services["gateway"]
        texts = prompts(args.streams)
        reference, _ = run_streams(gw.address, texts, args.max_tokens, args.seeded)
        assert all(isinstance(r, list) for r in reference), Counter(map(str, reference))
        for name, victim in services.items():
            if name.startswith("executor") and name != "executor":
                continue  # one executor is killed; the others carry its streams
            results: list[object] = []
            stall: list[float] = []
            # (a restarted gateway counts from 0)
            resumed_before = 0.0 if name == "gateway" else resumed_total(metrics_port)

            def stream(out: list[object] = results, longest: list[float] = stall) -> None:
                got, worst = run_streams(gw.address, texts, args.max_tokens, args.seeded)
                out.extend(got)
                longest.append(worst)

            t = threading.Thread(target=stream)
            t.start()
            time.sleep(args.kill_after_s)
            victim.kill()
            victim.start()
            back = time.monotonic()
            gw.wait_serving()
            healed = time.monotonic() - back
            t.join()
            victim.wait_serving()  # (with two executors the gateway never stopped serving)
            same = sum(r == ref for r, ref in zip(results, reference, strict=True))
            failed = Counter(r for r in results if isinstance(r, str))
            time.sleep(1.0)
            rows.append(
                (
                    f"kill -9 {name}",
                    same,
                    dict(failed),
                    int(resumed_total(metrics_port) - resumed_before),
                    f"{stall[0]:.2f} s",
                    blocks_in_use(services["blockmgr"]),
                    f"{healed:.2f} s",
                )
            )
            print(f"{rows[-1]}", flush=True)
        rss0 = {n: s.rss_mb() for n, s in services.items()}
        outcomes = soak(gw.address, args.soak_s, texts) if args.soak_s > 0 else Counter()
        time.sleep(2.0)
        rss1 = {n: s.rss_mb() for n, s in services.items()}
        leaked = blocks_in_use(services["blockmgr"])
    finally:
        for s in reversed(list(services.values())):
            s.stop()
    kind = "seeded (temperature 0.8)" if args.seeded else "greedy"
    print(
        f"\n{args.streams} {kind} streams of {args.max_tokens} tokens (ignore_eos), "
        f"{args.executors} executor(s), compared with a fault-free run:\n"
    )
    print(
        "| fault | streams identical | streams failed (status) | streams resumed | "
        "longest stall | blocks in use after | serving again after restart |\n"
        "|---|---:|---|---:|---:|---:|---:|"
    )
    for fault, same, failed, resumed, stall, blocks, healed in rows:
        shown = ", ".join(f"{k} {v}" for k, v in failed.items()) or "none"
        print(
            f"| {fault} | {same}/{args.streams} | {shown} | {resumed} | {stall} | {blocks} "
            f"| {healed} |"
        )
    print(
        f"\nsoak, {args.soak_s:.0f} s, 16 clients, 30% cancelled, random deadlines: "
        f"{json.dumps(dict(outcomes))}; blocks in use after: {leaked}"
    )
    print(
        "RSS MB before / after the soak: "
        + ", ".join(f"{n} {rss0[n]:.0f} / {rss1[n]:.0f}" for n in services)
    )


if __name__ == "__main__":
    main()
