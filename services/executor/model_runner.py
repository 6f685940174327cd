"""``ModelRunner``: the model, its paged KV cache and the step the scheduler loop calls.

The runner owns device state only. Which blocks a sequence uses is decided elsewhere (the
block manager); the scheduler hands the runner :class:`SeqChunk` descriptions that carry
those block tables, and the block pairs to copy for copy-on-write.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
import torch
from torch import Tensor

from kernels import ops
from services.executor.config import ExecutorConfig
from services.executor.cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphBackend
from services.executor.forward_batch import BatchBuilder, SeqChunk
from services.executor.kv_cache import allocate_kv_cache, size_kv_cache
from services.executor.loader import load_model, resolve_device
from services.executor.model import DecoderLM
from services.executor.model_config import ModelConfig

__all__ = ["ModelRunner"]

log = structlog.get_logger(__name__)


class ModelRunner:
    """Runs forward passes of one model over its own KV cache."""

    def __init__(self, model: DecoderLM, kv_cache: Tensor, block_size: int) -> None:
        expected = (
            model.config.num_layers,
            2,
            kv_cache.shape[2],
            block_size,
            model.config.num_kv_heads,
            model.config.head_dim,
        )
        if tuple(kv_cache.shape) != expected:
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} != expected {expected}")
        self.model = model
        self.config: ModelConfig = model.config
        self.kv_cache = kv_cache  # [L, 2, NB, BS, Hkv, D]
        self.block_size = block_size
        self.num_blocks: int = kv_cache.shape[2]
        self.device: torch.device = kv_cache.device
        self.dtype: torch.dtype = model.dtype
        self.graphs: DecodeGraphs | None = None
        self.builder = BatchBuilder(
            block_size,
            self.device,
            num_blocks=self.num_blocks,
            max_model_len=self.config.max_model_len,
            vocab_size=self.config.vocab_size,
        )

    @classmethod
    def from_config(cls, config: ExecutorConfig) -> ModelRunner:
        """The one way to build a runner: load ``config.model`` on its device and dtype, size
        the KV cache (:func:`~.kv_cache.size_kv_cache`), allocate it, and on CUDA capture
        the decode graphs (unless ``--enforce-eager``). Loading errors are
        ``ModelLoadError``; a cache too small for one full sequence is ``ValueError``."""
        device = resolve_device(config.device)
        model = load_model(
            config.model, dtype=config.dtype, device=device, max_model_len=config.max_model_len
        )
        num_blocks = size_kv_cache(model, config)
        kv_cache = allocate_kv_cache(
            model.config, num_blocks, config.block_size, model.dtype, device
        )
        runner = cls(model, kv_cache, config.block_size)
        if device.type == "cuda" and not config.enforce_eager:
            runner.capture_decode_graphs(config.capture_sizes, CudaGraphBackend())
        return runner

    def capture_decode_graphs(self, sizes: Sequence[int], backend: GraphBackend) -> None:
        """Capture the decode forward at each of ``sizes``; pure-decode steps of at most
        ``max(sizes)`` sequences replay them from then on."""
        graphs = DecodeGraphs(self.model, self.kv_cache, self.builder, sizes, backend)
        on_cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        graphs.capture()
        used = torch.cuda.memory_reserved(self.device) - before if on_cuda else 0
        log.info(
            "cuda_graphs_captured",
            sizes=list(graphs.sizes),
            seconds=round(graphs.capture_s, 2),
            memory_bytes=used,
        )
        self.graphs = graphs

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SeqChunk]) -> Tensor:
        """One forward pass over ``chunks``; returns fp32 logits ``[num_need_logits, vocab]``,
        one row per chunk with ``need_logits``, in chunk order.

        Writes the new tokens' K/V into the cache slots their block tables name.
        """
        graphs = self.graphs
        if graphs is not None:
            size = graphs.bucket(chunks)
            if size is not None:
                return graphs.run(chunks, size)
        return self.model(self.builder.build(chunks), self.kv_cache)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` for each ``(src, dst)``
        (copy-on-write). ``dst`` ids must be distinct and not among the sources.
        """
        if not pairs:
            return
        ids = torch.tensor(pairs, dtype=torch.int64).T.contiguous()  # [2, N]: src row, dst row
        if ((ids <= 0) | (ids >= self.num_blocks)).any():
            raise ValueError(f"block ids must lie in [1, {self.num_blocks}), got {list(pairs)}")
        src, dst = ids.to(self.device).unbind(0)
        ops.copy_blocks(self.kv_cache, src, dst)
