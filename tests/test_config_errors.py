"""A configuration that cannot work is final: each service exits 2 (as argparse does) with a
``config_error`` line giving the reason, and ``pagedserve serve`` stops at once, says why,
and exits 2 instead of restarting the service."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from pagedserve.tools.tiny_model import write_tiny_model
from services.common.logging import CONFIG_ERROR_STATUS
from tests.procs import free_ports, json_records, run_cli, serve_command


def _serve(model: Path, *executor_args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    command = serve_command(
        model,
        free_ports(3),
        executor_args=("--num-kv-blocks", "64", "--max-model-len", "256", *executor_args),
    )
    t0 = time.monotonic()
    done = run_cli(*command[3:])  # after ``python -m services.cli``
    return done, time.monotonic() - t0


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
    done, seconds = _serve(model, "--tensor-parallel-size", "2")
    _assert_stopped_without_restart(
        done, "num_attention_heads=5 is not divisible by --tensor-parallel-size=2"
    )
    assert seconds < 30  # no back-off: restarting used to take ~20 s before giving up


def test_serve_does_not_restart_an_executor_that_rejects_its_flags(tmp_path) -> None:
    model = write_tiny_model(tmp_path / "model")
    done, _ = _serve(model, "--block-size", "3")
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
