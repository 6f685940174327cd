"""The model side's start-up settings: CPU threads per rank, and the allocator policy."""

from __future__ import annotations

import platform

import pytest

from services.common.malloc_policy import keep_large_blocks
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


def test_the_cli_flag_reaches_the_runner_and_is_range_checked(tmp_path):
    config = ExecutorConfig.from_args(["--model", str(tmp_path), "--cpu-threads", "3"])
    assert config.runner_config().cpu_threads == 3
    with pytest.raises(ValueError, match="--cpu-threads"):
        ExecutorConfig(model=str(tmp_path), cpu_threads=0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")
def test_the_allocator_policy_is_taken_by_glibc():
    assert keep_large_blocks() is True
