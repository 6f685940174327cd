"""``pagedserve serve``: the whole stack on one machine, as three supervised processes.

blockmgr, executor and gateway talk gRPC on loopback, exactly as in a multi-host deployment.
If any of them dies, the supervisor says which and with what status, stops the others and
exits non-zero; SIGTERM / Ctrl-C stops all three gracefully.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.common.auth import INTERNAL_TOKEN_ENV
from services.common.logging import configure_logging

DEFAULT_MODEL = Path("models/tiny-llama")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve serve",
        description="Run blockmgr + executor + gateway as three processes on loopback. "
        "Executor flags not listed here can follow `--`.",
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"checkpoint directory (default {DEFAULT_MODEL}, written if absent)",
    )
    p.add_argument("--port", type=int, default=50051, help="public gateway port")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--executor-port", type=int, default=50061)
    p.add_argument("--blockmgr-port", type=int, default=50052)
    p.add_argument("--metrics-port", type=int, default=9090, help="-1 disables")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "executor_args",
        nargs=argparse.REMAINDER,
        help="extra executor flags after `--` (e.g. -- --max-num-seqs 64)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("serve", args.log_level)
    model = Path(args.model) if args.model else DEFAULT_MODEL
    if args.model is None and not (model / "config.json").is_file():
        from pagedserve.tools.tiny_model import write_tiny_model

        log.info("writing_default_model", path=str(model))
        write_tiny_model(model)
    extra = [a for a in args.executor_args if a != "--"]
    py = [sys.executable, "-m", "services.cli"]
    common = ["--log-level", args.log_level]
    specs = {
        "blockmgr": [*py, "blockmgr", "--port", str(args.blockmgr_port), *common],
        "executor": [
            *py,
            "executor",
            "--model",
            str(model),
            "--port",
            str(args.executor_port),
            "--blockmgr-address",
            f"127.0.0.1:{args.blockmgr_port}",
            *common,
            *extra,
        ],
        "gateway": [
            *py,
            "gateway",
            "--model",
            str(model),
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--metrics-port",
            str(args.metrics_port),
            "--executor",
            f"127.0.0.1:{args.executor_port}",
            *common,
            *(["--api-key", args.api_key] if args.api_key else []),
        ],
    }
    # One internal token for the three services, unless the caller set one: no other local
    # process can then drive the executor or the block manager through their ports.
    env = dict(os.environ)
    env.setdefault(INTERNAL_TOKEN_ENV, secrets.token_urlsafe(32))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    for name, cmd in specs.items():
        procs[name] = subprocess.Popen(cmd, env=env)
        log.info("service_started", name=name, pid=procs[name].pid)
    log.info("stack_starting", gateway=f"{args.host}:{args.port}", model=str(model))

    code = 0
    while not stopping:
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            for name, status in dead.items():
                log.error("service_died", name=name, status=status)
            code = 1
            break
        time.sleep(0.2)
    for name in ("gateway", "executor", "blockmgr"):  # front to back
        p = procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for name, p in procs.items():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("service_killed", name=name)
            p.kill()
            p.wait()
    log.info("stack_stopped", status=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
