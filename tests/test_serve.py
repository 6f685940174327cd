"""``pagedserve serve`` (the one-command local stack) and ``pagedserve generate`` / ``chat``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from pagedserve.testing.procs import (
    ServeStack,
    free_ports,
    json_records,
    run_cli,
    serve_command,
    wait_serving,
)
from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from services import serve
from services.common.logging import CONFIG_ERROR_STATUS
from services.executor.service.config import ExecutorConfig

ROOT = Path(__file__).resolve().parents[1]


def test_serve_runs_three_processes_and_generate_streams_text(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    stack = ServeStack(model)
    try:
        r = stack.wait_generate(
            "generate", "Hello", "--max-tokens", "8", "--temperature", "0", "--usage"
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip()  # some text was streamed
        assert "completion=" in r.stderr
        r = run_cli("chat", "Hi there", "--max-tokens", "4", "--address", f"127.0.0.1:{stack.port}")
        assert r.returncode == 0, r.stderr
        assert set(stack.pids()) == {"blockmgr", "executor", "gateway"}
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(30) == 0
        stack.reader.join(5)
        assert any(r.get("event") == "stack_stopped" for r in stack.lines)
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a dead parent's successor) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _wait_gone(pids: list[int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.1)


def _events(stack: ServeStack, event: str) -> list[dict]:
    return [r for r in stack.lines if r.get("event") == event]


def test_serve_restarts_a_dead_executor_and_its_stream_carries_on(tmp_path):
    """A greedy stream in flight when the executor is killed completes, token for token as
    without the kill: ``serve`` restarts the executor and the gateway resumes the stream."""
    model = write_tiny_model(tmp_path / "model")
    stack = ServeStack(model)
    try:
        assert stack.wait_generate("generate", "Hi", "--max-tokens", "2").returncode == 0
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.address))
        request = generation_pb2.GenerateRequest(
            prompt="Hi, a long answer please",
            sampling_params=generation_pb2.SamplingParams(
                max_tokens=200, temperature=0, ignore_eos=True
            ),
        )
        reference = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
        assert len(reference) == 200
        stream = stub.Generate(request, timeout=120)
        tokens = list(next(stream).token_ids)
        old = stack.pids()["executor"]
        os.kill(old, signal.SIGKILL)
        tokens += [t for r in stream for t in r.token_ids]
        assert tokens == reference
        assert _events(stack, "request_resumed")
        deadline = time.monotonic() + 30
        while not _events(stack, "service_restarted"):
            assert time.monotonic() < deadline and stack.proc.poll() is None
            time.sleep(0.1)
        assert _events(stack, "service_died")[0]["name"] == "executor"
        r = stack.wait_generate("generate", "Hi again", "--max-tokens", "2")
        assert r.returncode == 0, r.stderr
        assert stack.pids()["executor"] != old
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(30) == 0
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()


def test_serve_gives_up_when_the_restart_budget_is_spent(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    stack = ServeStack(model, "--max-restarts", "0")
    try:
        assert stack.wait_generate("generate", "Hi", "--max-tokens", "2").returncode == 0
        pids = stack.pids()
        os.kill(pids["executor"], signal.SIGKILL)
        assert stack.proc.wait(30) == 1
        stack.reader.join(5)
        gave_up = _events(stack, "service_gave_up")
        assert gave_up and gave_up[0]["name"] == "executor" and gave_up[0]["status"] == -9
        _wait_gone([pids["gateway"], pids["blockmgr"]])
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()


def test_children_die_with_a_killed_supervisor(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    stack = ServeStack(model)
    try:
        assert stack.wait_generate("generate", "Hi", "--max-tokens", "2").returncode == 0
        pids = list(stack.pids().values())
        stack.proc.send_signal(signal.SIGKILL)
        stack.proc.wait(10)
        _wait_gone(pids)  # no orphans left serving on the ports
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()


def test_a_second_instance_on_the_same_port_fails_fast(tmp_path):
    from pagedserve.testing.procs import ServiceProcess

    first = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    try:
        second = subprocess.run(
            [sys.executable, "-m", "services.cli", "blockmgr", "--port", str(first.port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        # A configuration error (no restart can free the port), said in one line.
        assert second.returncode == CONFIG_ERROR_STATUS, second.stderr[-2000:]
        errors = [r for r in json_records(second.stderr) if r.get("level") == "error"]
        assert [r["reason"] for r in errors] == [
            f"port {first.port} is in use: choose another with --port"
        ]
    finally:
        first.stop()


# ---- a clean stop, and what the services log -------------------------------------------------

INTERNAL_TOKEN = "internal-token-0123456789abcdef"
API_KEY = "api-key-fedcba9876543210"


@dataclass
class ServeRun:
    """One finished ``pagedserve serve``: its exit status and everything it and its children
    wrote on stdout and stderr."""

    status: int
    stdout: str
    stderr: str

    def records(self) -> list[dict]:
        return json_records(self.stderr)

    def events(self, service: str) -> list[str]:
        return [r["event"] for r in self.records() if r.get("service") == service]


@pytest.fixture(scope="module")
def ctrl_c_run(tmp_path_factory: pytest.TempPathFactory) -> ServeRun:
    """``pagedserve serve`` with a known internal token (environment) and API key (flag),
    serving one gRPC and one HTTP request with the key, then stopped the way a terminal's
    Ctrl-C stops it: SIGINT to its whole process group."""
    tmp = tmp_path_factory.mktemp("serve_run")
    model = write_tiny_model(tmp / "model")
    port, exec_port, bm_port, http_port = free_ports(4)
    out, err = tmp / "stdout", tmp / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            serve_command(
                model, (port, exec_port, bm_port), "--api-key", API_KEY, http_port=http_port
            ),
            cwd=ROOT,
            stdout=stdout,
            stderr=stderr,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "PAGEDSERVE_INTERNAL_TOKEN": INTERNAL_TOKEN,
            },
            start_new_session=True,  # its own process group, as in a terminal
        )
        try:
            wait_serving(f"127.0.0.1:{port}", timeout=60)
            _generate_with_key(f"127.0.0.1:{port}")
            r = httpx.post(
                f"http://127.0.0.1:{http_port}/v1/completions",
                json={"model": "model", "prompt": "Hi", "max_tokens": 2},
                headers={"authorization": f"Bearer {API_KEY}"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            os.killpg(proc.pid, signal.SIGINT)
            status = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ServeRun(status, out.read_text(errors="replace"), err.read_text(errors="replace"))


def _generate_with_key(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            prompt="Hello", sampling_params=generation_pb2.SamplingParams(max_tokens=2)
        )
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        responses = list(stub.Generate(request, metadata=metadata, timeout=30))
    assert responses and responses[-1].finish_reason


def test_ctrl_c_stops_gateway_then_executor_then_blockmgr_without_errors(ctrl_c_run) -> None:
    run = ctrl_c_run
    assert run.status == 0, run.stderr[-3000:]
    records = run.records()
    stopped = [r["service"] for r in records if r.get("event", "").endswith("_stopped")]
    assert stopped == ["gateway", "executor", "blockmgr", "serve"]
    # The executor gave its pool back while the block manager was still up.
    assert "pool_unregistered" in run.events("executor")
    assert "pool_unregister_failed" not in run.stderr
    assert [r for r in records if r.get("level") in ("error", "critical")] == []


def test_no_secret_reaches_any_service_log(ctrl_c_run) -> None:
    run = ctrl_c_run
    services = {r.get("service") for r in run.records()}
    assert {"serve", "blockmgr", "executor", "gateway"} <= services  # every log was read
    for secret in (INTERNAL_TOKEN, API_KEY):
        assert secret not in run.stdout
        assert secret not in run.stderr
    # The configurations are logged, with the secrets redacted field by field.
    configs = {r["service"]: r["config"] for r in run.records() if "config" in r}
    assert set(configs) == {"blockmgr", "executor", "gateway"}
    for config in configs.values():
        assert config["security"] == {"internal_token": True, "mtls": False}
    assert configs["gateway"]["api_key"] == "***"


def test_serve_gives_the_executor_async_scheduling_every_core_and_decodes_on_all_but_the_reserved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The executor's defaults go first, so a flag after ``--`` overrides them; with
    OMP_NUM_THREADS set, the environment decides the threads."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(serve, "available_cores", lambda: 8)
    args = serve._parser().parse_args(["--", "--no-async-scheduling", "--max-num-seqs", "4"])
    executor = serve._specs(args, Path("m"))["executor"]
    tail = executor[-8:]
    assert tail == [
        "--async-scheduling",
        "--cpu-threads",
        "8",
        "--cpu-decode-threads",
        "7",
        "--no-async-scheduling",  # the caller's, later: it wins
        "--max-num-seqs",
        "4",
    ]
    config = ExecutorConfig.from_args(["--model", "m", *tail])
    assert (config.async_scheduling, config.max_num_seqs) == (False, 4)
    assert (config.cpu_threads, config.cpu_decode_threads) == (8, 7)
    assert config.runner_config().decode_threads(1) == 7
    assert config.runner_config().decode_threads(2) == 3  # split between ranks as the others
    args = serve._parser().parse_args(["--cpu-reserved-cores", "8"])
    assert serve.executor_defaults(args) == [
        "--async-scheduling",
        "--cpu-threads",
        "8",
        "--cpu-decode-threads",
        "1",
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert serve.executor_defaults(args) == ["--async-scheduling"]


def test_the_chat_parsers_given_to_serve_go_to_the_gateway():
    args = serve._parser().parse_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    )
    specs = serve._specs(args, Path("m"))
    gateway = " ".join(specs["gateway"])
    assert "--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3" in gateway
    assert "--tool-call-parser" not in specs["executor"]
    plain = serve._specs(serve._parser().parse_args(["--model", "m"]), Path("m"))["gateway"]
    parsers = {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"}
    assert not parsers & set(plain)
    # The default tiny model's template renders tools as Hermes does: served with its parser.
    tiny = " ".join(serve._specs(serve._parser().parse_args([]), Path("m"))["gateway"])
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in tiny


def test_serve_with_lora_answers_the_openai_client_per_adapter_and_loads_at_runtime(tmp_path):
    """``pagedserve serve --allow-runtime-lora-updating -- --enable-lora --lora-modules``: the
    official client names the adapter in ``model``; an adapter loaded at runtime serves, and
    one unloaded is a 404."""
    import openai

    from pagedserve.tools.lora_adapter import write_random_adapter

    model = write_tiny_model(tmp_path / "model")
    first = write_random_adapter(model, tmp_path / "first", seed=1)
    second = write_random_adapter(model, tmp_path / "second", seed=2)
    stack = ServeStack(
        model,
        "--allow-runtime-lora-updating",
        executor_args=(
            *("--num-kv-blocks", "64", "--max-model-len", "256"),
            *("--enable-lora", "--max-loras", "2", "--lora-modules", f"first={first}"),
        ),
    )
    try:
        assert stack.wait_generate("generate", "Hi", "--max-tokens", "1").returncode == 0
        port = next(r["http_port"] for r in stack.lines if r.get("event") == "http_listening")
        root = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="unused")
        texts = {
            name: client.completions.create(
                model=name, prompt="The train", max_tokens=8, temperature=0
            )
            .choices[0]
            .text
            for name in ("model", "first")
        }
        body = {"lora_name": "second", "lora_path": str(second)}
        assert httpx.post(f"{root}/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
        out = client.completions.create(
            model="second", prompt="The train", max_tokens=8, temperature=0
        )
        texts["second"] = out.choices[0].text
        assert len(set(texts.values())) == 3  # the base model and two adapters, each its own
        assert {m.id for m in client.models.list()} == {"model", "first", "second"}
        unload = {"lora_name": "second"}
        assert (
            httpx.post(f"{root}/v1/unload_lora_adapter", json=unload, timeout=60).status_code == 200
        )
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="second", prompt="The train", max_tokens=2)
    finally:
        stack.stop()


def test_serve_keeps_a_session_pinned_prefix_through_a_flood_of_one_off_prompts(tmp_path):
    """``kv_pin_ttl_s`` through the stack: a prompt pinned for 10 minutes is still cached
    after one-off prompts turned the small KV cache over; the same prompt unpinned is not."""
    model = write_tiny_model(tmp_path / "model")
    stack = ServeStack(
        model,
        executor_args=("--num-kv-blocks", "48", "--max-model-len", "256", "--block-size", "16"),
    )

    def complete(root: str, prompt: list[int], **extra: object) -> int:
        body = {"model": "model", "prompt": prompt, "max_tokens": 1, **extra}
        r = httpx.post(f"{root}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        assert stack.wait_generate("generate", "Hi", "--max-tokens", "1").returncode == 0
        port = next(r["http_port"] for r in stack.lines if r.get("event") == "http_listening")
        root = f"http://127.0.0.1:{port}"
        pinned, plain = [1, *range(10, 73)], [1, *range(100, 163)]  # 4 blocks each
        complete(root, pinned, kv_pin_ttl_s=600)
        complete(root, plain)
        for j in range(12):  # one-off prompts of 12 blocks: the 47 blocks turn over thrice
            complete(root, [1, *(200 + (13 * j + i) % 400 for i in range(191))])
        assert complete(root, pinned) == 48  # (never the block of the last prompt token)
        assert complete(root, plain) == 0
    finally:
        stack.stop()
