"""What the model side needs to know to start: the checkpoint, the device, the KV cache's
sizing, CUDA graphs and tensor parallelism. Built from the CLI's ``ExecutorConfig`` by the
service; nothing in ``model/`` sees the CLI."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheConfig", "RunnerConfig"]


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized (vLLM's names): ``num_kv_blocks`` exactly, else
    ``kv_cache_memory`` bytes, else on CUDA ``gpu_memory_utilization`` of the device after
    a profiled forward, else the CPU default budget."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None


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

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """The decode sizes captured as graphs: none under ``enforce_eager``."""
        return () if self.enforce_eager else self.capture_sizes
