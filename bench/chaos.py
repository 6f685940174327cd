"""Chaos run of the whole stack: streams under load while each service is killed in turn.

    .venv/bin/python bench/chaos.py [--streams 64] [--max-tokens 48] [--soak-s 600]

The three services run as processes on loopback with an internal token, like `pagedserve
serve`. First a fault-free round of ``--streams`` concurrent greedy streams (ignore_eos)
gives the reference outputs. Then, for each service: the same streams start, the service is
killed with SIGKILL ``--kill-after-s`` in and started again on its port, and each stream is
compared with the reference (identical, or failed with which status); "serving again" is
the time from the restart until the gateway is SERVING. Last, a soak of ``--soak-s`` seconds
of streams with 30% cancelled early and random deadlines. Reported: streams identical to the
fault-free run, streams failed (by status), KV blocks still in use once idle, time to serve
again, and each process's RSS growth over the soak. Prints markdown. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.v1 import generation_pb2 as G  # noqa: E402
from pagedserve.v1 import generation_pb2_grpc  # noqa: E402
from services.blockmgr.client import GrpcClient  # noqa: E402
from services.common.healthcheck import check  # noqa: E402

TOKEN = "chaos-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def run_streams(address: str, texts: list[str], max_tokens: int) -> list[object]:
    """Every text as its own greedy stream, all at once: token ids, or the failing status."""
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    out: list[object] = [None] * len(texts)

    def one(i: int) -> None:
        req = G.GenerateRequest(
            prompt=texts[i],
            sampling_params=G.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        )
        try:
            out[i] = [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]
        except grpc.RpcError as exc:
            out[i] = exc.code().name

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


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
    ap.add_argument("--streams", type=int, default=64)
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
    bm_port, ex_port, gw_port = free_port(), free_port(), free_port()
    services = {
        "blockmgr": Service("blockmgr", ["--port", str(bm_port)], bm_port, tmp),
        "executor": Service(
            "executor",
            [
                "--model",
                model,
                "--port",
                str(ex_port),
                "--blockmgr-address",
                f"127.0.0.1:{bm_port}",
                "--pool-id",
                "chaos",
                *args.executor_arg,
            ],
            ex_port,
            tmp,
        ),
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
                "-1",
                "--http-port",
                "0",
                "--executor",
                f"127.0.0.1:{ex_port}",
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
        reference = run_streams(gw.address, texts, args.max_tokens)
        assert all(isinstance(r, list) for r in reference), Counter(map(str, reference))
        for name, victim in services.items():
            results: list[object] = []
            t = threading.Thread(
                target=lambda out=results: out.extend(
                    run_streams(gw.address, texts, args.max_tokens)
                )
            )
            t.start()
            time.sleep(args.kill_after_s)
            victim.kill()
            victim.start()
            back = time.monotonic()
            gw.wait_serving()
            healed = time.monotonic() - back
            t.join()
            same = sum(r == ref for r, ref in zip(results, reference, strict=True))
            failed = Counter(r for r in results if isinstance(r, str))
            time.sleep(1.0)
            rows.append(
                (
                    f"kill -9 {name}",
                    same,
                    dict(failed),
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
    print(
        f"\n{args.streams} greedy streams of {args.max_tokens} tokens (ignore_eos), "
        f"compared with a fault-free run:\n"
    )
    print(
        "| fault | streams identical | streams failed (status) | blocks in use after | "
        "serving again after restart |\n|---|---:|---|---:|---:|"
    )
    for fault, same, failed, blocks, healed in rows:
        shown = ", ".join(f"{k} {v}" for k, v in failed.items()) or "none"
        print(f"| {fault} | {same}/{args.streams} | {shown} | {blocks} | {healed} |")
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
