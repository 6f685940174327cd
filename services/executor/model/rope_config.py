"""Rotary position embedding settings, parsed from a Hugging Face ``config.json``.

Both serialisations are accepted: the legacy one (top-level ``rope_theta`` plus an optional
``rope_scaling`` dict keyed by ``type`` or ``rope_type``) and the one written by
transformers >= 5 (a ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``, or,
for models whose layer types rotate differently such as Gemma 3, one such dict per layer
type).

LongRoPE (Phi-3 128k, Phi-4-mini) has two sets of per-frequency factors, ``short_factor``
for contexts up to ``original_max_position_embeddings`` and ``long_factor`` beyond.
transformers switches between them on the longest position of each forward call, which
would leave the K/V already cached for a sequence rotated with the other set. We choose
once, as vLLM does: the long factors when the served context (``max_model_len``) exceeds the
original one, else the short ones. Both choices agree with transformers on every sequence
whose length stays on the same side of the original context as ``max_model_len``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.executor.model.errors import ModelLoadError, UnsupportedModelError

__all__ = ["DEFAULT_ROPE_THETA", "RopeConfig", "RopeType", "parse_rope"]

RopeType = Literal["default", "linear", "llama3", "longrope"]
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    ``default``: ``inv_freq[i] = theta ** (-2i / rotary_dim)``. ``linear``: ``inv_freq /
    factor`` (position interpolation). ``llama3``: Llama 3.1's frequency-dependent rescaling;
    low frequencies are divided by ``factor``, high ones kept, the band between interpolated
    (the four llama3 fields are set only for this type). ``longrope``: ``inv_freq[i] /
    ext_factors[i]`` with the ``long_factor`` or ``short_factor`` set (``use_long_factor``,
    see the module docstring), and cos/sin scaled by ``attention_factor``.

    ``partial_rotary_factor`` < 1 rotates only the first ``int(head_dim * factor)`` features
    of each head (Phi-4-mini); the rest pass through.
    """

    theta: float = DEFAULT_ROPE_THETA
    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0
    ext_factors: tuple[float, ...] | None = None  # longrope: the chosen per-frequency set
    attention_factor: float = 1.0  # longrope: cos and sin are multiplied by it

    def rotary_dim(self, head_dim: int) -> int:
        """Features rotated per head (even; ``head_dim`` unless the rotation is partial)."""
        return int(head_dim * self.partial_rotary_factor)


def parse_rope(
    params: Mapping[str, Any],
    hf: Mapping[str, Any],
    *,
    head_dim: int,
    max_model_len: int,
    default_theta: float = DEFAULT_ROPE_THETA,
) -> RopeConfig:
    """One :class:`RopeConfig` from a rope dict ``params`` (already merged from the legacy and
    new fields); ``hf`` supplies the top-level fallbacks (``rope_theta``,
    ``partial_rotary_factor``, ``original_max_position_embeddings``)."""
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(
            "config.json: per-layer-type rope_parameters are only supported for Gemma 3"
        )
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise ModelLoadError(
            f"config.json: partial_rotary_factor={partial} must be in (0, 1] and rotate an "
            f"even number of the head's {head_dim} features"
        )
    max_positions = hf.get("max_position_embeddings")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "linear":
        return RopeConfig(
            theta=theta,
            rope_type="linear",
            factor=_rope_float(params, "factor"),
            partial_rotary_factor=partial,
        )
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings", max_positions)
        low = _rope_float(params, "low_freq_factor")
        high = _rope_float(params, "high_freq_factor")
        if not high > low:
            raise ModelLoadError(
                f"config.json: llama3 rope needs high_freq_factor > low ({params})"
            )
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=_rope_float(params, "factor"),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=int(original),
            partial_rotary_factor=partial,
        )
    if rope_type in ("longrope", "su"):
        return _longrope(params, hf, theta, partial, head_dim, max_model_len)
    raise UnsupportedModelError(
        f"config.json: rope type {rope_type!r} is not supported; "
        "supported: default, linear, llama3, longrope"
    )


def _longrope(
    params: Mapping[str, Any],
    hf: Mapping[str, Any],
    theta: float,
    partial: float,
    head_dim: int,
    max_model_len: int,
) -> RopeConfig:
    # Phi-3 keeps original_max_position_embeddings at the top level; it wins there.
    original = hf.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    if not isinstance(original, int) or original <= 0:
        raise ModelLoadError(
            "config.json: longrope needs a positive original_max_position_embeddings, "
            f"got {original!r}"
        )
    half = int(head_dim * partial) // 2
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or len(value) != half:
            raise ModelLoadError(
                f"config.json: longrope {key} must be a list of {half} numbers (one per "
                f"rotated frequency), got {value!r}"
            )
        factors[key] = tuple(float(v) for v in value)
    factor = params.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    use_long = max_model_len > original
    return RopeConfig(
        theta=theta,
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        partial_rotary_factor=partial,
        ext_factors=factors["long_factor" if use_long else "short_factor"],
        attention_factor=float(attention_factor),
    )


def _rope_float(params: Mapping[str, Any], key: str) -> float:
    value = params.get(key)
    if not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"config.json: rope {key} must be a positive number, got {value!r}")
    return float(value)
