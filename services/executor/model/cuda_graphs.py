"""CUDA graphs for pure-decode steps: the whole model forward captured once per batch-size
bucket, replayed over persistent input buffers.

A decode step of ``B`` sequences is padded to the smallest captured size ``>= B``: padding
sequences have one token, write their K/V nowhere (slot -1) and read one slot of the
reserved block 0. The inputs live in two persistent device buffers (int64 and int32) at
the fixed offsets of :class:`~.forward_batch.BatchLayout`, so a step costs two host-to-device
copies and one graph launch instead of hundreds of kernel launches. Every launch parameter
inside the graph is fixed per bucket: the query length (1), the block-table width and the
attention's context bound (``max_model_len``), so nothing read from the host differs between
capture and replay.

Prefill and mixed steps, and decode batches above the largest size, run eagerly. The graph
machinery is injected (:class:`GraphBackend`): CUDA graphs on a GPU, an eager stand-in that
re-runs the captured function on replay for tests on the CPU, which then exercise the
bucketing, padding and buffer logic for real.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from services.common.blocks import blocks_for_tokens
from services.executor.model.forward_batch import (
    BatchBuilder,
    BatchLayout,
    ForwardBatch,
    HostBatch,
    SeqChunk,
)
from services.executor.model.models import DecoderLM

__all__ = ["CudaGraphBackend", "DecodeGraphs", "EagerGraphBackend", "GraphBackendName"]

GraphBackendName = Literal["cuda", "eager"]


class Replayable(Protocol):
    output: Tensor

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], Tensor]) -> Replayable: ...


class _CudaGraph:
    def __init__(self, fn: Callable[[], Tensor], pool: Any, stream: torch.cuda.Stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """Real CUDA graphs sharing one memory pool (captured largest first, as vLLM does, so the
    smaller graphs reuse the larger ones' memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def capture(self, fn: Callable[[], Tensor]) -> Replayable:
        return _CudaGraph(fn, self.pool, self.stream)


class _EagerReplay:
    def __init__(self, fn: Callable[[], Tensor]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output.copy_(self.fn())


class EagerGraphBackend:
    """Stand-in without CUDA: "capture" runs the function once; replay runs it again over the
    same persistent buffers and writes into the same output tensor, as a graph would."""

    def capture(self, fn: Callable[[], Tensor]) -> Replayable:
        return _EagerReplay(fn)


class DecodeGraphs:
    """The captured decode forwards of one runner, by batch size."""

    def __init__(
        self,
        model: DecoderLM,
        kv_cache: Tensor,
        builder: BatchBuilder,
        sizes: Sequence[int],
        backend: GraphBackend,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cuda graph sizes must be positive, got {list(sizes)}")
        self.model = model
        self.kv_cache = kv_cache
        self.builder = builder
        self.sizes = tuple(sorted(set(sizes)))
        self.max_size = self.sizes[-1]
        mc = model.config
        self.max_model_len = mc.max_model_len
        self.table_width = blocks_for_tokens(mc.max_model_len, builder.block_size)
        device = kv_cache.device
        largest = self._layout(self.max_size)
        self.buf64 = torch.zeros(sum(largest.sizes64), dtype=torch.int64, device=device)
        self.buf32 = torch.zeros(sum(largest.sizes32), dtype=torch.int32, device=device)
        self.backend = backend
        self.graphs: dict[int, Replayable] = {}
        self.num_captures = 0
        self.num_replays = 0
        self.capture_s = 0.0

    def _layout(self, size: int) -> BatchLayout:
        return BatchLayout(size, size, self.table_width, size, self.builder.num_groups)

    def _batch(self, size: int) -> ForwardBatch:
        """The views of the persistent buffers a graph of ``size`` sequences reads."""
        return self._layout(size).views(self.buf64, self.buf32, 1, self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, over an all-padding batch; Triton compiles on
        the warm-up run, before capture."""
        t0 = time.perf_counter()
        for size in sorted(self.sizes, reverse=True):
            self._fill_padding(size)
            batch = self._batch(size)

            def forward(batch: ForwardBatch = batch) -> Tensor:
                return self.model(batch, self.kv_cache)

            forward()  # warm-up: JIT compilation and lazy allocations happen outside capture
            self.graphs[size] = self.backend.capture(forward)
            self.num_captures += 1
        self.capture_s = time.perf_counter() - t0

    def _fill_padding(self, size: int) -> None:
        host = self.builder.build_host([], pad_to_seqs=size, table_width=self.table_width)
        self.builder.upload(host, into=(self.buf64, self.buf32))

    def bucket(self, chunks: Sequence[SeqChunk]) -> int | None:
        """The captured size that serves ``chunks``, or None when they must run eagerly (a
        prefill token among them, or more sequences than the largest graph)."""
        n = len(chunks)
        if n > self.max_size or not all(len(c.token_ids) == 1 and c.need_logits for c in chunks):
            return None
        for size in self.sizes:
            if size >= n:
                return size
        return None  # unreachable: n <= max_size

    @property
    def buffers(self) -> tuple[Tensor, Tensor]:
        """The persistent (int64, int32) input buffers every graph reads."""
        return self.buf64, self.buf32

    def host_batch(self, chunks: Sequence[SeqChunk], size: int) -> HostBatch:
        """``chunks`` padded to ``size`` sequences, in the layout the graph of ``size`` reads."""
        return self.builder.build_host(chunks, pad_to_seqs=size, table_width=self.table_width)

    def replay(self, size: int) -> Tensor:
        """Replay the graph of ``size`` over what the buffers hold; fp32 logits ``[size, V]``
        (padding rows included)."""
        graph = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return graph.output
