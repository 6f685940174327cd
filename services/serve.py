"""``pagedserve serve``: the whole stack on one machine, as three supervised processes.

blockmgr, executor and gateway talk gRPC on loopback, exactly as in a multi-host deployment,
authenticated by an internal token made up here. A child that dies is restarted alone, after
a back-off that doubles (0.5 s up to 8 s) while it keeps dying; the others heal by themselves
(the executor restores a restarted block manager, the gateway reconnects to a restarted
executor). When a child has used up ``--max-restarts`` within ``--restart-window-s``, the
supervisor says so, stops the others and exits 1. The children die with the supervisor, even
when it is killed (Linux: ``PR_SET_PDEATHSIG``). SIGTERM / Ctrl-C stops all three gracefully.
"""

from __future__ import annotations

import argparse
import ctypes
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
PR_SET_PDEATHSIG = 1


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
    p.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API; -1 disables"
    )
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one service within --restart-window-s before giving up",
    )
    p.add_argument("--restart-window-s", type=float, default=300.0)
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
            "--http-port",
            str(args.http_port),
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

    def start(name: str) -> None:
        procs[name] = subprocess.Popen(specs[name], env=env, preexec_fn=_die_with_parent)
        log.info("service_started", name=name, pid=procs[name].pid)

    for name in specs:  # blockmgr, executor, gateway: each heals when the one before it is up
        start(name)
    log.info("stack_starting", gateway=f"{args.host}:{args.port}", model=str(model))

    restarts: dict[str, list[float]] = {name: [] for name in specs}
    due: dict[str, float] = {}  # dead service -> when to restart it
    code = 0
    while not stopping:
        now = time.monotonic()
        for name, p in procs.items():
            if name in due or p.poll() is None:
                continue
            recent = [t for t in restarts[name] if now - t < args.restart_window_s]
            restarts[name] = recent
            if len(recent) >= args.max_restarts:
                log.error(
                    "service_gave_up",
                    name=name,
                    status=p.returncode,
                    restarts=len(recent),
                    window_s=args.restart_window_s,
                )
                code = 1
                stopping = True
                break
            delay = min(0.5 * 2 ** len(recent), 8.0)
            log.error("service_died", name=name, status=p.returncode, restart_in_s=delay)
            due[name] = now + delay
        for name, when in list(due.items()):
            if now >= when and not stopping:
                del due[name]
                restarts[name].append(now)
                start(name)
                log.info("service_restarted", name=name, restarts=len(restarts[name]))
        time.sleep(0.1)
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


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the supervisor dies (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
