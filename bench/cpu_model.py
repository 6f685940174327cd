"""The random model and prompts of the CPU benches (``cpu_bench.py``'s sizes): a Llama with
hidden 512, 4 layers, 8 query / 2 KV heads, MLP 1024 and the tiny tokenizer's vocabulary,
fp32, served by a runner built the production way."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.tools.tiny_model import write_tiny_model  # noqa: E402
from services.executor.model.launch import build_runner  # noqa: E402
from services.executor.service.config import ExecutorConfig  # noqa: E402


def write_cpu_model(directory: Path) -> Path:
    """Write the model (random weights, the tiny tokenizer) to ``directory``."""
    return write_tiny_model(
        directory,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1024,
        max_position_embeddings=2048,
    )


def cpu_model(directory: Path, threads: int, **config: Any) -> tuple[ExecutorConfig, Any]:
    """Write the model to ``directory``; its executor config (``config`` overrides) and a
    runner (model + KV cache) to share between engines."""
    model = write_cpu_model(directory)
    settings: dict[str, Any] = {
        "num_kv_blocks": 4096,
        "max_num_seqs": 256,
        "max_model_len": 512,
        **config,
    }
    cfg = ExecutorConfig(
        model=str(model), dtype="float32", device="cpu", cpu_threads=threads, **settings
    )
    return cfg, build_runner(cfg.runner_config())


def random_prompts(rng: random.Random, vocab: int, n: int, lo: int = 35, hi: int = 254) -> list:
    """``n`` prompts of ``lo..hi`` tokens: BOS, then random ids past the special tokens."""
    return [
        [1, *(rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi) - 1))] for _ in range(n)
    ]
