"""The whole stack as real processes on loopback: blockmgr, executor (tiny Llama, CPU) and
gateway, started once per module that asks for it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.testing.procs import (
    EVENT_TIMEOUT_S,
    ServiceProcess,
    cpu_executor_args,
    gateway_args,
    wait_serving,
)
from pagedserve.tools.tiny_model import write_tiny_model
from pagedserve.v1 import generation_pb2_grpc
from services.blockmgr.client import GrpcClient

POOL_ID = "gateway-tests"


@dataclass
class Stack:
    model_dir: Path
    blockmgr: ServiceProcess
    executor: ServiceProcess
    gateway: ServiceProcess
    metrics_port: int
    http_port: int

    def stub(self, address: str | None = None) -> generation_pb2_grpc.GenerationStub:
        channel = grpc.insecure_channel(address or self.gateway.address)
        return generation_pb2_grpc.GenerationStub(channel)

    def blocks_in_use(self) -> int:
        client = GrpcClient(self.blockmgr.address)
        try:
            return client.stats(POOL_ID).counters.num_in_use_blocks
        finally:
            client.close()

    def wait_blocks_free(self, timeout: float = EVENT_TIMEOUT_S) -> int:
        """Blocks still in use once the pool settles (finished sequences are freed by the
        executor's next step, just after their final token went out), or once ``timeout``
        has passed."""
        deadline = time.monotonic() + timeout
        while (n := self.blocks_in_use()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return n

    def start_gateway(self, *extra: str) -> ServiceProcess:
        return ServiceProcess(
            gateway_args(self.model_dir, self.executor.address, *extra), "gateway_listening"
        )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gateway_model") / "tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False
            )
        return out[0, len(prompt_ids) :].tolist()

    return run


# The executor of the gateway tests' stacks: fp32 (exact greedy), 256 KV blocks, max_model_len
# 512, on a free port.
stack_executor_args = cpu_executor_args


@pytest.fixture(scope="session")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    executor = ServiceProcess(
        stack_executor_args(
            tiny_model_dir,
            "--max-num-seqs",
            "64",
            "--blockmgr-address",
            blockmgr.address,
            "--pool-id",
            POOL_ID,
            "--async-scheduling",  # as deployed: the block manager is another process
        ),
        "executor_ready",
    )
    gateway = ServiceProcess(
        [
            "gateway",
            "--model",
            str(tiny_model_dir),
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--executor",
            executor.address,
            "--max-n",
            "4",
        ],
        "gateway_listening",
    )
    metrics_port = int(gateway.wait_for_event("metrics_listening")["metrics_port"])
    http_port = int(gateway.wait_for_event("http_listening")["http_port"])
    wait_serving(gateway.address)
    yield Stack(tiny_model_dir, blockmgr, executor, gateway, metrics_port, http_port)
    for proc in (gateway, executor, blockmgr):
        assert proc.stop() == 0, proc.args[0]
