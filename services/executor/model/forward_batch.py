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
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from services.common.blocks import NULL_BLOCK, blocks_for_tokens
from services.executor.model.host_block_tables import HostBlockTables

__all__ = [
    "BatchBuilder",
    "BatchLayout",
    "ForwardBatch",
    "GraphKey",
    "HostBatch",
    "PreparedForward",
    "SeqChunk",
    "build_forward_batch",
]


class SeqChunk(NamedTuple):
    """What one sequence computes in this step.

    ``token_ids`` are the tokens to run now; they occupy positions ``num_computed_tokens ..
    num_computed_tokens + len(token_ids) - 1``. The first ``num_computed_tokens`` tokens'
    K/V are already in the cache (an earlier step, or blocks shared through the prefix cache).
    ``block_table`` maps the sequence's logical blocks to physical block ids and must cover
    every position up to the last new token. It is mirrored across steps by identity: **a
    table passed again as the same object must only have been appended to** (any other
    change comes as a new list; see :mod:`.host_block_tables`). ``need_logits``: return the
    logits of the last token of the chunk (false for a prefill chunk that does not end the
    prompt). ``all_logits``: return the logits of every token of the chunk (prompt
    log-probabilities), in token order; the last is the one ``need_logits`` asks for.
    ``group_tables``: in a hybrid KV cache (several KV-cache groups), the sequence's table in
    each group, ``block_table`` being the first (mirrored by identity alike); empty otherwise.
    ``lora_id``: the LoRA adapter its rows apply (0: the base model).
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_table: Sequence[int]
    need_logits: bool = True
    all_logits: bool = False
    group_tables: Sequence[Sequence[int]] = ()
    lora_id: int = 0


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
    # A hybrid KV cache: per KV-cache group, its block tables [G, B, max_blocks] and cache
    # slots [G, T] (block_tables and slot_mapping are group 0's). None with one group.
    group_block_tables: Tensor | None = None
    group_slot_mapping: Tensor | None = None

    def tables_of(self, group: int) -> tuple[Tensor, Tensor]:
        """KV-cache group ``group``'s block tables and cache slots (a batch of one group
        serves every group the same)."""
        if self.group_block_tables is None or self.group_slot_mapping is None:
            return self.block_tables, self.slot_mapping
        return self.group_block_tables[group], self.group_slot_mapping[group]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class BatchLayout:
    """Where each tensor of a :class:`ForwardBatch` lives in the two packed buffers that cross
    to the device (one int64, one int32): the same layout for every batch of one shape, so a
    captured CUDA graph can read its inputs from fixed addresses."""

    num_tokens: int
    num_seqs: int
    table_width: int  # blocks per block-table row
    num_logits: int
    num_groups: int = 1  # KV-cache groups: a table row and a slot per token in each

    @property
    def sizes64(self) -> tuple[int, int, int, int]:  # ids, positions, slots, logits indices
        t = self.num_tokens
        return (t, t, self.num_groups * t, self.num_logits)

    @property
    def sizes32(self) -> tuple[int, int, int]:  # block tables, query_start_loc, seq_lens
        b = self.num_seqs
        return (self.num_groups * b * self.table_width, b + 1, b)

    def views(
        self, buf64: Tensor, buf32: Tensor, max_query_len: int, max_seq_len: int
    ) -> ForwardBatch:
        """The batch as views into the packed buffers (which may be longer)."""
        ids, pos, slots, logits_idx = buf64[: sum(self.sizes64)].split(self.sizes64)
        tables, qsl, lens = buf32[: sum(self.sizes32)].split(self.sizes32)
        groups = self.num_groups
        group_tables = tables.view(groups, self.num_seqs, self.table_width)
        group_slots = slots.view(groups, self.num_tokens)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            slot_mapping=group_slots[0],
            block_tables=group_tables[0],
            query_start_loc=qsl,
            seq_lens=lens,
            logits_indices=logits_idx,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            group_block_tables=group_tables if groups > 1 else None,
            group_slot_mapping=group_slots if groups > 1 else None,
        )


@dataclass(frozen=True)
class HostBatch:
    """A batch built on the host: the packed buffers and their layout."""

    layout: BatchLayout
    packed64: np.ndarray
    packed32: np.ndarray
    max_query_len: int
    max_seq_len: int
    num_rows: int  # the logits rows of the chunks (padding's come after them)
    # Padded query lengths (a verification graph): the token rows of the chunks' own tokens.
    own_rows: np.ndarray | None = None

    def _token_span(self, chunk: int) -> tuple[int, int]:
        qsl = self._qsl_offset
        return int(self.packed32[qsl + chunk]), int(self.packed32[qsl + chunk + 1])

    @property
    def _qsl_offset(self) -> int:
        lay = self.layout
        return lay.num_groups * lay.num_seqs * lay.table_width  # then query_start_loc

    def set_last_tokens(self, chunks: Sequence[int], tokens: Sequence[int]) -> None:
        """Set the last input token of each of ``chunks`` (built before it was known)."""
        if not chunks:
            return
        ends = self.packed32[self._qsl_offset + 1 + np.asarray(chunks, np.intp)]
        self.packed64[ends.astype(np.intp) - 1] = tokens

    def write_nothing(self, chunk: int) -> None:
        """Make ``chunk`` write no K/V (its sequence ended after the batch was built): its
        tokens still run, reading its blocks, and its logits are to be ignored."""
        start, end = self._token_span(chunk)
        t = self.layout.num_tokens
        for g in range(self.layout.num_groups):
            slots = 2 * t + g * t  # ids, positions, then each group's slots
            self.packed64[slots + start : slots + end] = -1


class GraphKey(NamedTuple):
    """A captured forward: ``num_seqs`` sequences of ``query_len`` tokens each (1: decode;
    1 + k: verifying k drafts)."""

    num_seqs: int
    query_len: int = 1


@dataclass(frozen=True)
class PreparedForward:
    """A forward whose host batch is built (``ModelRunner.prepare``) but not yet run: ``host``
    may still be patched (:meth:`HostBatch.set_last_tokens`, :meth:`HostBatch.write_nothing`)
    before ``ModelRunner.launch``."""

    host: HostBatch
    graph: GraphKey | None  # the captured graph that runs it, or None: eager
    num_chunks: int
    lora_rows: np.ndarray | None = None  # [T] the adapter of each token row (multi-LoRA)


class BatchBuilder:
    """Builds the forward batches of one runner.

    Host work is vectorised with numpy (no per-token Python). Everything crosses to the
    device as two packed buffers, one int64 and one int32, so no cast runs on the device. On
    CUDA they are staged in pinned memory (two alternating buffers, each reused only once its
    last copy has completed) and copied without blocking the host.

    The optional limits turn what would be an out-of-bounds access on the device into a
    ``ValueError`` here: block ids must lie in ``[1, num_blocks)`` (block 0 is the reserved
    padding block), context lengths must not exceed ``max_model_len``, token ids must lie in
    ``[0, vocab_size)``.
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        *,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        num_groups: int = 1,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_groups = num_groups  # KV-cache groups: chunks carry group_tables when > 1
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._staging = _PinnedStaging() if self.device.type == "cuda" else None
        self._tables = HostBlockTables(num_blocks=num_blocks)

    def prepare(self, chunks: Sequence[SeqChunk]) -> PreparedForward:
        """``chunks`` built on the host for an eager forward, to be uploaded later."""
        return PreparedForward(self.build_host(chunks), None, len(chunks))

    def build(self, chunks: Sequence[SeqChunk]) -> ForwardBatch:
        """Flatten ``chunks`` (in order) into a :class:`ForwardBatch` on the device."""
        host = self.build_host(chunks)
        return self.upload(host)

    def upload(self, host: HostBatch, into: tuple[Tensor, Tensor] | None = None) -> ForwardBatch:
        """Copy ``host`` to the device: into fresh tensors, or into the prefixes of the given
        persistent (int64, int32) device buffers."""
        d64, d32 = self.upload_packed(host, into)
        return host.layout.views(d64, d32, host.max_query_len, host.max_seq_len)

    def upload_packed(
        self, host: HostBatch, into: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Copy ``host``'s packed buffers to the device (as :meth:`upload`); returns the
        device copies, exactly as long as the host buffers."""
        a64, a32 = host.packed64, host.packed32
        if self._staging is not None:
            t64, t32 = self._staging.stage(a64, a32)
        else:
            t64, t32 = torch.from_numpy(a64), torch.from_numpy(a32)
        if into is None:
            d64 = t64.to(self.device, non_blocking=True)
            d32 = t32.to(self.device, non_blocking=True)
        else:
            d64, d32 = into[0][: a64.size], into[1][: a32.size]
            d64.copy_(t64, non_blocking=True)
            d32.copy_(t32, non_blocking=True)
        if self._staging is not None:
            self._staging.record()
        return d64, d32

    def build_host(
        self,
        chunks: Sequence[SeqChunk],
        *,
        pad_to_seqs: int | None = None,
        table_width: int | None = None,
        pad_query_to: int = 1,
    ) -> HostBatch:
        """The packed host buffers of ``chunks``. ``pad_to_seqs`` appends padding sequences of
        one token each (written nowhere, reading one slot of the reserved block 0) up to that
        many sequences; ``table_width`` fixes the block-table width (for a captured graph).
        ``pad_query_to`` > 1 (a verification graph): every sequence, padding ones included,
        gets that many query tokens, a chunk's own first; the tokens added after a chunk's
        run at the next positions, write nowhere and have no logits row (a causal query never
        reads a later position, so the chunk's rows are what they are without them). The
        logits rows of the chunks come first, then the padding's, ``pad_to_seqs *
        pad_query_to`` in all."""
        if not chunks and not pad_to_seqs:
            raise ValueError("empty batch: no chunks")
        bs = self.block_size
        num_real = len(chunks)
        num_seqs = max(num_real, pad_to_seqs or 0)
        padded = pad_query_to > 1

        # One C-level transpose of the chunks into columns; no Python loop per chunk below.
        token_col, computed_col, table_col, need_col, all_col, group_col, _ = (
            zip(*chunks, strict=True) if chunks else ((), (), (), (), (), (), ())
        )
        groups = self.num_groups
        if groups > 1 and any(len(t) != groups for t in group_col):
            b = next(i for i, t in enumerate(group_col) if len(t) != groups)
            raise ValueError(f"chunk {b}: {len(group_col[b])} group tables for {groups} groups")
        q_real = np.zeros(num_seqs, np.int64)  # each sequence's own tokens (padding: none)
        q_real[:num_real] = np.fromiter(map(len, token_col), np.int64, num_real)
        num_computed = np.zeros(num_seqs, np.int64)
        num_computed[:num_real] = computed_col
        if (q_real[:num_real] <= 0).any():
            raise ValueError(f"chunk {int(np.argmax(q_real[:num_real] <= 0))} has no tokens")
        if (num_computed < 0).any():
            raise ValueError(
                f"chunk {int(np.argmax(num_computed < 0))}: negative num_computed_tokens"
            )
        if padded and (q_real > pad_query_to).any():
            b = int(np.argmax(q_real > pad_query_to))
            raise ValueError(f"chunk {b}: {q_real[b]} tokens over pad_query_to={pad_query_to}")
        q_lens = np.full(num_seqs, pad_query_to, np.int64)
        if not padded:
            q_lens[:num_real] = q_real[:num_real]
        seq_lens = num_computed + q_lens  # [B]
        if self.max_model_len is not None and (seq_lens > self.max_model_len).any():
            b = int(np.argmax(seq_lens > self.max_model_len))
            raise ValueError(
                f"chunk {b}: length {seq_lens[b]} exceeds max_model_len={self.max_model_len}"
            )
        query_start_loc = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        num_real_tokens = int(q_real.sum())
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # [T]
        # The chunks' own tokens: a prefix of the batch, or (padded) each sequence's first.
        own_mask = (
            np.arange(num_tokens) - query_start_loc[seq_of_token] < q_real[seq_of_token]
            if padded
            else None
        )
        own = own_mask if own_mask is not None else slice(0, num_real_tokens)

        # Block tables, truncated to the blocks this step touches, padded with block 0.
        blocks_needed = blocks_for_tokens(num_computed + q_real, bs)  # [B]
        blocks_needed[num_real:] = 0  # padding sequences read block 0 through an empty row
        table_lens = np.fromiter(map(len, table_col), np.int64, num_real)
        short = table_lens < blocks_needed[:num_real]
        if short.any():
            b = int(np.argmax(short))
            raise ValueError(
                f"chunk {b}: block table has {table_lens[b]} blocks, {blocks_needed[b]} needed "
                f"for {seq_lens[b]} tokens at block_size={bs}"
            )
        max_blocks = max(int(blocks_needed.max()), 1)
        width = max_blocks if table_width is None else table_width
        if width < max_blocks:
            raise ValueError(f"table_width={width} < {max_blocks} blocks needed")
        need_logits = np.full(num_seqs, not padded, np.bool_)  # (padding sequences' rows)
        need_logits[:num_real] = need_col
        ends = query_start_loc[:-1] + q_real if padded else query_start_loc[1:]
        logits_indices = ends[need_logits] - 1  # [K]
        if any(all_col):  # every token's logits for these chunks, in token order
            want = np.zeros(num_tokens, np.bool_)
            want[logits_indices] = True
            for b in np.flatnonzero(np.fromiter(all_col, np.bool_, num_real)).tolist():
                want[query_start_loc[b] : query_start_loc[b] + q_real[b]] = True
            logits_indices = np.flatnonzero(want)
        # (padded, padding sequences want no row; unpadded, one each)
        num_rows = int(logits_indices.size) - (0 if padded else num_seqs - num_real)
        if padded:  # a fixed number of rows: the chunks', then row 0 repeated
            rows = np.zeros(num_tokens, np.int64)
            rows[:num_rows] = logits_indices[:num_rows]
            logits_indices = rows
        layout = BatchLayout(num_tokens, num_seqs, width, int(logits_indices.size), groups)

        packed64 = np.empty(sum(layout.sizes64), np.int64)
        packed32 = np.empty(sum(layout.sizes32), np.int32)
        ids, pos, slots, logits_idx = _split(packed64, layout.sizes64)
        tables_flat, qsl, lens = _split(packed32, layout.sizes32)

        if padded:
            ids[:] = 0
        else:
            ids[num_real_tokens:] = 0
        ids[own] = np.fromiter(itertools.chain.from_iterable(token_col), np.int64, num_real_tokens)
        if self.vocab_size is not None:
            bad = (ids < 0) | (ids >= self.vocab_size)
            if bad.any():
                raise ValueError(
                    f"token id {int(ids[bad][0])} outside the vocabulary [0, {self.vocab_size})"
                )

        all_tables = tables_flat.reshape(groups, num_seqs, width)
        group_slots = slots.reshape(groups, num_tokens)
        pos[:] = np.arange(num_tokens) - query_start_loc[seq_of_token] + num_computed[seq_of_token]
        store = self._tables
        if num_real and groups > 1:  # every group's tables in one build of the row store
            flat = [t[g] for g in range(groups) for t in group_col]
            flat_lens = np.fromiter(map(len, flat), np.int64, len(flat))
            bad = flat_lens != np.tile(table_lens, groups)
            if bad.any():
                g, b = divmod(int(np.argmax(bad)), num_real)
                raise ValueError(f"chunk {b}: group {g}'s table has another length")
            all_rows = store.rows(flat, flat_lens).reshape(groups, num_real)
        elif num_real:
            all_rows = store.rows(table_col, table_lens).reshape(1, num_real)
        for g in range(groups):
            tables = all_tables[g]
            if num_real:
                rows = all_rows[g]
                w = min(width, store.width)
                tables[:num_real, :w] = store.ids[rows, :w]  # zero past each table's end
                tables[:num_real, w:] = 0
                if (table_lens > blocks_needed[:num_real]).any():  # blocks not touched now
                    untouched = np.arange(width)[None, :] >= blocks_needed[:num_real, None]
                    tables[:num_real][untouched] = 0
            tables[num_real:] = 0
            # Per-token cache slots; padding tokens write nowhere (slot -1).
            group_slot = group_slots[g]
            group_slot[:] = tables[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
            null = group_slot[own] < bs  # null entries are released: never written
            if null.any():
                b = int(seq_of_token[own][int(np.argmax(null))])
                raise ValueError(f"chunk {b}: a token's block is the null block {NULL_BLOCK}")
            if own_mask is not None:
                group_slot[~own_mask] = -1
            else:
                group_slot[num_real_tokens:] = -1
        if padded:
            pos[query_start_loc[num_real] :] = 0
        else:
            pos[num_real_tokens:] = 0
        logits_idx[:] = logits_indices
        qsl[:] = query_start_loc
        lens[:] = seq_lens
        own_rows = np.flatnonzero(own_mask) if own_mask is not None else None
        return HostBatch(
            layout, packed64, packed32, int(q_lens.max()), int(seq_lens.max()), num_rows, own_rows
        )


def _split(buf: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Consecutive views of ``buf`` of the given sizes (``np.split`` costs 15 us)."""
    views, start = [], 0
    for size in sizes:
        views.append(buf[start : start + size])
        start += size
    return views


class _PinnedStaging:
    """Two alternating pinned host buffer pairs for non-blocking uploads. A pair is written
    again only after the event recorded behind its last copy has completed."""

    def __init__(self) -> None:
        self._bufs: list[tuple[Tensor, Tensor] | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def stage(self, a64: np.ndarray, a32: np.ndarray) -> tuple[Tensor, Tensor]:
        i = self._turn
        event = self._events[i]
        if event is not None:
            event.synchronize()
        bufs = self._bufs[i]
        if bufs is None or bufs[0].numel() < a64.size or bufs[1].numel() < a32.size:
            n64, n32 = max(a64.size, 1 << 12), max(a32.size, 1 << 14)
            if bufs is not None:
                n64, n32 = max(n64, 2 * bufs[0].numel()), max(n32, 2 * bufs[1].numel())
            bufs = (
                torch.empty(n64, dtype=torch.int64, pin_memory=True),
                torch.empty(n32, dtype=torch.int32, pin_memory=True),
            )
            self._bufs[i] = bufs
        t64, t32 = bufs[0][: a64.size], bufs[1][: a32.size]
        t64.numpy()[:] = a64
        t32.numpy()[:] = a32
        return t64, t32

    def record(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self._events[self._turn] = event
        self._turn ^= 1


def build_forward_batch(
    chunks: Sequence[SeqChunk],
    block_size: int,
    device: torch.device | str,
    *,
    num_blocks: int | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
) -> ForwardBatch:
    """One batch through a one-off :class:`BatchBuilder` (tests, profiling)."""
    builder = BatchBuilder(
        block_size,
        device,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
    )
    return builder.build(chunks)
