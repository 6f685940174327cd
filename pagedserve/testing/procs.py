"""Real service processes for the end-to-end tests and the benchmarks: start, read the bound
port from the JSON log, stop with SIGTERM.

The services run as ``python -m services.cli`` from the repository root (``ROOT``): this
module is meant for a checkout (an editable install), where ``services`` is importable
there."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from services.common.healthcheck import check

ROOT = Path(__file__).resolve().parents[2]  # the repository root
T = TypeVar("T")

# How long a test waits for something another process or thread does before it fails: ample
# on a loaded machine. A test that proves something happens promptly waits for the event and
# fails only past this bound; where it must prove a wait did not happen, it checks a log line
# or a status, not the time taken.
EVENT_TIMEOUT_S = 60.0


def wait_until(
    condition: Callable[[], T],
    timeout: float = EVENT_TIMEOUT_S,
    *,
    what: str = "",
    interval: float = 0.05,
) -> T:
    """Poll ``condition`` until it returns a true value, and return that value; fail after
    ``timeout`` seconds, saying ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'the condition'} not within {timeout:g} s")
        time.sleep(interval)
    return value


async def async_wait_until(
    condition: Callable[[], object],
    timeout: float = EVENT_TIMEOUT_S,
    *,
    what: str = "",
    interval: float = 0.02,
) -> None:
    """:func:`wait_until` inside an event loop (the loop runs while it waits)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'the condition'} not within {timeout:g} s")
        await asyncio.sleep(interval)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``pagedserve ARGS`` run to its end (one torch thread), its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def json_records(text: str) -> list[dict]:
    """The JSON log records among ``text``'s lines (other lines skipped)."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def serve_command(
    model: Path,
    ports: Sequence[int],
    *serve_args: str,
    http_port: int = -1,
    executor_args: Sequence[str] = ("--num-kv-blocks", "64", "--max-model-len", "256"),
) -> list[str]:
    """The ``pagedserve serve`` command line of the tests: the tiny ``model``, gRPC, executor
    and block-manager ``ports``, no metrics port, HTTP on ``http_port`` (-1: off), then
    ``serve_args`` and, after ``--``, ``executor_args``."""
    port, exec_port, bm_port = ports
    return [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--executor-port",
        str(exec_port),
        "--blockmgr-port",
        str(bm_port),
        "--metrics-port",
        "-1",
        "--http-port",
        str(http_port),
        *serve_args,
        "--",
        *executor_args,
    ]


def wait_serving(address: str, timeout: float = 30.0) -> None:
    """Poll ``grpc.health.v1`` at ``address`` until it reports SERVING."""
    deadline = time.monotonic() + timeout
    while not check(address, timeout=2.0)[0]:
        if time.monotonic() > deadline:
            raise AssertionError(f"{address} never became SERVING")
        time.sleep(0.05)


class ServiceProcess:
    def __init__(
        self,
        args: list[str],
        ready_event: str,
        *,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.args = args
        self.lines: list[dict] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self._ready = threading.Event()
        self.port: int | None = None
        self._ready_event = ready_event
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError(f"{args[0]} did not become ready: {self.lines[-5:]}")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = {"event": "raw", "line": line.rstrip()}
            self.lines.append(record)
            if "port" in record and record.get("event", "").endswith("_listening"):
                self.port = int(record["port"])
            if record.get("event") == self._ready_event:
                self._ready.set()
        self._ready.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def events(self) -> list[str]:
        return [r.get("event", "") for r in self.lines]

    def wait_for_event(self, event: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in list(self.lines):
                if r.get("event") == event:
                    return r
            time.sleep(0.05)
        raise AssertionError(f"no {event!r} in {self.events()[-10:]}")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def executor_args(model: str | Path, blockmgr_address: str, *extra: str) -> list[str]:
    """A small CPU executor on a free port, over the block manager at ``blockmgr_address``."""
    return [
        "executor",
        "--model",
        str(model),
        "--port",
        "0",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--blockmgr-address",
        blockmgr_address,
        *extra,
    ]


def cpu_executor_args(model: str | Path, *extra: str) -> list[str]:
    """An fp32 CPU executor of ``model`` on a free port (its block manager in-process unless
    ``extra`` says otherwise): 256 KV blocks, ``max_model_len`` 512."""
    return [
        "executor",
        "--model",
        str(model),
        "--port",
        "0",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        "512",
        *extra,
    ]


def gateway_args(model: str | Path, executor_address: str, *extra: str) -> list[str]:
    """A gateway on free loopback ports (gRPC and HTTP) in front of ``executor_address``, no
    metrics."""
    return [
        "gateway",
        "--model",
        str(model),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--metrics-port",
        "-1",
        "--http-port",
        "0",
        "--executor",
        executor_address,
        *extra,
    ]


class ServeStack:
    """``pagedserve serve`` of ``model`` on free ports (HTTP on a free port too), its JSON log
    lines collected; ``executor_args`` as :func:`serve_command` takes them."""

    def __init__(
        self,
        model: Path,
        *serve_args: str,
        executor_args: Sequence[str] = ("--num-kv-blocks", "64", "--max-model-len", "256"),
    ) -> None:
        ports = free_ports(3)
        self.port, self.exec_port, self.bm_port = ports
        self.lines: list[dict] = []
        self.proc = subprocess.Popen(
            serve_command(model, ports, *serve_args, http_port=0, executor_args=executor_args),
            cwd=ROOT,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                self.lines.append(json.loads(line))
            except json.JSONDecodeError:
                self.lines.append({"event": "raw", "line": line})

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_generate(self, *args: str) -> subprocess.CompletedProcess[str]:
        deadline = time.monotonic() + 60
        while True:
            r = run_cli(*args, "--address", self.address)
            if r.returncode == 0 or time.monotonic() > deadline:
                return r
            time.sleep(0.3)

    def pids(self) -> dict[str, int]:
        return {r["name"]: r["pid"] for r in self.lines if r.get("event") == "service_started"}

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not stopped within 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
