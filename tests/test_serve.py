"""``pagedserve serve`` (the one-command local stack) and ``pagedserve generate`` / ``chat``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pagedserve.tools.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


class Stack:
    def __init__(self, model: Path) -> None:
        self.port, self.exec_port, self.bm_port = _free_ports(3)
        self.lines: list[dict] = []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "serve",
                "--model",
                str(model),
                "--port",
                str(self.port),
                "--executor-port",
                str(self.exec_port),
                "--blockmgr-port",
                str(self.bm_port),
                "--metrics-port",
                "-1",
                "--",
                "--num-kv-blocks",
                "64",
                "--max-model-len",
                "256",
            ],
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

    def wait_generate(self, *args: str) -> subprocess.CompletedProcess[str]:
        deadline = time.monotonic() + 60
        while True:
            r = _cli(*args, "--address", f"127.0.0.1:{self.port}")
            if r.returncode == 0 or time.monotonic() > deadline:
                return r
            time.sleep(0.3)

    def pids(self) -> dict[str, int]:
        return {r["name"]: r["pid"] for r in self.lines if r.get("event") == "service_started"}


def test_serve_runs_three_processes_and_generate_streams_text(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    stack = Stack(model)
    try:
        r = stack.wait_generate(
            "generate", "Hello", "--max-tokens", "8", "--temperature", "0", "--usage"
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip()  # some text was streamed
        assert "completion=" in r.stderr
        r = _cli("chat", "Hi there", "--max-tokens", "4", "--address", f"127.0.0.1:{stack.port}")
        assert r.returncode == 0, r.stderr
        assert set(stack.pids()) == {"blockmgr", "executor", "gateway"}
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(30) == 0
        stack.reader.join(5)
        assert any(r.get("event") == "stack_stopped" for r in stack.lines)
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()


def test_serve_stops_everything_when_one_service_dies(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    stack = Stack(model)
    try:
        assert stack.wait_generate("generate", "Hi", "--max-tokens", "2").returncode == 0
        pids = stack.pids()
        os.kill(pids["executor"], signal.SIGKILL)
        assert stack.proc.wait(30) == 1
        stack.reader.join(5)
        died = [r for r in stack.lines if r.get("event") == "service_died"]
        assert died and died[0]["name"] == "executor" and died[0]["status"] == -9
        for name in ("gateway", "blockmgr"):
            try:
                os.kill(pids[name], 0)
                alive = True
            except ProcessLookupError:
                alive = False
            assert not alive, name
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()


def test_generate_reports_a_clear_error_when_nothing_listens():
    (port,) = _free_ports(1)
    r = _cli("generate", "Hello", "--address", f"127.0.0.1:{port}", "--timeout", "2")
    assert r.returncode == 1
    assert "UNAVAILABLE" in r.stderr or "DEADLINE_EXCEEDED" in r.stderr
