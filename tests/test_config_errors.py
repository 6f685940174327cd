"""A configuration that cannot work is final: each service exits 2 (as argparse does) with a
``config_error`` line giving the reason, and ``pagedserve serve`` stops at once, says why,
and exits 2 instead of restarting the service. A port another process holds is one: the line
names the port and the flag that sets it."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.testing.procs import ROOT, free_ports, json_records, run_cli, serve_command
from pagedserve.tools.tiny_model import write_tiny_model
from services import serve
from services.common.logging import CONFIG_ERROR_STATUS


def _serve(model: Path, *executor_args: str) -> subprocess.CompletedProcess[str]:
    command = serve_command(
        model,
        free_ports(3),
        executor_args=("--num-kv-blocks", "64", "--max-model-len", "256", *executor_args),
    )
    return run_cli(*command[3:])  # after ``python -m services.cli``


def _assert_stopped_without_restart(done: subprocess.CompletedProcess[str], reason: str) -> None:
    records = json_records(done.stderr)
    events = [r.get("event") for r in records if r.get("service") == "serve"]
    assert done.returncode == CONFIG_ERROR_STATUS, done.stderr[-3000:]
    misconfigured = [r for r in records if r.get("event") == "service_misconfigured"]
    assert len(misconfigured) == 1, events
    assert misconfigured[0]["name"] == "executor"
    assert reason in misconfigured[0]["reason"]
    assert "service_restarted" not in events and "service_died" not in events
    started = [r["name"] for r in records if r.get("event") == "service_started"]
    assert sorted(started) == ["blockmgr", "executor", "gateway"]  # each started once


def test_serve_stops_at_once_when_the_model_cannot_be_sharded_over_tp_ranks(tmp_path) -> None:
    model = write_tiny_model(tmp_path / "five-heads", hidden_size=40, num_heads=5, num_kv_heads=5)
    done = _serve(model, "--tensor-parallel-size", "2")
    # (restarting used to take ~20 s of back-off before giving up: no restart, no back-off)
    _assert_stopped_without_restart(
        done, "num_attention_heads=5 is not divisible by --tensor-parallel-size=2"
    )


def test_serve_does_not_restart_an_executor_that_rejects_its_flags(tmp_path) -> None:
    model = write_tiny_model(tmp_path / "model")
    done = _serve(model, "--block-size", "3")
    _assert_stopped_without_restart(done, "--block-size must be a power of two, got 3")


def _service_args(service: str, missing: Path) -> list[str]:
    """``service`` on a free port, given a path that does not exist where a config needs one:
    the model directory, or (block manager) the mTLS files."""
    if service == "blockmgr":
        tls = [f"--internal-tls-{f}" for f in ("cert", "key", "ca")]
        return ["blockmgr", "--port", "0", *(a for f in tls for a in (f, str(missing)))]
    args = [service, "--model", str(missing), "--port", "0"]
    if service == "gateway":
        args += ["--http-port", "-1", "--metrics-port", "-1", "--executor", "127.0.0.1:1"]
    return args


@pytest.mark.parametrize("service", ["blockmgr", "executor", "gateway"])
def test_a_service_whose_config_names_a_missing_path_exits_2_and_says_why(
    tmp_path, service
) -> None:
    missing = tmp_path / "not-there"
    done = run_cli(*_service_args(service, missing))
    assert done.returncode == CONFIG_ERROR_STATUS, done.stderr[-3000:]
    errors = [r for r in json_records(done.stderr) if r.get("event") == "config_error"]
    assert len(errors) == 1 and str(missing) in errors[0]["reason"], done.stderr[-3000:]


# ---- a port another process holds ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ports") / "model")


@contextlib.contextmanager
def _taken_port() -> Iterator[int]:
    """A loopback port this test process listens on, as another server would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _in_use(port: int, flag: str) -> str:
    return f"port {port} is in use: choose another with {flag}"


def _service_on(service: str, flag: str, port: int, model: Path) -> list[str]:
    """``service`` with ``flag`` set to ``port``, its other listeners off or on free ports."""
    if service == "blockmgr":
        base = ["blockmgr", "--port", "0"]
    elif service == "executor":
        base = ["executor", "--model", str(model), "--port", "0", "--num-kv-blocks", "64"]
    else:
        base = [
            *("gateway", "--model", str(model), "--host", "127.0.0.1", "--port", "0"),
            *("--http-port", "-1", "--metrics-port", "-1", "--executor", "127.0.0.1:1"),
        ]
    return [*base, flag, str(port)]  # the last value of a flag wins


@pytest.mark.parametrize(
    ("service", "flag"),
    [
        ("blockmgr", "--port"),
        ("executor", "--port"),
        ("gateway", "--port"),
        ("gateway", "--http-port"),
        ("gateway", "--metrics-port"),
    ],
)
def test_a_service_whose_port_is_taken_exits_2_at_once_naming_port_and_flag(
    tiny_model, service, flag
) -> None:
    with _taken_port() as port:
        done = run_cli(*_service_on(service, flag, port, tiny_model))
    assert done.returncode == CONFIG_ERROR_STATUS, done.stderr[-3000:]
    errors = [r for r in json_records(done.stderr) if r.get("level") == "error"]
    assert [e.get("reason") for e in errors] == [_in_use(port, flag)], done.stderr[-3000:]
    assert errors[0]["event"] == "config_error" and errors[0]["flag"] == flag
    # One line says it: no traceback, no other line (uvicorn's, grpc's) about the bind.
    assert "Traceback" not in done.stderr
    raw = [line for line in done.stderr.splitlines() if not json_records(line)]
    assert not [line for line in raw if str(port) in line or "bind" in line.lower()], raw


@pytest.mark.parametrize(
    "flag", ["--blockmgr-port", "--executor-port", "--port", "--http-port", "--metrics-port"]
)
def test_serve_stops_before_starting_anything_when_one_of_its_ports_is_taken(
    tiny_model, flag
) -> None:
    with _taken_port() as port:
        command = serve_command(tiny_model, free_ports(3), flag, str(port))
        done = run_cli(*command[3:])  # after ``python -m services.cli``
    assert done.returncode == CONFIG_ERROR_STATUS, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()  # one line, nothing started
    (record,) = json_records(line)
    assert record["event"] == "config_error" and record["service"] == "serve"
    assert record["reason"] == _in_use(port, flag)


def test_serve_refuses_one_port_given_to_two_of_its_flags(tiny_model) -> None:
    port, exec_port, bm_port = free_ports(3)
    command = serve_command(tiny_model, [port, exec_port, bm_port], "--http-port", str(port))
    done = run_cli(*command[3:])
    assert done.returncode == CONFIG_ERROR_STATUS, done.stderr[-3000:]
    (record,) = json_records(done.stderr)
    assert record["reason"] == (
        f"port {port} is given to both --port and --http-port: choose another with --http-port"
    )


class _Log:
    """What the supervisor logs, as (event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def _record(self, event: str, **fields: object) -> None:
        self.records.append((event, fields))

    info = warning = error = _record


def test_serve_does_not_restart_a_child_that_finds_its_port_taken_and_names_its_own_flag(
    tiny_model, monkeypatch
) -> None:
    """The port is taken after the supervisor checked it (a race, or while it restarts a
    child): the child exits 2 naming its own ``--port``; the supervisor does not restart it
    and tells the reason with its own flag."""
    monkeypatch.chdir(ROOT)
    with _taken_port() as port:
        args = serve._parser().parse_args(["--blockmgr-port", str(port), "--max-restarts", "1"])
        specs = {"blockmgr": serve._specs(args, tiny_model)["blockmgr"]}
        log = _Log()
        supervisor = serve.Supervisor(specs, serve._child_env(args), log, args)  # type: ignore[arg-type]
        supervisor.start_all()
        try:
            code = supervisor.run()
        finally:
            supervisor.stop_all()
    assert code == CONFIG_ERROR_STATUS
    events = [event for event, _ in log.records]
    assert events == ["service_started", "service_misconfigured"], log.records
    assert log.records[1][1]["reason"] == _in_use(port, "--blockmgr-port")


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (("--lora-modules", "a=/x"), "--lora-modules needs --enable-lora"),
        (("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"), "--max-cpu-loras (2)"),
        (("--enable-lora", "--lora-modules", "a"), "expected NAME=DIR"),
    ],
)
def test_lora_flags_that_cannot_work_are_refused_naming_the_flag(flags, reason) -> None:
    from services.executor.service.config import ExecutorConfig

    with pytest.raises(SystemExit) as exit_info:
        ExecutorConfig.from_args(["--model", "m", *flags])
    assert exit_info.value.code == 2


def test_an_executor_whose_lora_module_cannot_serve_exits_2_naming_it(tiny_model) -> None:
    missing = "/nonexistent/adapter"
    args = ["executor", "--model", str(tiny_model), "--port", "0", "--num-kv-blocks", "64"]
    args += ["--max-model-len", "256", "--enable-lora", "--lora-modules", f"sql={missing}"]
    done = run_cli(*args)
    assert done.returncode == CONFIG_ERROR_STATUS, done.stderr[-3000:]
    errors = [r for r in json_records(done.stderr) if r.get("event") == "config_error"]
    assert len(errors) == 1, done.stderr[-3000:]
    assert f"--lora-modules sql={missing}" in errors[0]["reason"]
