"""What the model side needs to know to start: the checkpoint, the device, the KV cache's
sizing, CUDA graphs and tensor parallelism. Built from the CLI's ``ExecutorConfig`` by the
service; nothing in ``model/`` sees the CLI."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "KV_CACHE_DTYPE_NAMES",
    "QUANTIZATION_METHODS",
    "CacheConfig",
    "RunnerConfig",
    "available_cores",
]

#: ``--quantization`` values (model/quantization.py).
QUANTIZATION_METHODS = ("int8", "bf16", "fp16")
#: ``--kv-cache-dtype`` values other than ``auto``, vLLM's names (model/kv_cache.py).
KV_CACHE_DTYPE_NAMES = ("bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int8_per_token_head")


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized (vLLM's names): ``num_kv_blocks`` exactly, else
    ``kv_cache_memory`` bytes, else on CUDA ``gpu_memory_utilization`` of the device after
    a profiled forward, else the CPU default budget. ``hybrid_kv_cache``: a model with both
    sliding-window and full-attention layers gets KV-cache groups, its sliding layers keeping
    only their window's blocks (off: ``--disable-hybrid-kv-cache-manager``, every layer keeps
    every block)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    hybrid_kv_cache: bool = True
    # Bytes of host memory for the block manager's host tier (--kv-offloading-size): blocks
    # evicted from the KV cache are copied there, and back on a prefix hit. 0: none.
    host_tier_bytes: int = 0
    # A disk tier below the host tier (--kv-offloading-disk-path/-size): host slots evicted
    # for other content are spilled into this file, and loaded back on a prefix hit. 0: none.
    disk_tier_bytes: int = 0
    disk_tier_path: str | None = None


@dataclass(frozen=True)
class RunnerConfig:
    model: str  # a local Hugging Face checkpoint directory
    cache: CacheConfig = CacheConfig()
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048  # the largest forward, profiled on CUDA
    enforce_eager: bool = False
    capture_sizes: tuple[int, ...] = (1,)  # decode batch sizes captured as CUDA graphs
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None  # default: a free loopback TCP port
    distributed_timeout: float = 600.0
    log_level: str = "INFO"  # of the rank worker processes
    cpu_threads: int | None = None  # torch intra-op threads on the CPU, all ranks together
    # Threads of a small step (model/cpu_threads.py; None: as cpu_threads).
    cpu_decode_threads: int | None = None
    draft_model: str | None = None  # speculative decoding's draft checkpoint (first rank)
    eagle3_head: str | None = None  # or its EAGLE-3 head (first rank)
    # Drafts a step (speculative decoding): its verifying steps, of 1 + k tokens a sequence,
    # are captured as CUDA graphs too.
    num_speculative_tokens: int = 0
    # Multi-LoRA serving: slots for this many adapters up to this rank (every rank its shard;
    # 0: none). Sized before the KV cache; no CUDA graphs then.
    max_loras: int = 0
    max_lora_rank: int = 0
    quantization: str | None = None  # int8, bf16, fp16: the decoder's projections (CPU)
    kv_cache_dtype: str = "auto"  # or one of KV_CACHE_DTYPE_NAMES
    calculate_kv_scales: bool = False  # an fp8 cache's scales from a calibration prefill
    # --runner pooling: the model returns its final hidden states (after the last norm)
    # instead of logits, for embeddings; no decode graphs (nothing decodes).
    pooling: bool = False

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def torch_threads(self, num_ranks: int) -> int | None:
        """Intra-op threads of each of ``num_ranks`` CPU ranks: ``cpu_threads``, else the
        available cores, split between the ranks. None (leave torch's own choice) when
        ``OMP_NUM_THREADS`` is set and ``cpu_threads`` is not: the environment rules."""
        if self.cpu_threads is None and "OMP_NUM_THREADS" in os.environ:
            return None
        return max(1, (self.cpu_threads or available_cores()) // num_ranks)

    def decode_threads(self, num_ranks: int) -> int | None:
        """Intra-op threads of each of ``num_ranks`` CPU ranks for a small step
        (``model/cpu_threads.py``) when ``cpu_decode_threads`` gives fewer than
        :meth:`torch_threads`; else None (every step on those)."""
        large = self.torch_threads(num_ranks)
        if self.cpu_decode_threads is None or large is None:
            return None
        small = max(1, self.cpu_decode_threads // num_ranks)
        return small if small < large else None

    @property
    def verify_query_len(self) -> int:
        """The query tokens of a sequence verifying its drafts (1: no speculation)."""
        return 1 + self.num_speculative_tokens

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """The decode sizes captured as graphs: none under ``enforce_eager``."""
        return () if self.enforce_eager else self.capture_sizes
