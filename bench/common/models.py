"""The benchmarks' random checkpoints, written by ``pagedserve.tools.tiny_model`` (real
Hugging Face directories with the tiny tokenizer), and their engine configurations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.tools.tiny_model import write_tiny_model
from services.executor.api import ExecutorConfig

__all__ = ["CPU_MODEL", "cpu_engine_config", "write_bench_model", "write_cpu_model"]

#: The CPU benches' Llama: hidden 512, 4 layers, 8 query / 2 KV heads, MLP 1024 (with the tiny
#: tokenizer's 621-token vocabulary: 9.55 M parameters).
CPU_MODEL: dict[str, int] = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 2,
    "intermediate_size": 1024,
}


def write_bench_model(
    directory: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    max_len: int = 2048,
    **sizes: Any,
) -> Path:
    """A random checkpoint of ``arch`` (a Llama by default) with ``sizes`` (``hidden_size``,
    ``num_layers``, ... as ``write_tiny_model`` takes them), positions for at least
    ``max_len`` tokens, written to ``directory``."""
    return write_tiny_model(
        directory,
        arch=arch,  # type: ignore[arg-type]
        seed=seed,
        max_position_embeddings=max(2048, max_len),
        **sizes,
    )


def write_cpu_model(directory: Path) -> Path:
    """Write the CPU benches' Llama (:data:`CPU_MODEL`, seed 0) to ``directory``."""
    return write_bench_model(directory, **CPU_MODEL)


def cpu_engine_config(model: str | Path, threads: int, **flags: Any) -> ExecutorConfig:
    """An fp32 CPU engine of ``model`` on ``threads`` torch threads: 4096 KV blocks, 256
    sequences, ``max_model_len`` 512, unless ``flags`` (executor flags) say otherwise."""
    settings: dict[str, Any] = {
        "num_kv_blocks": 4096,
        "max_num_seqs": 256,
        "max_model_len": 512,
        **flags,
    }
    return ExecutorConfig(
        model=str(model), dtype="float32", device="cpu", cpu_threads=threads, **settings
    )
