"""``examples/node/generate.js`` against a real stack: the same greedy text as a Python client.

Skipped when ``node`` (>= 18.3) is not on PATH, or when its dependencies are not installed
and ``npm ci`` cannot install them (no npm, no registry). The stack is blockmgr + executor +
gateway as local processes with the tiny model on CPU; the gateway requires an API key, so
the client's ``PAGEDSERVE_API_KEY`` handling is exercised too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pagedserve.testing.procs import ROOT, ServiceProcess, executor_args, gateway_args
from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.healthcheck import check

NODE_DIR = ROOT / "examples" / "node"
API_KEY = "node-example-key"
MIN_NODE = (18, 3)  # util.parseArgs


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    m = re.match(r"v(\d+)\.(\d+)", out.stdout.strip())
    if not m or (int(m[1]), int(m[2])) < MIN_NODE:
        pytest.skip(f"node {out.stdout.strip()} is older than {MIN_NODE}")
    return node


def _installed() -> bool:
    modules = NODE_DIR / "node_modules" / "@grpc"
    return (modules / "grpc-js").is_dir() and (modules / "proto-loader").is_dir()


@pytest.fixture(scope="module")
def node() -> str:
    node = _node()
    if not _installed():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("examples/node has no node_modules and npm is not on PATH")
        try:
            r = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund"],
                cwd=NODE_DIR,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci timed out")
        if r.returncode != 0 or not _installed():
            pytest.skip(f"npm ci failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return node


@dataclass
class Stack:
    gateway: ServiceProcess

    @property
    def address(self) -> str:
        return self.gateway.address


@pytest.fixture(scope="module")
def stack(node: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = write_tiny_model(tmp_path_factory.mktemp("node_client") / "tiny-llama")
    procs: list[ServiceProcess] = []
    try:
        procs.append(ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening"))
        procs.append(
            ServiceProcess(
                executor_args(model, procs[0].address, "--dtype", "float32"), "executor_ready"
            )
        )
        procs.append(
            ServiceProcess(
                gateway_args(model, procs[1].address, "--api-key", API_KEY), "gateway_listening"
            )
        )
        deadline = time.monotonic() + 30
        while not check(procs[2].address, timeout=2)[0]:
            assert time.monotonic() < deadline, "the gateway never became SERVING"
            time.sleep(0.1)
        yield Stack(procs[2])
    finally:
        codes = {p.args[0]: p.stop() for p in reversed(procs)}
    assert all(code == 0 for code in codes.values()), codes


def python_generate(address: str, prompt: str, max_tokens: int) -> tuple[str, str, int]:
    """Text, finish reason name and completion tokens of a greedy request."""
    request = generation_pb2.GenerateRequest(
        prompt=prompt,
        sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0),
    )
    text, final = "", None
    metadata = [("authorization", f"Bearer {API_KEY}")]
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for response in stub.Generate(request, timeout=30, metadata=metadata):
            text += response.text
            if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                final = response
    assert final is not None
    reason = common_pb2.FinishReason.Name(final.finish_reason)
    return text, reason, final.usage.completion_tokens


def run_node(node: str, *args: str, api_key: str | None = API_KEY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    if api_key is not None:
        env["PAGEDSERVE_API_KEY"] = api_key
    return subprocess.run(
        [node, "generate.js", *args],
        cwd=NODE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_node_client_streams_the_same_greedy_text_as_python(node: str, stack: Stack):
    prompt = "The quick brown fox"
    text, reason, completion_tokens = python_generate(stack.address, prompt, 12)
    assert text and completion_tokens > 0
    r = run_node(
        node, "--address", stack.address, "--max-tokens", "12", "--temperature", "0", prompt
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == text + "\n"
    assert f"finish_reason={reason}" in r.stderr
    assert f"completion_tokens={completion_tokens}" in r.stderr


def test_node_client_exits_non_zero_on_errors(node: str, stack: Stack):
    r = run_node(node, "--address", stack.address, "Hello", api_key=None)
    assert r.returncode == 1
    assert "UNAUTHENTICATED" in r.stderr
    r = run_node(node, "--address", stack.address, "--max-tokens", "0", "Hello")
    assert r.returncode == 1
    assert "INVALID_ARGUMENT" in r.stderr and "max_tokens" in r.stderr
    r = run_node(node, "no", "two prompts")
    assert r.returncode == 2
    assert "usage:" in r.stderr


def test_node_client_address_from_the_environment(node: str, stack: Stack):
    env_address = {"PAGEDSERVE_ADDRESS": stack.address}
    r = subprocess.run(
        [node, "generate.js", "--max-tokens", "2", "Hi"],
        cwd=NODE_DIR,
        env={**os.environ, **env_address, "PAGEDSERVE_API_KEY": API_KEY},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "finish_reason=FINISH_REASON_" in r.stderr


def test_example_files_are_committed_without_node_modules():
    for name in ("package.json", "package-lock.json", "generate.js", "README.md", ".gitignore"):
        assert (NODE_DIR / name).is_file(), name
    assert "node_modules/" in (NODE_DIR / ".gitignore").read_text().split()
    assert Path(NODE_DIR / "package-lock.json").read_text().count('"@grpc/grpc-js"') >= 1
