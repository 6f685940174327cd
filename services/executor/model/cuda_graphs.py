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

With speculative decoding (n-gram or draft-model drafts), verifying steps are captured too:
``B`` sequences of ``1 + k`` query tokens each, a sequence's own tokens first and the rest
padding that writes nowhere and whose rows are not returned (:meth:`BatchBuilder.build_host`'s
``pad_query_to``), for the sizes whose ``B * (1 + k)`` tokens are no more than the largest
decode size's. A graph is a :class:`GraphKey` (sequences, query length).

An EAGLE-3 head's drafting forwards are captured the same way (:mod:`.eagle_graphs`).
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
    GraphKey,
    HostBatch,
    SeqChunk,
)
from services.executor.model.models import DecoderLM

__all__ = [
    "CapturedForwards",
    "CudaGraphBackend",
    "DecodeGraphs",
    "EagerGraphBackend",
    "GraphBackendName",
    "graph_keys",
    "graph_output_bytes",
    "graph_rows",
]

GraphBackendName = Literal["cuda", "eager"]


Outputs = tuple[Tensor, ...]  # a captured forward's: its logits (and an EAGLE-3 head's features)


class Replayable(Protocol):
    output: Outputs

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], Outputs]) -> Replayable: ...


class _CudaGraph:
    def __init__(self, fn: Callable[[], Outputs], pool: Any, stream: torch.cuda.Stream) -> None:
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

    def capture(self, fn: Callable[[], Outputs]) -> Replayable:
        return _CudaGraph(fn, self.pool, self.stream)


class _EagerReplay:
    def __init__(self, fn: Callable[[], Outputs]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        for out, new in zip(self.output, self.fn(), strict=True):
            out.copy_(new)


class EagerGraphBackend:
    """Stand-in without CUDA: "capture" runs the function once; replay runs it again over the
    same persistent buffers and writes into the same output tensors, as a graph would."""

    def capture(self, fn: Callable[[], Outputs]) -> Replayable:
        return _EagerReplay(fn)


# Verification graphs are captured up to this many tokens (sequences x (1 + k)), or up to the
# largest decode graph's if that is more: vLLM's default largest capture (512 tokens). Past
# it a verifying step runs eagerly; below it, each graph's logits rows are kept for good.
VERIFY_CAPTURE_TOKENS = 512


def graph_keys(sizes: Sequence[int], verify_query_len: int = 1) -> list[GraphKey]:
    """The graphs captured for decode ``sizes`` and, with ``verify_query_len`` = 1 + k, for
    verifying k drafts: the sizes whose ``size * (1 + k)`` tokens are within
    :data:`VERIFY_CAPTURE_TOKENS` or the largest decode size, whichever is more."""
    ordered = sorted(set(sizes))
    keys = [GraphKey(s) for s in ordered]
    if verify_query_len > 1:
        q = verify_query_len
        limit = max(ordered[-1], VERIFY_CAPTURE_TOKENS)
        keys += [GraphKey(s, q) for s in ordered if s * q <= limit]
    return keys


def graph_rows(sizes: Sequence[int], verify_query_len: int) -> int:
    """The token rows of every captured graph together: each keeps its outputs (fp32 logits,
    and an EAGLE-3 head's features) a row per token for good; the pool shares everything
    else between graphs."""
    keys = graph_keys(sizes, verify_query_len) if sizes else []
    return sum(k.num_seqs * k.query_len for k in keys)


def graph_output_bytes(sizes: Sequence[int], verify_query_len: int, vocab_size: int) -> int:
    """What the captured graphs' logits keep for good (:func:`graph_rows`)."""
    return graph_rows(sizes, verify_query_len) * vocab_size * 4


class CapturedForwards:
    """Forwards captured by :class:`GraphKey` over persistent input buffers: the keys, the
    buffers, capture (largest first) and bucketing. What a graph runs is a subclass's
    :meth:`_outputs`; a graph serves ``max_model_len`` positions."""

    def __init__(
        self,
        kv_cache: Tensor,
        builder: BatchBuilder,
        sizes: Sequence[int],
        backend: GraphBackend,
        max_model_len: int,
        verify_query_len: int = 1,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cuda graph sizes must be positive, got {list(sizes)}")
        if verify_query_len < 1:
            raise ValueError(f"verify_query_len must be positive, got {verify_query_len}")
        self.kv_cache = kv_cache
        self.builder = builder
        self.sizes = tuple(sorted(set(sizes)))
        self.max_size = self.sizes[-1]
        self.verify_query_len = verify_query_len
        self.keys = graph_keys(self.sizes, verify_query_len)
        self.verify_sizes = tuple(k.num_seqs for k in self.keys if k.query_len > 1)
        self.max_model_len = max_model_len
        self.table_width = blocks_for_tokens(max_model_len, builder.block_size)
        device = kv_cache.device
        n64 = max(sum(self._layout(key).sizes64) for key in self.keys)
        n32 = max(sum(self._layout(key).sizes32) for key in self.keys)
        self.buf64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self.buf32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.backend = backend
        self.graphs: dict[GraphKey, Replayable] = {}
        self.num_captures = 0
        self.num_replays = 0
        self.num_verify_replays = 0
        self.capture_s = 0.0

    def _outputs(self, batch: ForwardBatch, key: GraphKey) -> Outputs:
        """The forward a graph of ``key`` captures, over ``batch`` (the buffers' views)."""
        raise NotImplementedError

    def _layout(self, key: GraphKey) -> BatchLayout:
        tokens = key.num_seqs * key.query_len
        return BatchLayout(tokens, key.num_seqs, self.table_width, tokens, self.builder.num_groups)

    def _batch(self, key: GraphKey) -> ForwardBatch:
        """The views of the persistent buffers the graph of ``key`` reads."""
        return self._layout(key).views(self.buf64, self.buf32, key.query_len, self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every key, largest first, over an all-padding batch; Triton compiles on
        the warm-up run, before capture."""
        t0 = time.perf_counter()
        order = sorted(self.keys, key=lambda k: (k.num_seqs * k.query_len, k.query_len))
        for key in reversed(order):
            self._fill_padding(key)
            batch = self._batch(key)

            def forward(batch: ForwardBatch = batch, key: GraphKey = key) -> Outputs:
                return self._outputs(batch, key)

            forward()  # warm-up: JIT compilation and lazy allocations happen outside capture
            self.graphs[key] = self.backend.capture(forward)
            self.num_captures += 1
        self.capture_s = time.perf_counter() - t0

    def _fill_padding(self, key: GraphKey) -> None:
        host = self.builder.build_host(
            [], pad_to_seqs=key.num_seqs, table_width=self.table_width, pad_query_to=key.query_len
        )
        self.builder.upload(host, into=(self.buf64, self.buf32))

    def bucket(self, chunks: Sequence[SeqChunk]) -> GraphKey | None:
        """The captured graph that serves ``chunks``, or None when they must run eagerly: a
        decode graph when each chunk is one token whose logits are wanted; else a
        verification graph when each has at most ``1 + k`` tokens and room for them all
        within ``max_model_len``."""
        n = len(chunks)
        if n > self.max_size:
            return None
        if all(len(c.token_ids) == 1 and c.need_logits for c in chunks):
            return GraphKey(next(s for s in self.sizes if s >= n))
        q = self.verify_query_len
        if not self.verify_sizes or n > self.verify_sizes[-1]:
            return None
        limit = self.max_model_len - q
        if all(len(c.token_ids) <= q and c.num_computed_tokens <= limit for c in chunks):
            return GraphKey(next(s for s in self.verify_sizes if s >= n), q)
        return None

    @property
    def buffers(self) -> tuple[Tensor, Tensor]:
        """The persistent (int64, int32) input buffers every graph reads."""
        return self.buf64, self.buf32

    def host_batch(self, chunks: Sequence[SeqChunk], key: GraphKey) -> HostBatch:
        """``chunks`` padded to the graph of ``key``, in the layout it reads."""
        return self.builder.build_host(
            chunks,
            pad_to_seqs=key.num_seqs,
            table_width=self.table_width,
            pad_query_to=key.query_len,
        )

    def _replay(self, key: GraphKey) -> Outputs:
        """Replay the graph of ``key`` over what the buffers hold; its outputs."""
        graph = self.graphs[key]
        graph.replay()
        self.num_replays += 1
        self.num_verify_replays += key.query_len > 1
        return graph.output


class DecodeGraphs(CapturedForwards):
    """The captured decode (and verification) forwards of one model's runner."""

    def __init__(
        self,
        model: DecoderLM,
        kv_cache: Tensor,
        builder: BatchBuilder,
        sizes: Sequence[int],
        backend: GraphBackend,
        verify_query_len: int = 1,
    ) -> None:
        self.model = model
        max_model_len = model.config.max_model_len
        super().__init__(kv_cache, builder, sizes, backend, max_model_len, verify_query_len)

    def _outputs(self, batch: ForwardBatch, key: GraphKey) -> Outputs:
        logits = self.model(batch, self.kv_cache)
        aux = self.model.aux_hidden if self.model.aux_layers else None
        return (logits,) if aux is None else (logits, aux)

    def replay(self, key: GraphKey, own_rows: Tensor | None = None) -> Tensor:
        """Replay the graph of ``key`` over what the buffers hold; fp32 logits, the chunks'
        rows first (:attr:`HostBatch.num_rows`), then padding's. A model that keeps an
        EAGLE-3 head's features gets them as an eager forward leaves them: the chunks'
        tokens' rows in order (``own_rows``, where padding is interleaved), then padding's."""
        output = self._replay(key)
        if len(output) > 1:
            aux = output[1]
            self.model.aux_hidden = aux if own_rows is None else aux.index_select(0, own_rows)
        return output[0]
