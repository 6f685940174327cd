"""The model side's start-up settings: CPU threads per rank and per step size, and the
allocator policy."""

from __future__ import annotations

import platform

import pytest
import torch

from services.common.malloc_policy import keep_large_blocks
from services.executor.model.cpu_threads import SMALL_STEP_WORK, WEIGHT_TOKENS, StepThreads
from services.executor.model.runner_config import RunnerConfig, available_cores
from services.executor.service.config import ExecutorConfig


def test_cpu_threads_are_split_between_the_tensor_parallel_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert RunnerConfig("m", cpu_threads=8).torch_threads(2) == 4
    assert RunnerConfig("m", cpu_threads=1).torch_threads(4) == 1  # never 0
    assert RunnerConfig("m").torch_threads(1) == available_cores()


def test_omp_num_threads_rules_when_no_cpu_threads_are_given(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert RunnerConfig("m").torch_threads(1) is None  # torch's own choice: the variable
    assert RunnerConfig("m", cpu_threads=2).torch_threads(1) == 2  # the flag wins


def test_decode_threads_apply_only_when_fewer_than_the_step_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert RunnerConfig("m", cpu_threads=4).decode_threads(1) is None  # not asked
    assert RunnerConfig("m", cpu_threads=4, cpu_decode_threads=3).decode_threads(1) == 3
    assert RunnerConfig("m", cpu_threads=4, cpu_decode_threads=3).decode_threads(2) == 1
    assert RunnerConfig("m", cpu_threads=2, cpu_decode_threads=2).decode_threads(1) is None
    assert RunnerConfig("m", cpu_threads=2, cpu_decode_threads=5).decode_threads(1) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert RunnerConfig("m", cpu_decode_threads=1).decode_threads(1) is None  # the environment


def test_step_threads_follow_the_step_size_and_the_model_size():
    policy = StepThreads.for_model(large=2, small=1, num_params=10_000_000)
    assert policy is not None and policy.min_tokens == SMALL_STEP_WORK // 10_000_000 == 256
    try:
        policy.apply(256)
        assert torch.get_num_threads() == 2
        policy.apply(255)
        assert torch.get_num_threads() == 1
        assert policy.threads_for(4096) == 2 and policy.threads_for(1) == 1
    finally:
        torch.set_num_threads(1)  # the suite's own
    # A model whose weights alone make every step large (streaming them costs more than
    # SMALL_STEP_WORK), or no fewer threads asked: every step on the same threads.
    big = -(-SMALL_STEP_WORK // WEIGHT_TOKENS)
    assert StepThreads.for_model(large=2, small=1, num_params=big) is None
    assert StepThreads.for_model(large=2, small=1, num_params=big // 2).min_tokens == 32
    assert StepThreads.for_model(large=2, small=2, num_params=10**6) is None


def test_the_cli_flag_reaches_the_runner_and_is_range_checked(tmp_path):
    config = ExecutorConfig.from_args(["--model", str(tmp_path), "--cpu-threads", "3"])
    assert config.runner_config().cpu_threads == 3
    with pytest.raises(ValueError, match="--cpu-threads"):
        ExecutorConfig(model=str(tmp_path), cpu_threads=0)
    flags = ["--model", str(tmp_path), "--cpu-decode-threads", "1"]
    assert ExecutorConfig.from_args(flags).runner_config().cpu_decode_threads == 1
    with pytest.raises(ValueError, match="--cpu-decode-threads"):
        ExecutorConfig(model=str(tmp_path), cpu_decode_threads=0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")
def test_the_allocator_policy_is_taken_by_glibc():
    assert keep_large_blocks() is True
