"""``ModelRunner``: the model, its paged KV cache and the step the scheduler loop calls.

The runner owns device state only. Which blocks a sequence uses is decided elsewhere (the
block manager); the scheduler hands the runner :class:`SeqChunk` descriptions that carry
those block tables, and the block pairs to copy for copy-on-write.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import structlog
import torch
from torch import Tensor

from pagedserve.kernels import ops
from services.executor.model.config import ModelConfig
from services.executor.model.cpu_threads import StepThreads
from services.executor.model.cuda_graphs import (
    DecodeGraphs,
    GraphBackend,
)
from services.executor.model.eagle import Eagle3Runner
from services.executor.model.forward_batch import (
    BatchBuilder,
    BatchLayout,
    ForwardBatch,
    GraphKey,
    HostBatch,
    PreparedForward,
    SeqChunk,
)
from services.executor.model.host_kv import HostKVCache, MoveFailures
from services.executor.model.kv_cache import kv_cache_shape
from services.executor.model.lora.slots import LoRASlots
from services.executor.model.models import DecoderLM
from services.executor.model.workers import (
    LORA_FORGET,
    LORA_MAP,
    LORA_REGISTER,
    CopyBlocksHeader,
    ForwardHeader,
    LoRAHeader,
    MoveBlocksHeader,
    Op,
    StepChannel,
    WorkerGroup,
)

__all__ = ["ModelRunner"]

log = structlog.get_logger(__name__)


class ModelRunner:
    """Runs forward passes of one model over its own KV cache. Under tensor parallelism this
    is rank 0's runner: it sends every operation to the other ranks (``workers``) before
    running its own part; the other ranks' runners follow in :meth:`serve_rank`."""

    def __init__(
        self,
        model: DecoderLM,
        kv_cache: Tensor,
        block_size: int,
        workers: WorkerGroup | None = None,
        host: HostKVCache | None = None,
    ) -> None:
        lc = model.local_config  # this rank's KV heads
        slots = model.kv_layout.num_slots
        expected = kv_cache_shape(lc, kv_cache.shape[2], block_size, kv_cache.dtype, slots)
        if tuple(kv_cache.shape) != expected:
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} != expected {expected}")
        self.model = model
        self.config: ModelConfig = model.config
        self.kv_cache = kv_cache  # [S, 2, NB, BS, Hkv, D]: a slot per layer of a KV-cache group
        self.block_size = block_size
        self.num_blocks: int = kv_cache.shape[2]
        self.device: torch.device = kv_cache.device
        self.dtype: torch.dtype = model.dtype
        self.workers = workers
        self.host = host  # the block manager's host tier, if any (one rank only)
        # Whether a Step's fills run beside the forward (see host_kv): on CUDA, where a copy
        # engine does them; one rank only (the other ranks would need the wait before each
        # forward too). On the CPU the copies would take the cores the forward computes on:
        # measured no faster (bench.internals.multiturn_bench --fills-beside).
        self.fills_async: bool = host is not None and workers is None and self.device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        # Speculative decoding's draft model (.draft), on this rank, over the same blocks:
        # block copies are made in its cache too.
        self.draft: ModelRunner | None = None
        # Or an EAGLE-3 head (.eagle, an Eagle3Runner), its one-layer cache of the same blocks.
        self.eagle: Eagle3Runner | None = None
        # Multi-LoRA serving: the adapters' device slot table (attach_lora).
        self.lora: LoRASlots | None = None
        # On the CPU with --cpu-decode-threads: fewer threads for small steps.
        self.step_threads: StepThreads | None = None
        self.builder = BatchBuilder(
            block_size,
            self.device,
            num_blocks=self.num_blocks,
            max_model_len=self.config.max_model_len,
            vocab_size=self.config.vocab_size,
            num_groups=model.kv_layout.num_groups,
        )

    def attach_lora(self, max_loras: int, max_lora_rank: int) -> LoRASlots:
        """Serve LoRA adapters: a slot table of ``max_loras`` adapters up to rank
        ``max_lora_rank`` in every projection; chunks name theirs by ``lora_id``. (One rank:
        a tensor-parallel runner gets its slots in ``build_runner``, on every rank.)"""
        if self.graphs is not None:
            raise RuntimeError("attach LoRA before capturing CUDA graphs (they do not serve it)")
        if self.workers is not None:
            raise RuntimeError("a tensor-parallel runner attaches LoRA in build_runner")
        self.use_lora(LoRASlots(self.model, max_loras, max_lora_rank))
        assert self.lora is not None
        return self.lora

    def use_lora(self, slots: LoRASlots) -> None:
        """Serve LoRA adapters from ``slots`` (rank 0 tells the other ranks what it registers
        and forgets)."""
        self.lora = slots
        if self.workers is not None:
            slots.broadcast = self._broadcast_lora

    def _broadcast_lora(self, kind: int, adapter_id: int, path: str) -> None:
        assert self.workers is not None
        data = torch.frombuffer(bytearray(path.encode()), dtype=torch.uint8) if path else None
        header = LoRAHeader(kind, adapter_id, 0 if data is None else len(data))
        self.workers.send(Op.LORA, header, () if data is None else (data.to(self.device),))
        self.workers.done()

    def capture_decode_graphs(
        self, sizes: Sequence[int], backend: GraphBackend, verify_query_len: int = 1
    ) -> None:
        """Capture the decode forward at each of ``sizes`` (and, with ``verify_query_len`` =
        1 + k, the verification of k drafts: :class:`DecodeGraphs`); the steps they serve
        replay them from then on. One rank only: under tensor parallelism every rank
        captures its own graphs at start-up, in step."""
        if self.workers is not None:
            raise RuntimeError("a tensor-parallel runner captures its graphs in build_runner")
        self.capture(sizes, backend, verify_query_len)

    def capture(
        self, sizes: Sequence[int], backend: GraphBackend, verify_query_len: int = 1
    ) -> None:
        """Capture the decode graphs of ``sizes`` (every rank, in step)."""
        graphs = DecodeGraphs(
            self.model, self.kv_cache, self.builder, sizes, backend, verify_query_len
        )
        on_cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        graphs.capture()
        used = torch.cuda.memory_reserved(self.device) - before if on_cuda else 0
        log.info(
            "cuda_graphs_captured",
            sizes=list(graphs.sizes),
            verify_sizes=list(graphs.verify_sizes),
            verify_query_len=graphs.verify_query_len,
            seconds=round(graphs.capture_s, 2),
            memory_bytes=used,
        )
        self.graphs = graphs

    @property
    def aux_hidden(self) -> Tensor | None:
        """The last forward's features for an EAGLE-3 head (:attr:`DecoderLM.aux_hidden`)."""
        return self.model.aux_hidden

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def execute(self, chunks: Sequence[SeqChunk]) -> Tensor:
        """One forward pass over ``chunks``; returns fp32 logits ``[K, vocab]``: one row per
        chunk with ``need_logits``, or one per token of a chunk with ``all_logits``, in chunk
        order.

        Writes the new tokens' K/V into the cache slots their block tables name.
        """
        return self.launch(self.prepare(chunks))

    def prepare(self, chunks: Sequence[SeqChunk]) -> PreparedForward:
        """The host half of :meth:`execute`: the batch built on the host, nothing on the
        device (so it can run while the device computes the step before)."""
        if self.lora is not None:  # (no graphs: the rows' slots change every step)
            prepared = self.builder.prepare(chunks)
            ids = [c.lora_id for c in chunks]
            if not any(ids):
                return prepared  # the base model's rows only
            rows = np.repeat(np.array(ids, dtype=np.int64), [len(c.token_ids) for c in chunks])
            return dataclasses.replace(prepared, lora_rows=rows)
        graphs = self.graphs
        key = graphs.bucket(chunks) if graphs is not None else None
        if key is None:
            return self.builder.prepare(chunks)
        assert graphs is not None
        return PreparedForward(graphs.host_batch(chunks, key), key, len(chunks))

    @torch.inference_mode()
    def launch(self, prepared: PreparedForward) -> Tensor:
        """The device half of :meth:`execute`: upload, (broadcast to the other ranks,) run."""
        host, key, graphs = prepared.host, prepared.graph, self.graphs
        if key is None:
            d64, d32 = self.builder.upload_packed(host)
        else:
            assert graphs is not None
            d64, d32 = self.builder.upload_packed(host, into=graphs.buffers)
        if self.workers is not None:
            lay = host.layout
            header = ForwardHeader(
                lay.num_tokens,
                lay.num_seqs,
                lay.table_width,
                lay.num_logits,
                host.max_query_len,
                host.max_seq_len,
                key.num_seqs if key is not None else 0,
            )
            self._map_lora_rows(prepared)
            self.workers.send(Op.FORWARD, header, (d64, d32))
        else:
            self._map_lora_rows(prepared)
        logits = self._forward(
            host.layout.views(d64, d32, host.max_query_len, host.max_seq_len), key, host
        )
        if self.workers is not None:
            self.workers.done()
        return logits if key is None else logits[: host.num_rows]

    def _map_lora_rows(self, prepared: PreparedForward) -> None:
        """Map the forward's rows to their adapters' slots, on every rank alike (each runs
        the same LRU over the same calls)."""
        rows = prepared.lora_rows  # (None: no row uses an adapter)
        if self.lora is None or (rows is None and self.lora.context.mapping.empty):
            return  # (nothing to map, nor to clear on any rank)
        if self.workers is not None:
            n = 0 if rows is None else len(rows)
            ids = () if rows is None else (torch.from_numpy(rows).to(self.device),)
            self.workers.send(Op.LORA, LoRAHeader(LORA_MAP, 0, n), ids)
        if rows is None:
            self.lora.clear_mapping()
        else:
            self.lora.activate(rows)

    def _forward(
        self, batch: ForwardBatch, key: GraphKey | None, host: HostBatch | None = None
    ) -> Tensor:
        if key is not None and self.graphs is not None:
            own = None  # an EAGLE-3 head reads the chunks' features in the eager layout
            if host is not None and host.own_rows is not None and self.model.aux_layers:
                own = torch.from_numpy(host.own_rows).to(self.device, non_blocking=True)
            return self.graphs.replay(key, own)
        if self.step_threads is not None:
            self.step_threads.apply(batch.num_tokens)
        return self.model(batch, self.kv_cache)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` for each ``(src, dst)``
        (copy-on-write), on every rank. ``dst`` ids must be distinct and not among the
        sources.
        """
        if not pairs:
            return
        ids = torch.tensor(pairs, dtype=torch.int64).T.contiguous()  # [2, N]: src row, dst row
        if ((ids <= 0) | (ids >= self.num_blocks)).any():
            raise ValueError(f"block ids must lie in [1, {self.num_blocks}), got {list(pairs)}")
        ids = ids.to(self.device)
        if self.workers is not None:
            self.workers.send(Op.COPY_BLOCKS, CopyBlocksHeader(ids.shape[1]), (ids,))
        ops.copy_blocks(self.kv_cache, ids[0], ids[1])
        for other in (self.draft, self.eagle):
            if other is not None:
                ops.copy_blocks(other.kv_cache, ids[0], ids[1])
        if self.workers is not None:
            self.workers.done()

    def move_blocks(
        self,
        offloads: Sequence[tuple[int, int]],
        onboards: Sequence[tuple[int, int]],
        spills: Sequence[tuple[int, int]] = (),
        loads: Sequence[tuple[int, int]] = (),
        stores: Sequence[tuple[int, int]] = (),
    ) -> None:
        """The tiers' moves of a Step, in order (see :mod:`.host_kv`), on every rank (each
        between its shard of the KV cache and its own tiers)."""
        if self.host is None:
            raise RuntimeError("the block manager ordered host-tier moves; this runner has none")
        if self.workers is not None:
            counts = MoveBlocksHeader(
                len(offloads), len(onboards), len(spills), len(loads), len(stores)
            )
            pairs = [*offloads, *onboards, *spills, *loads, *stores]
            ids = torch.tensor(pairs, dtype=torch.int64, device=self.device).view(-1, 2)
            self.workers.send(Op.MOVE_BLOCKS, counts, (ids,))
        self.host.move(
            self.kv_cache, offloads, onboards, spills, loads, stores, fill_async=self.fills_async
        )
        if self.workers is not None:
            self.workers.done()

    @property
    def filling(self) -> bool:
        """Fills :meth:`move_blocks` left running are in flight."""
        return self.host is not None and self.host.filling

    def wait_fills(self) -> None:
        """Return once the fills :meth:`move_blocks` left running are in the KV cache."""
        if self.host is not None:
            self.host.wait_fills()

    def take_failed_moves(self) -> MoveFailures | None:
        """The disk moves that failed among those done (see :meth:`HostKVCache.take_failures`),
        or None."""
        if self.host is None or self.host.disk is None:
            return None
        failed = self.host.take_failures()
        return failed if failed.device_blocks or failed.disk_slots else None

    def _move_on_this_rank(self, header: MoveBlocksHeader, channel: StepChannel) -> None:
        ids = torch.empty(sum(header), 2, dtype=torch.int64, device=self.device)
        channel.recv_payload((ids,))
        pairs = [(int(a), int(b)) for a, b in ids.tolist()]
        cuts = list(itertools.accumulate(header))
        offloads, onboards, spills, loads, stores = (
            pairs[start:end] for start, end in zip([0, *cuts[:-1]], cuts, strict=True)
        )
        assert self.host is not None
        self.host.move(self.kv_cache, offloads, onboards, spills, loads, stores)

    def _lora_on_this_rank(self, header: LoRAHeader, channel: StepChannel) -> None:
        slots = self.lora
        assert slots is not None, "a LoRA operation for a rank without LoRA slots"
        dtype = torch.int64 if header.kind == LORA_MAP else torch.uint8
        data = torch.empty(header.length, dtype=dtype, device=self.device)
        if header.length:
            channel.recv_payload((data,))
        if header.kind == LORA_FORGET:
            slots.forget(header.adapter_id)
        elif header.kind == LORA_REGISTER:
            path = bytes(data.cpu().tolist()).decode()
            slots.register(header.adapter_id, slots.read(path))
        elif header.length:
            slots.activate(data.cpu().numpy())
        else:
            slots.clear_mapping()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and the host tier's fills."""
        try:
            if self.host is not None:
                self.host.close()
        finally:
            if self.workers is not None:
                self.workers.close()

    @torch.inference_mode()
    def serve_rank(self, channel: StepChannel) -> None:
        """Ranks > 0: run rank 0's operations, in order, until SHUTDOWN."""
        while True:
            op, header = channel.recv_header()
            if op is Op.SHUTDOWN:
                return
            if isinstance(header, CopyBlocksHeader):
                ids = torch.empty(2, header.num_pairs, dtype=torch.int64, device=self.device)
                channel.recv_payload((ids,))
                ops.copy_blocks(self.kv_cache, ids[0], ids[1])
                continue
            if isinstance(header, MoveBlocksHeader):
                self._move_on_this_rank(header, channel)
                continue
            if isinstance(header, LoRAHeader):
                self._lora_on_this_rank(header, channel)
                continue
            assert isinstance(header, ForwardHeader)
            size, max_query_len, max_seq_len = (
                header.graph_size,
                header.max_query_len,
                header.max_seq_len,
            )
            layout = BatchLayout(
                header.num_tokens,
                header.num_seqs,
                header.table_width,
                header.num_logits,
                self.builder.num_groups,
            )
            n64, n32 = sum(layout.sizes64), sum(layout.sizes32)
            if size and self.graphs is not None:
                d64, d32 = self.graphs.buffers[0][:n64], self.graphs.buffers[1][:n32]
            else:
                d64 = torch.empty(n64, dtype=torch.int64, device=self.device)
                d32 = torch.empty(n32, dtype=torch.int32, device=self.device)
            channel.recv_payload((d64, d32))
            # (a graph's sequences all have its query length: the header's max_query_len)
            key = GraphKey(size, max_query_len) if size else None
            self._forward(layout.views(d64, d32, max_query_len, max_seq_len), key)
