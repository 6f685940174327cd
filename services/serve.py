"""``pagedserve serve``: the whole stack on one machine, as three supervised processes.

blockmgr, executor and gateway talk gRPC on loopback, exactly as in a multi-host deployment,
authenticated by an internal token made up here. A child that dies is restarted alone, after
a back-off that doubles (0.5 s up to 8 s) while it keeps dying; the others heal by themselves
(the executor restores a restarted block manager, the gateway reconnects to a restarted
executor). When a child has used up ``--max-restarts`` within ``--restart-window-s``, the
supervisor says so, stops the others and exits 1. A child that exits 2
(:data:`~services.common.logging.CONFIG_ERROR_STATUS`: its configuration cannot work, e.g. a
model whose attention heads ``--tensor-parallel-size`` does not divide) is not restarted:
the supervisor logs its reason, stops the others and exits 2. A port another process holds is
one: the supervisor checks its ports before starting anything (one ``config_error`` line
naming the port and the ``serve`` flag that sets it, e.g. ``--blockmgr-port``), and a child
that finds its port taken later exits 2 (its reason is then told with the ``serve`` flag).

The children copy their stderr through the supervisor's (which keeps their last lines to tell
why one exited) and run in their own process groups, so a Ctrl-C in the terminal reaches only
the supervisor, which stops them front to back, each after the one before has exited: the
gateway (its streams drain), the executor (it gives its pool back to the block manager), the
block manager. A second SIGTERM / Ctrl-C kills what is left. The children die with the
supervisor, even when it is killed (Linux: ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import structlog

from services.common.auth import API_KEY_ENV, INTERNAL_TOKEN_ENV
from services.common.errors import ConfigError
from services.common.logging import CONFIG_ERROR_STATUS, config_error, configure_logging
from services.common.ports import check_ports
from services.executor.model.runner_config import available_cores
from services.gateway.text.reasoning_parsers import PARSERS as REASONING_PARSERS
from services.gateway.text.tool_parsers import PARSERS as TOOL_CALL_PARSERS

DEFAULT_MODEL = Path("models/tiny-llama")
PR_SET_PDEATHSIG = 1
STOP_ORDER = ("gateway", "executor", "blockmgr")  # front to back: each one's clients first
# How long each child may take to stop after SIGTERM before it is killed: the gateway drains
# its streams (--drain-timeout-s, 30 s by default), the executor has a 5 s grace period and
# then stops its engine, the block manager has a 5 s grace period.
STOP_TIMEOUT_S = {"gateway": 40.0, "executor": 20.0, "blockmgr": 10.0}
TAIL_LINES = 50  # stderr lines kept per child to find why it exited
LOOPBACK = "127.0.0.1"  # where the block manager and the executor listen
# The serve flag that sets each child's port flag: a child's configuration error naming its
# own flag (the block manager's ``--port``) is told with the flag the user gave.
PORT_FLAGS: dict[str, dict[str, str]] = {
    "blockmgr": {"--port": "--blockmgr-port"},
    "executor": {"--port": "--executor-port"},
    "gateway": {flag: flag for flag in ("--port", "--http-port", "--metrics-port")},
}
_stderr_lock = threading.Lock()


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


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
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV))
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='the gateway\'s: chat tool_choice "auto", read by --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="the gateway's: the model family's tool-call format",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="the gateway's: puts a thinking model's reasoning apart (reasoning_content)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="the gateway's: load and unload LoRA adapters at runtime (the executor's "
        "--enable-lora and --lora-modules go after `--`)",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one service within --restart-window-s before giving up",
    )
    p.add_argument("--restart-window-s", type=float, default=300.0)
    p.add_argument(
        "--cpu-reserved-cores",
        type=_non_negative,
        default=1,
        help="cores left to the gateway, the block manager and local clients during the "
        "executor's small steps (a small model's decode steps), which compute on the others; "
        "its other steps use every core (its --cpu-decode-threads and --cpu-threads; not when "
        "OMP_NUM_THREADS is set)",
    )
    p.add_argument(
        "executor_args",
        nargs=argparse.REMAINDER,
        help="extra executor flags after `--` (e.g. -- --max-num-seqs 64)",
    )
    return p


class Child:
    """One supervised service process. Its stderr is copied, line by line, to the
    supervisor's; the last :data:`TAIL_LINES` lines are kept for :meth:`reason`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
            process_group=0,  # terminal signals (Ctrl-C) reach the supervisor alone
        )
        assert self.proc.stderr is not None
        self._copier = threading.Thread(
            target=self._copy, args=(self.proc.stderr,), name=f"{name}-stderr", daemon=True
        )
        self._copier.start()

    def _copy(self, stream: IO[bytes]) -> None:
        for line in stream:
            self.tail.append(line)
            with _stderr_lock:  # whole lines: the children's never interleave
                out = getattr(sys.stderr, "buffer", None)
                if out is not None:
                    out.write(line)
                else:  # a text-only stderr (an embedding test harness)
                    sys.stderr.write(line.decode(errors="replace"))
                sys.stderr.flush()

    def finish_output(self, timeout: float = 2.0) -> None:
        """Wait (briefly) until everything the exited child wrote has been copied."""
        self._copier.join(timeout)

    def reason(self, flags: dict[str, str] | None = None) -> str:
        """Why the exited child stopped, in its own words: the ``reason`` of its last
        ``config_error`` log line, else its last line of output (argparse's error). The flag
        the line names (its ``flag``) is told as ``flags`` maps it: the supervisor's own."""
        self.finish_output()
        last = ""
        for raw in reversed(self.tail):
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            last = last or line
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == "config_error":
                reason = str(record.get("reason", line))
                flag = record.get("flag")
                if flags and isinstance(flag, str) and flag in flags:
                    whole_flag = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"
                    reason = re.sub(whole_flag, flags[flag], reason)
                return reason
        return last


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    env = _child_env(args)
    try:
        log = configure_logging(
            "serve", args.log_level, secrets=[env[INTERNAL_TOKEN_ENV], args.api_key]
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        check_ports(_ports(args))
    except ConfigError as exc:  # before anything starts: restarting cannot free a port
        return config_error(log, exc)
    model = Path(args.model) if args.model else DEFAULT_MODEL
    if args.model is None and not (model / "config.json").is_file():
        from pagedserve.tools.tiny_model import write_tiny_model

        log.info("writing_default_model", path=str(model))
        write_tiny_model(model)
    supervisor = Supervisor(_specs(args, model), env, log, args)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    supervisor.start_all()
    log.info("stack_starting", gateway=f"{args.host}:{args.port}", model=str(model))
    code = supervisor.run()
    supervisor.stop_all()
    log.info("stack_stopped", status=code)
    return code


class Supervisor:
    """Starts the children, restarts those that die (with back-off, within the restart
    budget), and stops them all, front to back."""

    def __init__(
        self,
        specs: dict[str, list[str]],
        env: dict[str, str],
        log: structlog.stdlib.BoundLogger,
        args: argparse.Namespace,
    ) -> None:
        self.specs = specs
        self.env = env
        self.log = log
        self.max_restarts: int = args.max_restarts
        self.restart_window_s: float = args.restart_window_s
        self.children: dict[str, Child] = {}
        self.restarts: dict[str, list[float]] = {name: [] for name in specs}
        self.due: dict[str, float] = {}  # dead service -> when to restart it
        self.stop_requests = 0

    def request_stop(self, _signum: int, _frame: object) -> None:
        """Signal handler: the first request stops the stack, a second kills what is left."""
        self.stop_requests += 1

    def start(self, name: str) -> None:
        self.children[name] = Child(name, self.specs[name], self.env)
        self.log.info("service_started", name=name, pid=self.children[name].proc.pid)

    def start_all(self) -> None:
        for name in self.specs:  # blockmgr, executor, gateway: each heals when the one
            self.start(name)  # before it is up

    def run(self) -> int:
        """Supervise until a stop is requested (0), a child's configuration cannot work
        (:data:`CONFIG_ERROR_STATUS`) or a child used up its restarts (1)."""
        while not self.stop_requests:
            now = time.monotonic()
            for name, child in self.children.items():
                status = child.proc.poll()
                if name not in self.due and status is not None:
                    code = self._on_exit(name, status, now)
                    if code:
                        return code
            for name, when in list(self.due.items()):
                if now >= when and not self.stop_requests:
                    del self.due[name]
                    self.restarts[name].append(now)
                    self.start(name)
                    self.log.info("service_restarted", name=name, restarts=len(self.restarts[name]))
            time.sleep(0.1)
        return 0

    def _on_exit(self, name: str, status: int, now: float) -> int:
        """Schedule the restart of the child that exited with ``status``; or, when it must not
        be restarted, the status the supervisor exits with."""
        if status == CONFIG_ERROR_STATUS:  # restarting cannot help (e.g. a port in use)
            reason = self.children[name].reason(PORT_FLAGS.get(name))
            self.log.error("service_misconfigured", name=name, status=status, reason=reason)
            return CONFIG_ERROR_STATUS
        recent = [t for t in self.restarts[name] if now - t < self.restart_window_s]
        self.restarts[name] = recent
        if len(recent) >= self.max_restarts:
            self.log.error(
                "service_gave_up",
                name=name,
                status=status,
                restarts=len(recent),
                window_s=self.restart_window_s,
            )
            return 1
        delay = min(0.5 * 2 ** len(recent), 8.0)
        self.log.error("service_died", name=name, status=status, restart_in_s=delay)
        self.due[name] = now + delay
        return 0

    def stop_all(self) -> None:
        """Stop the children front to back (:data:`STOP_ORDER`), each waited for."""
        for name in STOP_ORDER:
            if name in self.children:
                _stop(self.children[name], self.log, lambda: self.stop_requests > 1)


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment. One internal token for the three services, unless the
    caller set one: no other local process can then drive the executor or the block manager
    through their ports. Secrets travel here, never on a command line (which other local
    users can read)."""
    env = dict(os.environ)
    env.setdefault(INTERNAL_TOKEN_ENV, secrets.token_urlsafe(32))
    env.pop(API_KEY_ENV, None)
    if args.api_key:
        env[API_KEY_ENV] = args.api_key
    return env


def executor_defaults(args: argparse.Namespace) -> list[str]:
    """The executor flags that go ahead of the caller's (a flag given after ``--`` wins):

    - ``--async-scheduling``: the block manager is another process, so its round trip
      overlaps the forward, as in ``compose.yaml``;
    - ``--cpu-threads``: every core, and ``--cpu-decode-threads``: every core but
      ``--cpu-reserved-cores``, unless ``OMP_NUM_THREADS`` is set. On the CPU the forward's
      threads meet at a barrier in every op, so a thread preempted by the gateway or a
      client stalls them all: small steps (a small model's decode steps, hundreds of short
      ops) leave the reserved cores to those (vLLM's CPU backend reserves a core the same
      way); large ones (prefill chunks; any step of a model whose weights take long to
      stream) are worth every core (``services/executor/model/cpu_threads.py``)."""
    flags = ["--async-scheduling"]
    if "OMP_NUM_THREADS" not in os.environ:
        cores = available_cores()
        flags += ["--cpu-threads", str(cores)]
        flags += ["--cpu-decode-threads", str(max(1, cores - args.cpu_reserved_cores))]
    return flags


def _ports(args: argparse.Namespace) -> dict[str, tuple[str, int | None]]:
    """Each serve flag that sets a port, with the host and port the child binds."""
    return {
        "--blockmgr-port": (LOOPBACK, args.blockmgr_port),
        "--executor-port": (LOOPBACK, args.executor_port),
        "--port": (args.host, args.port),
        "--http-port": (args.host, args.http_port),
        "--metrics-port": (args.host, args.metrics_port),
    }


def _specs(args: argparse.Namespace, model: Path) -> dict[str, list[str]]:
    """The command line of each child, in start order."""
    extra = [*executor_defaults(args), *(a for a in args.executor_args if a != "--")]
    py = [sys.executable, "-m", "services.cli"]
    common = ["--log-level", args.log_level]
    # The default tiny model's chat template shows tools Hermes-style: it is served so.
    auto_tools, parser = args.enable_auto_tool_choice, args.tool_call_parser
    if args.model is None and parser is None:
        auto_tools, parser = True, "hermes"
    return {
        "blockmgr": [*py, "blockmgr", "--port", str(args.blockmgr_port), *common],
        "executor": [
            *py,
            "executor",
            "--model",
            str(model),
            "--port",
            str(args.executor_port),
            "--blockmgr-address",
            f"{LOOPBACK}:{args.blockmgr_port}",
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
            f"{LOOPBACK}:{args.executor_port}",
            *(["--enable-auto-tool-choice"] if auto_tools else []),
            *(["--tool-call-parser", parser] if parser else []),
            *(["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else []),
            *(["--allow-runtime-lora-updating"] if args.allow_runtime_lora_updating else []),
            *common,
        ],
    }


def _stop(child: Child, log: structlog.stdlib.BoundLogger, forced: Callable[[], bool]) -> None:
    """SIGTERM ``child`` and wait until it has exited: at most its :data:`STOP_TIMEOUT_S`,
    or until ``forced()`` (a second stop request); then kill it."""
    proc = child.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S[child.name]
        while proc.poll() is None and time.monotonic() < deadline and not forced():
            time.sleep(0.05)
        if proc.poll() is None:
            log.warning("service_killed", name=child.name)
            proc.kill()
            proc.wait()
    child.finish_output()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the supervisor dies (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
