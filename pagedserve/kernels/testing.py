"""Builders of random paged batches, shared by the kernel tests and ``bench.internals.gpu_check``.

A batch is described by one ``(context_len, query_len)`` pair per sequence:
``(0, n)`` is a fresh prefill, ``(c, 1)`` a decode step after ``c`` tokens, ``(c, n)``
a prefill chunk or a prefill after a ``c``-token prefix-cache hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MIXED_BATCH",
    "PAIRWISE_CASES",
    "TOLERANCES",
    "KernelCase",
    "PagedBatch",
    "dense_attention",
    "make_paged_batch",
]

# Kernel vs reference, both accumulating in fp32. fp16/bf16 differ by output rounding
# and by P being rounded to the cache dtype before the PV product.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 5e-5, "rtol": 5e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}

# One flattened batch with every kind of sequence, lengths not aligned to blocks:
# fresh prefill, decodes (one right after a block boundary), a prefill after a cached
# prefix spanning several blocks, a one-token prompt.
MIXED_BATCH: tuple[tuple[int, int], ...] = ((0, 7), (37, 1), (45, 19), (16, 1), (0, 1))


@dataclass(frozen=True)
class KernelCase:
    """One point of the kernel test matrix."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def batch(
        self,
        seqs: Sequence[tuple[int, int]],
        device: str | torch.device = "cpu",
        num_pad_tokens: int = 2,
        seed: int = 0,
    ) -> PagedBatch:
        """A :func:`make_paged_batch` of this case's heads, block size and dtype."""
        return make_paged_batch(
            seqs,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            device=device,
            num_pad_tokens=num_pad_tokens,
            seed=seed,
        )

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"gqa{self.num_q_heads}:{self.num_kv_heads}-d{self.head_dim}"
            f"-bs{self.block_size}-{dtype}"
        )


# Pairwise covering array over GQA ratio {4:4, 8:2, 5:1} x head_dim {64, 128} x
# block_size {16, 32} x dtype {fp32, fp16}: every pair of values of any two factors
# appears in some case (6 cases instead of the 24 of the full product).
PAIRWISE_CASES: tuple[KernelCase, ...] = (
    KernelCase(4, 4, 64, 16, torch.float32),
    KernelCase(4, 4, 128, 32, torch.float16),
    KernelCase(8, 2, 64, 32, torch.float32),
    KernelCase(8, 2, 128, 16, torch.float16),
    KernelCase(5, 1, 64, 16, torch.float16),
    KernelCase(5, 1, 128, 32, torch.float32),
)


@dataclass
class PagedBatch:
    """Inputs of one paged-attention call (field names follow the op's arguments)."""

    query: Tensor  # [T, Hq, D]
    key_cache: Tensor  # [NB, BS, Hkv, D]
    value_cache: Tensor  # [NB, BS, Hkv, D]
    block_tables: Tensor  # [B, max_blocks] int32, unused entries = block 0
    query_start_loc: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    slot_mapping: Tensor  # [T] int64: cache slot of each query token, -1 for padding rows
    max_query_len: int
    max_seq_len: int
    scale: float

    def args(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float]:
        """Positional arguments of ``paged_attention``."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
        )

    def hints(self) -> dict[str, int]:
        return {"max_query_len": self.max_query_len, "max_seq_len": self.max_seq_len}


def make_paged_batch(
    seqs: Sequence[tuple[int, int]],  # (context_len, query_len) per sequence
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_pad_tokens: int = 0,
    extra_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """A random batch whose sequences own shuffled, non-contiguous physical blocks.

    Every cache block (also unowned ones and reserved block 0) holds random values, so a
    kernel that reads a wrong block gives a wrong answer rather than a lucky zero. Block
    tables are padded with block 0. ``num_pad_tokens`` zero query rows are appended
    after the last sequence (batch padding, slot -1).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in seqs]
    max_blocks = max([*blocks_per_seq, 1])
    num_blocks = 1 + sum(blocks_per_seq) + extra_blocks
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    next_block = 0
    for b, ((context_len, q_len), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        owned = physical[next_block : next_block + nb]
        next_block += nb
        block_tables[b, :nb] = torch.tensor(owned, dtype=torch.int32)
        for pos in range(context_len, context_len + q_len):
            slots.append(owned[pos // block_size] * block_size + pos % block_size)
    slots += [-1] * num_pad_tokens
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    num_tokens = int(query_start_loc[-1]) + num_pad_tokens
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    query = rand(num_tokens, num_q_heads, head_dim)
    query[num_tokens - num_pad_tokens :] = 0
    return PagedBatch(
        query=query.to(device),
        key_cache=rand(*cache_shape).to(device),
        value_cache=rand(*cache_shape).to(device),
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max([q for _, q in seqs], default=0),
        max_seq_len=max([c + q for c, q in seqs], default=0),
        scale=head_dim**-0.5,
    )


def dense_attention(batch: PagedBatch) -> Tensor:  # [T, Hq, D] fp32
    """Naive oracle for the oracle: per token and head, softmax over visible keys.

    Reads the cache slot by slot through the block table with plain Python loops and
    fp64 math; only for tiny batches.
    """
    q_all = batch.query.double().cpu()
    key_cache = batch.key_cache.double().cpu()
    value_cache = batch.value_cache.double().cpu()
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q_all.shape[1] // num_kv_heads
    starts = batch.query_start_loc.tolist()
    out = torch.zeros_like(q_all)
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[b].tolist()
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            t = starts[b] + i
            pos = seq_len - q_len + i
            for h in range(q_all.shape[1]):
                kvh = h // group
                keys = torch.stack(
                    [key_cache[table[j // block_size], j % block_size, kvh] for j in range(pos + 1)]
                )
                values = torch.stack(
                    [
                        value_cache[table[j // block_size], j % block_size, kvh]
                        for j in range(pos + 1)
                    ]
                )
                weights = torch.softmax(keys @ q_all[t, h] * batch.scale, dim=0)
                out[t, h] = weights @ values
    return out.float()
