"""A model-free runner that still exercises paging for real.

It keeps a token-level "KV cache" (slot -> token id) and, on every forward, reads each
sequence's whole context back through its block table and asserts it is exactly the
sequence's own tokens: a wrong block table, a missed copy-on-write, a prefix hit on the wrong
block or a preemption that lost state shows up as an assertion, not as a silently different
output. The next token is a hash of the context read from the cache, so outputs also diverge
from :func:`reference_tokens` if anything is off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.executor.model.forward_batch import BatchBuilder, PreparedForward, SeqChunk

VOCAB = 101


def next_token(context: Sequence[int]) -> int:
    acc = 0
    for i, t in enumerate(context):
        acc = (acc * 31 + (i + 1) * (t + 7)) % 1_000_003
    return 3 + acc % (VOCAB - 3)  # never 0..2 (pad / bos / eos)


def reference_tokens(prompt: Sequence[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakePagedRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache: dict[int, int] = {}
        self.calls: list[list[tuple[int, int]]] = []  # per forward: (num_computed, num_new)
        self.num_copies = 0

    def _slot(self, table: Sequence[int], pos: int) -> int:
        block = table[pos // self.block_size]
        assert 0 < block < self.num_blocks, f"block {block} out of range or reserved"
        return block * self.block_size + pos % self.block_size

    def move_blocks(
        self,
        offloads: Sequence[tuple[int, int]],
        onboards: Sequence[tuple[int, int]],
        spills: Sequence[tuple[int, int]] = (),
        loads: Sequence[tuple[int, int]] = (),
        stores: Sequence[tuple[int, int]] = (),
    ) -> None:
        host = self.__dict__.setdefault("host", {})
        disk = self.__dict__.setdefault("disk", {})
        for src, dst in spills:
            for off in range(self.block_size):
                disk[(dst, off)] = host.get((src, off))
        for block, slot in offloads:
            for off in range(self.block_size):
                host[(slot, off)] = self.cache.get(block * self.block_size + off)
        for block, slot in stores:
            for off in range(self.block_size):
                disk[(slot, off)] = self.cache.get(block * self.block_size + off)
        for block, slot in onboards:
            self._fill(block, [host.get((slot, off)) for off in range(self.block_size)])
        for slot, block in loads:
            self._fill(block, [disk.get((slot, off)) for off in range(self.block_size)])

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in pairs:
            self.num_copies += 1
            self._fill(dst, [self.cache.get(src * bs + off) for off in range(bs)])

    def _fill(self, block: int, values: list[int | None]) -> None:
        """Write a block's slots (None: never written, so unset)."""
        for off, value in enumerate(values):
            if value is None:
                self.cache.pop(block * self.block_size + off, None)
            else:
                self.cache[block * self.block_size + off] = value

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        rows = []
        self.calls.append([(c.num_computed_tokens, len(c.token_ids)) for c in chunks])
        for c in chunks:
            context = [
                self.cache.get(self._slot(c.block_table, p)) for p in range(c.num_computed_tokens)
            ]
            assert None not in context, "context slot never written"
            for i, t in enumerate(c.token_ids):
                self.cache[self._slot(c.block_table, c.num_computed_tokens + i)] = t
            if c.need_logits:
                logits = torch.full((VOCAB,), -1e4)
                logits[next_token([*context, *c.token_ids])] = 0.0  # type: ignore[list-item]
                rows.append(logits)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class PreparingFakeRunner(FakePagedRunner):
    """The fake runner in two halves, as ``ModelRunner``: ``prepare`` builds the real packed
    host batch, ``launch`` runs from that batch alone (after the engine completed it), so a
    wrong token, position, slot or logits row there shows up as here. A row whose slots are
    all -1 (a sequence that ended after the batch was built) writes nothing and gets
    all-equal logits."""

    def __init__(
        self, num_blocks: int, block_size: int, *, launch_returns_early: bool = False
    ) -> None:
        super().__init__(num_blocks, block_size)
        self.builder = BatchBuilder(block_size, "cpu", num_blocks=num_blocks, vocab_size=VOCAB)
        self.launch_returns_early = launch_returns_early  # as on CUDA: plan ahead after it

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        return self.launch(self.prepare(chunks))

    def prepare(self, chunks: Sequence[SeqChunk]) -> PreparedForward:
        return self.builder.prepare(chunks)

    def launch(self, prepared: PreparedForward) -> torch.Tensor:
        batch = self.builder.upload(prepared.host)
        ids, pos, slots = batch.input_ids.tolist(), batch.positions.tolist(), batch.slot_mapping
        qsl, tables = batch.query_start_loc.tolist(), batch.block_tables.tolist()
        logit_rows = set(batch.logits_indices.tolist())
        rows, call = [], []
        for b in range(batch.num_seqs):
            s, e = qsl[b], qsl[b + 1]
            start, table = pos[s], tables[b]
            dead = bool((slots[s:e] == -1).all())
            logits = torch.full((VOCAB,), -1e4)
            if not dead:
                call.append((start, e - s))
                for i in range(s, e):
                    assert int(slots[i]) == self._slot(table, pos[i]), "slot != table / position"
                context = [self.cache.get(self._slot(table, p)) for p in range(start)]
                assert None not in context, "context slot never written"
                for i in range(s, e):
                    self.cache[int(slots[i])] = ids[i]
                logits[next_token([*context, *ids[s:e]])] = 0.0  # type: ignore[list-item]
            if e - 1 in logit_rows:
                rows.append(logits)
        self.calls.append(call)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)
