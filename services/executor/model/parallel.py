"""Tensor parallelism: how one rank's shard of the model is cut, and the collectives that
the sharded model calls.

The cut is Megatron's. Each rank holds a slice of the query heads (and of the KV heads,
replicated when there are fewer KV heads than ranks, as vLLM does), a slice of the MLP's
intermediate width, and a slice of the vocabulary. Column-parallel layers (``qkv_proj``,
``gate_up_proj``) need no communication. Row-parallel layers (``o_proj``, ``down_proj``)
produce partial sums, added up by one all-reduce each. A mixture of experts is cut the
same way inside every expert: a slice of each expert's intermediate width (its own width,
``moe.intermediate_size``, which need not be the dense layers' ``intermediate_size``: a
Qwen3-MoE may have both kinds of layer), the router replicated, one all-reduce. The
embedding is vocab-parallel: each rank looks up the tokens it owns, the others contribute
zeros, and an all-reduce joins them. The LM head's logits are gathered to rank 0, which
samples.

Widths that do not divide by the rank count (intermediate sizes, vocabulary) are padded to
``ceil(x / N)`` per rank with zero rows, which contribute nothing: ``silu(0) * 0 = 0``,
an embedding row that no token id reaches, and logits that are sliced off.

:class:`ShardPlan` is pure. :class:`SingleComm` is the one-rank no-op; :class:`DistComm` runs
on ``torch.distributed`` (gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from services.executor.model.config import ModelConfig
from services.executor.model.errors import UnsupportedModelError

__all__ = ["Comm", "DistComm", "ShardPlan", "SingleComm", "WorkerLost"]


class WorkerLost(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the executor cannot go on."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds. Heads and rows are given as (first global index,
    count held); ``*_rows`` counts include the zero padding, ``num_real_*`` do not.
    ``intermediate_*`` cut the dense MLPs, ``moe_intermediate_*`` every expert of the
    mixture-of-experts layers (all zero without experts)."""

    rank: int
    size: int
    num_heads: int
    q_head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_rows: int
    intermediate_start: int
    vocab_rows: int
    vocab_start: int
    total_intermediate: int
    total_vocab: int
    moe_intermediate_rows: int = 0
    moe_intermediate_start: int = 0
    total_moe_intermediate: int = 0

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> ShardPlan:
        """The shard of ``rank``; raises :class:`UnsupportedModelError` when the heads cannot
        be split evenly over ``size`` ranks."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size}: need 0 <= rank < size")
        nh, nkv = config.num_heads, config.num_kv_heads
        if nh % size:
            raise UnsupportedModelError(
                f"num_attention_heads={nh} is not divisible by --tensor-parallel-size={size}"
            )
        if nkv >= size:
            if nkv % size:
                raise UnsupportedModelError(
                    f"num_key_value_heads={nkv} is not divisible by --tensor-parallel-size={size}"
                )
            local_kv, kv_start = nkv // size, rank * (nkv // size)
        else:  # fewer KV heads than ranks: each KV head is replicated on size/nkv ranks
            if size % nkv:
                raise UnsupportedModelError(
                    f"--tensor-parallel-size={size} is not a multiple of "
                    f"num_key_value_heads={nkv} (needed to replicate the KV heads)"
                )
            local_kv, kv_start = 1, rank // (size // nkv)
        inter = _ceil_div(config.intermediate_size, size)
        vocab = _ceil_div(config.vocab_size, size)
        moe_total = config.moe.intermediate_size if config.moe is not None else 0
        moe_inter = _ceil_div(moe_total, size)
        return cls(
            rank=rank,
            size=size,
            num_heads=nh // size,
            q_head_start=rank * (nh // size),
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            intermediate_rows=inter,
            intermediate_start=rank * inter,
            vocab_rows=vocab,
            vocab_start=rank * vocab,
            total_intermediate=config.intermediate_size,
            total_vocab=config.vocab_size,
            moe_intermediate_rows=moe_inter,
            moe_intermediate_start=rank * moe_inter,
            total_moe_intermediate=moe_total,
        )

    @property
    def num_real_intermediate(self) -> int:
        """Intermediate rows of the checkpoint this rank holds (the rest is padding)."""
        return max(
            0, min(self.intermediate_rows, self.total_intermediate - self.intermediate_start)
        )

    @property
    def num_real_moe_intermediate(self) -> int:
        """Rows of each expert's intermediate width this rank holds (the rest is padding)."""
        return max(
            0,
            min(
                self.moe_intermediate_rows,
                self.total_moe_intermediate - self.moe_intermediate_start,
            ),
        )

    @property
    def num_real_vocab(self) -> int:
        """Vocabulary rows of the checkpoint this rank holds (the rest is padding)."""
        return max(0, min(self.vocab_rows, self.total_vocab - self.vocab_start))

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's heads, MLP width and experts' width (what its layers
        and its KV-cache shard are built from); the vocabulary and everything else stay
        global."""
        moe = config.moe
        return replace(
            config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_rows,
            moe=None if moe is None else replace(moe, intermediate_size=self.moe_intermediate_rows),
        )


class Comm(Protocol):
    """The collectives of one tensor-parallel group, as the sharded model sees them."""

    rank: int
    size: int

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        ...

    def gather_last_dim(self, x: Tensor) -> Tensor:
        """Rank 0 gets the ranks' ``x`` concatenated along the last dimension, in rank
        order; the other ranks get ``x`` back (and must not use it)."""
        ...

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""
        ...


class SingleComm:
    """One rank: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def gather_last_dim(self, x: Tensor) -> Tensor:
        return x

    def min_int(self, value: int) -> int:
        return value


class DistComm:
    """Collectives of the default ``torch.distributed`` process group (initialised by the
    caller). A failed collective (a peer died, or the group's timeout passed) raises
    :class:`WorkerLost`. On the CPU, the wall time spent in collectives is accumulated in
    :attr:`collective_s` (on CUDA the ops are asynchronous and it is not measured)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where collective buffers live (CUDA for NCCL)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.num_all_reduces = 0
        self.collective_s = 0.0

    def all_reduce(self, x: Tensor) -> Tensor:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:
            raise WorkerLost(f"all_reduce failed on rank {self.rank}: {exc}") from exc
        self.num_all_reduces += 1
        self.collective_s += time.perf_counter() - t0
        return x

    def gather_last_dim(self, x: Tensor) -> Tensor:
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(x, parts, dst=0)
        except RuntimeError as exc:
            raise WorkerLost(f"gather failed on rank {self.rank}: {exc}") from exc
        self.collective_s += time.perf_counter() - t0
        return x if parts is None else torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
        except RuntimeError as exc:
            raise WorkerLost(f"all_reduce(MIN) failed on rank {self.rank}: {exc}") from exc
        return int(x.item())
