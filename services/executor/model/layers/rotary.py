"""Rotary position embedding (rotate-half convention) with its scalings: default, linear,
Llama 3, LongRoPE; over the whole head or its first ``rotary_dim`` features (partial)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from pagedserve.kernels import ops
from services.executor.model.rope_config import RopeConfig

__all__ = ["RotaryEmbedding", "rope_inv_freq"]


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:  # [R/2] float32
    """Inverse frequencies of the rotary embedding over the ``R = rope.rotary_dim(head_dim)``
    rotated features, including its scaling (CPU, fp32)."""
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.rope_type == "longrope":
        assert rope.ext_factors is not None
        ext = torch.tensor(rope.ext_factors, dtype=torch.float32)
        return 1.0 / (ext * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)  # [R/2]
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        assert rope.low_freq_factor is not None and rope.high_freq_factor is not None
        assert rope.original_max_position_embeddings is not None
        old_context_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_context_len / rope.low_freq_factor
        high_freq_wavelen = old_context_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        # In between: blend the two smoothly.
        smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions ``0 .. max_len-1``, gathered by position; they
    carry LongRoPE's attention factor."""

    cos: Tensor  # [max_len, R/2], a buffer
    sin: Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_len, self.dtype = rope, head_dim, max_len, dtype
        self.rotary_dim = rope.rotary_dim(head_dim)
        half = self.rotary_dim // 2
        self.register_buffer("cos", torch.empty(max_len, half, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, half, dtype=dtype), persistent=False)

    def compute_tables(self) -> None:
        """(Re)compute the tables in place on their current device (after ``to_empty``)."""
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(self.cos.device)  # [R/2]
        t = torch.arange(self.max_len, device=self.cos.device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_len, R/2] fp32
        self.cos.copy_(freqs.cos() * self.rope.attention_factor)
        self.sin.copy_(freqs.sin() * self.rope.attention_factor)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> None:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] in place by their tokens' positions
        (their first ``rotary_dim`` features; the rest pass through)."""
        if self.rotary_dim < self.head_dim:
            q, k = q[..., : self.rotary_dim], k[..., : self.rotary_dim]
        ops.rotary_embedding(positions, q, k, self.cos, self.sin)
