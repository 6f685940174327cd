"""The flattened batch of one forward pass, and its builder from per-sequence descriptions.

One step mixes decode tokens, prefill chunks and prefills that resume after a prefix-cache
hit. All their query tokens are concatenated into one ``[T]`` token axis; per-sequence
metadata (block tables, query offsets, context lengths) tells attention where each sequence's
tokens and context live. This is the only layout the model and the kernels see.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["ForwardBatch", "SeqChunk", "build_forward_batch"]


@dataclass(frozen=True)
class SeqChunk:
    """What one sequence computes in this step.

    ``token_ids`` are the tokens to run now; they occupy positions ``num_computed_tokens ..
    num_computed_tokens + len(token_ids) - 1``. The first ``num_computed_tokens`` tokens'
    K/V are already in the cache (an earlier step, or blocks shared through the prefix cache).
    ``block_table`` maps the sequence's logical blocks to physical block ids and must cover
    every position up to the last new token. ``need_logits``: return the logits of the
    last token of the chunk (false for a prefill chunk that does not end the prompt).
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_table: Sequence[int]
    need_logits: bool = True


@dataclass(frozen=True)
class ForwardBatch:
    """Device tensors for one forward pass over ``T`` tokens of ``B`` sequences."""

    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: Tensor  # [T] int64, cache slot (block_id * block_size + offset) to write
    block_tables: Tensor  # [B, max_blocks] int32, padded with block 0
    query_start_loc: Tensor  # [B + 1] int32, sequence b's tokens are [qsl[b], qsl[b+1])
    seq_lens: Tensor  # [B] int32, context length after this step (computed + new)
    logits_indices: Tensor  # [K] int64, rows of the token axis whose logits are returned
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def build_forward_batch(
    chunks: Sequence[SeqChunk],
    block_size: int,
    device: torch.device | str,
    *,
    num_blocks: int | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
) -> ForwardBatch:
    """Flatten ``chunks`` (in order) into a :class:`ForwardBatch` on ``device``.

    Host work is vectorised with numpy (no per-token Python) and everything crosses to the
    device as one int64 buffer. The optional limits turn what would be an out-of-bounds
    access on the device into a ``ValueError`` here: block ids must lie in
    ``[1, num_blocks)`` (block 0 is the reserved padding block), context lengths must not
    exceed ``max_model_len``, token ids must lie in ``[0, vocab_size)``.
    """
    if not chunks:
        raise ValueError("empty batch: no chunks")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_seqs = len(chunks)

    q_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, num_seqs)
    num_computed = np.fromiter((c.num_computed_tokens for c in chunks), np.int64, num_seqs)
    if (q_lens <= 0).any():
        raise ValueError(f"chunk {int(np.argmax(q_lens <= 0))} has no tokens")
    if (num_computed < 0).any():
        raise ValueError(f"chunk {int(np.argmax(num_computed < 0))}: negative num_computed_tokens")
    seq_lens = num_computed + q_lens  # [B]
    if max_model_len is not None and (seq_lens > max_model_len).any():
        b = int(np.argmax(seq_lens > max_model_len))
        raise ValueError(f"chunk {b}: length {seq_lens[b]} exceeds max_model_len={max_model_len}")
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    input_ids = np.fromiter(
        itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, num_tokens
    )
    if vocab_size is not None and ((input_ids < 0) | (input_ids >= vocab_size)).any():
        bad = int(input_ids[(input_ids < 0) | (input_ids >= vocab_size)][0])
        raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab_size})")

    # Block tables, truncated to the blocks this step touches, padded with block 0.
    blocks_needed = -(-seq_lens // block_size)  # [B]
    table_lens = np.fromiter((len(c.block_table) for c in chunks), np.int64, num_seqs)
    if (table_lens < blocks_needed).any():
        b = int(np.argmax(table_lens < blocks_needed))
        raise ValueError(
            f"chunk {b}: block table has {table_lens[b]} blocks, {blocks_needed[b]} needed for "
            f"{seq_lens[b]} tokens at block_size={block_size}"
        )
    max_blocks = int(blocks_needed.max())
    used = np.arange(max_blocks)[None, :] < blocks_needed[:, None]  # [B, max_blocks] bool
    used_ids = np.fromiter(
        itertools.chain.from_iterable(
            c.block_table[:n] for c, n in zip(chunks, blocks_needed.tolist(), strict=True)
        ),
        np.int64,
        int(blocks_needed.sum()),
    )
    if num_blocks is not None and ((used_ids <= 0) | (used_ids >= num_blocks)).any():
        bad = int(used_ids[(used_ids <= 0) | (used_ids >= num_blocks)][0])
        raise ValueError(f"block id {bad} outside [1, {num_blocks})")
    block_tables = np.zeros((num_seqs, max_blocks), np.int64)
    block_tables[used] = used_ids  # row-major fill = concatenation order

    # Per-token positions and cache slots.
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # [T]
    positions = (
        np.arange(num_tokens) - query_start_loc[seq_of_token] + num_computed[seq_of_token]
    )  # [T]
    slot_mapping = (
        block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )  # [T]
    need_logits = np.fromiter((c.need_logits for c in chunks), np.bool_, num_seqs)
    logits_indices = query_start_loc[1:][need_logits] - 1  # [K]

    parts = (
        input_ids,
        positions,
        slot_mapping,
        block_tables.ravel(),
        query_start_loc,
        seq_lens,
        logits_indices,
    )
    packed = torch.from_numpy(np.concatenate(parts)).to(device)
    ids, pos, slots, tables, qsl, lens, logits_idx = packed.split([p.size for p in parts])
    return ForwardBatch(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        logits_indices=logits_idx,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
