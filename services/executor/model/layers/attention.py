"""Paged self-attention over this rank's heads: fused QKV projection, optional per-head
RMSNorm of q and k (QK-norm, Qwen3 and Gemma 3), RoPE, the KV write into the paged cache and
``pagedserve.kernels.ops.paged_attention`` with the layer's sliding window and soft-cap, if any."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.kernels import ops
from services.executor.model.config import ModelConfig
from services.executor.model.forward_batch import ForwardBatch
from services.executor.model.layers.linear import Linear
from services.executor.model.layers.norm import RMSNorm
from services.executor.model.layers.rotary import RotaryEmbedding
from services.executor.model.parallel import Comm

__all__ = ["Attention"]


class Attention(nn.Module):
    """Self-attention over this rank's heads: ``qkv_proj`` is column-parallel (``config`` is
    the rank's local config), ``o_proj`` row-parallel, its partial sums all-reduced."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, comm: Comm, layer_idx: int = 0
    ) -> None:
        super().__init__()
        self.comm = comm
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale
        self.sliding_window = config.window(layer_idx)
        self.kv_group = (
            0  # the KV-cache group whose block tables it reads (DecoderLM.use_kv_layout)
        )
        self.logits_soft_cap = config.attn_logit_softcap
        # An fp8 KV cache (quantize_kv): K/V divided by these on write, multiplied back after.
        self.kv_limit = 0.0  # the cache dtype's largest value; 0: K/V stored as they are
        self.k_scale = self.v_scale = 1.0
        # While --calculate-kv-scales calibrates: the largest |K| and |V| seen, [2] fp32.
        self.kv_amax: Tensor | None = None
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias, dtype=dtype
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias, dtype=dtype)
        # QK-norm: one RMSNorm over head_dim shared by every head (replicated across ranks).
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            eps, offset = config.rms_norm_eps, config.norm_unit_offset
            self.q_norm = RMSNorm(self.head_dim, eps, dtype, offset)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, offset)

    def forward(
        self,
        x: Tensor,  # [T, H]
        batch: ForwardBatch,
        rotary_emb: RotaryEmbedding,
        kv_cache: Tensor,  # [2, NB, BS, Hkv, D], this layer's slice
    ) -> Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)  # per head, pre-RoPE
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        rotary_emb(batch.positions, q, k)

        if self.kv_amax is not None:
            self.kv_amax = torch.maximum(
                self.kv_amax, torch.stack([k.abs().amax(), v.abs().amax()]).float()
            )
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [NB, BS, Hkv, D] each
        block_tables, slot_mapping = batch.tables_of(self.kv_group)
        scale = self.scale
        if self.kv_limit:  # fp8: scaled into the dtype's range (saturating), and back below
            lim = self.kv_limit
            k = (k * (1.0 / self.k_scale)).clamp_(-lim, lim)
            v = (v * (1.0 / self.v_scale)).clamp_(-lim, lim)
            scale *= self.k_scale
        ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
        out = ops.paged_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            scale,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )  # [T, Hq, D]
        if self.kv_limit and self.v_scale != 1.0:
            out = out * self.v_scale
        return self.comm.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))

    def quantize_kv(self, dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
        """Store K/V in ``dtype`` (fp8), divided by the layer's scales first."""
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"KV scales must be positive, got {k_scale}, {v_scale}")
        self.kv_limit = float(torch.finfo(dtype).max)
        self.k_scale, self.v_scale = k_scale, v_scale
