"""``--calculate-kv-scales``: an fp8 KV cache's per-layer ``k_scale`` / ``v_scale`` from one
calibration prefill at start-up, before the cache is allocated.

The prefill runs over an unquantized scratch cache; each layer's largest ``|K|`` and ``|V|``
become ``k_scale = max|K| / 200`` and ``v_scale = max|V| / 100``, vLLM's constants
(``K_SCALE_CONSTANT``, ``V_SCALE_CONSTANT``): the largest value seen lands well inside e4m3's
range (448), which leaves room for larger ones later (they saturate, never overflow). The
prompt is a fixed text of prose, code and numbers in the checkpoint's own tokenizer (random
token ids when it has none), so the scales, and the pool's ``kv_scales`` identity, are the
same at every start. They are fixed for the process's life. vLLM computes them from the
first request instead: that makes them depend on which request comes first.
"""

from __future__ import annotations

import math
from pathlib import Path

import structlog
import torch

from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import SeqChunk, build_forward_batch
from services.executor.model.kv_cache import allocate_kv_cache
from services.executor.model.layers.attention import Attention
from services.executor.model.loader import load_tokenizer
from services.executor.model.models import DecoderLM

__all__ = [
    "CALIBRATION_TOKENS",
    "K_SCALE_CONSTANT",
    "V_SCALE_CONSTANT",
    "calculate_kv_scales",
    "calibration_tokens",
]

log = structlog.get_logger(__name__)

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
CALIBRATION_TOKENS = 512

_TEXT = """\
The committee met on Tuesday, 14 March, to review the budget for the coming year. Revenue
rose 7.5% to $2.31 million, while costs fell slightly; the treasurer proposed moving 40,000
into the reserve fund. "We should not spend what we have not yet earned," she said.

def moving_average(values: list[float], window: int = 3) -> list[float]:
    if window <= 0:
        raise ValueError("window must be positive")
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]

SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (id) GROUP BY name;
{"id": 42, "tags": ["alpha", "beta"], "ok": true, "ratio": 0.618}
Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2.
Q: What is the capital of Australia? A: Canberra, not Sydney, as many people assume.
"""


def calibration_tokens(model_dir: str | Path, vocab_size: int, length: int) -> list[int]:
    """``length`` token ids of the calibration text (repeated as needed) in the checkpoint's
    tokenizer; seeded random ids below ``vocab_size`` when it has none."""
    try:
        ids = [t for t in load_tokenizer(model_dir).encode(_TEXT) if 0 <= t < vocab_size]
    except ModelLoadError:
        ids = []
    if not ids:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (length,), generator=gen).tolist()
    return (ids * (length // len(ids) + 1))[:length]


@torch.inference_mode()
def calculate_kv_scales(
    model: DecoderLM, token_ids: list[int], block_size: int
) -> dict[tuple[int, str], float]:
    """Per layer, ``{(layer, "k"): k_scale, (layer, "v"): v_scale}`` from a prefill of
    ``token_ids`` (a layer that saw only zeros keeps 1.0)."""
    mc, device = model.local_config, next(model.parameters()).device
    num_blocks = math.ceil(len(token_ids) / block_size) + 1
    cache = allocate_kv_cache(
        mc, num_blocks, block_size, model.dtype, device, model.kv_layout.num_slots
    )
    chunk = SeqChunk(token_ids, 0, list(range(1, num_blocks)), True)
    batch = build_forward_batch(
        [chunk],
        block_size,
        device,
        num_blocks=num_blocks,
        max_model_len=mc.max_model_len,
        vocab_size=mc.vocab_size,
    )
    attentions: list[Attention] = []
    for layer in model.layers:
        assert isinstance(layer.self_attn, Attention)
        attentions.append(layer.self_attn)
    for attention in attentions:
        attention.kv_amax = torch.zeros(2, device=device)
    try:
        model(batch, cache)
        amax = torch.stack([a.kv_amax for a in attentions if a.kv_amax is not None]).tolist()
    finally:
        for attention in attentions:
            attention.kv_amax = None
    scales: dict[tuple[int, str], float] = {}
    for i, (k, v) in enumerate(amax):
        scales[(i, "k")] = k / K_SCALE_CONSTANT if k > 0 else 1.0
        scales[(i, "v")] = v / V_SCALE_CONSTANT if v > 0 else 1.0
    k_scales = [scales[(i, "k")] for i in range(len(amax))]
    v_scales = [scales[(i, "v")] for i in range(len(amax))]
    log.info(
        "kv_scales_calculated",
        num_tokens=len(token_ids),
        k_scale_range=[min(k_scales), max(k_scales)],
        v_scale_range=[min(v_scales), max(v_scales)],
    )
    return scales
