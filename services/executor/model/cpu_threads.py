"""torch's intra-op threads per step on the CPU: all of them for large steps, fewer for small.

A CPU forward's threads meet at a barrier in every op. A large step (a prefill chunk, or any
step of a model whose weights take long to stream) is made of long ops: every thread is worth
its barrier, even when another process (the gateway, a client) preempts one now and then. A
small model's decode step is hundreds of short ops: a thread preempted by such a process
stalls each op it is in, and the step runs slower on two threads than on one. So
``--cpu-decode-threads`` runs small steps on fewer threads than ``--cpu-threads``, leaving
those cores to the processes beside the executor.

A step's size is its parameter-tokens, ``P x max(T, WEIGHT_TOKENS)`` for ``T`` tokens through
``P`` parameters: its matmuls' work, and at least the time to stream the weights once (on one
core, reading a weight costs about what 16 tokens' multiply-adds on it do). A step of fewer than
:data:`SMALL_STEP_WORK` is small. Measured on a 2-core machine through the whole stack
(``bench/llamacpp_bench.py``; docs/benchmarks.md, "Against llama.cpp on the CPU"): the 9.6 M
benchmark Llama, 64 chat requests, 1 thread below 256 tokens and 2 above gave 1.09x the
output tok/s of 1 thread everywhere and 1.14x on 200 requests (lower TTFT and TPOT both);
the 0.4 B model's 16-sequence decode steps are large (2 threads: 1.29x its tok/s on one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SMALL_STEP_WORK", "WEIGHT_TOKENS", "StepThreads"]

SMALL_STEP_WORK = 256 * 10_000_000  # parameter-tokens: 256 tokens of a 10 M-parameter model
WEIGHT_TOKENS = 16  # streaming a weight costs about this many tokens' multiply-adds on it


@dataclass(frozen=True)
class StepThreads:
    """``large`` threads for a step of ``min_tokens`` tokens or more, ``small`` (fewer) for a
    smaller one."""

    large: int
    small: int
    min_tokens: int

    @classmethod
    def for_model(cls, large: int, small: int, num_params: int) -> StepThreads | None:
        """The policy for a model of ``num_params`` parameters (this rank's), or None where
        every step is large (the model's weights alone make it so) or ``small >= large``."""
        min_tokens = math.ceil(SMALL_STEP_WORK / max(1, num_params))
        if small >= large or min_tokens <= WEIGHT_TOKENS:
            return None
        return cls(large, small, min_tokens)

    def threads_for(self, num_tokens: int) -> int:
        return self.small if num_tokens < self.min_tokens else self.large

    def apply(self, num_tokens: int) -> None:
        """Set torch's intra-op threads for a step of ``num_tokens`` tokens (this thread's
        OpenMP runtime; a no-op when unchanged)."""
        threads = self.threads_for(num_tokens)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
