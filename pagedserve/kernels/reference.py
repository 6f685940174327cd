"""Torch reference implementations of the KV-cache ops.

These are the test oracle for the Triton kernels AND the CPU serving path, so they are
written for clarity first but avoid per-token Python loops: attention gathers each
sequence's context through its block table and computes its scores, mask (causal, and
sliding-window when asked), soft-cap and softmax explicitly, one sequence at a time (a
loop over the batch, not over tokens).

Cache layout (one allocation per executor, made elsewhere)::

    kv_cache:    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    key_cache:   kv_cache[l, 0] -> [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: kv_cache[l, 1] -> same shape

A cache in another dtype than the query's (bf16, fp8, int8 records: :mod:`.kv_quant`) is
encoded on write and widened on read. A slot is ``block_id * block_size + offset``. Block 0
is reserved by the block manager and may appear in block tables as padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.kv_quant import dequantize, encode

__all__ = [
    "check_window_and_soft_cap",
    "copy_blocks",
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rotary_embedding",
    "silu_and_mul",
]


def reshape_and_cache(
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: Tensor,  # [T] int64; < 0 = padding token, skipped
) -> None:
    """Write each token's K/V into its cache slot, in place.

    Token ``t`` goes to block ``slot_mapping[t] // block_size`` at offset
    ``slot_mapping[t] % block_size``. Tokens with a negative slot are padding and are
    skipped (the cache is left untouched). Slots must be distinct among valid tokens.
    """
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0  # [T] bool
    slots = slot_mapping[valid].long()  # [T_valid]
    block_ids = slots // block_size
    offsets = slots % block_size
    key_cache[block_ids, offsets] = encode(key[valid], key_cache.dtype)
    value_cache[block_ids, offsets] = encode(value[valid], value_cache.dtype)


def paged_attention(
    query: Tensor,  # [T, Hq, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    query_start_loc: Tensor,  # [B + 1] int32, cumulative
    seq_lens: Tensor,  # [B] int32, context length including the new query tokens
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Tensor:  # [T, Hq, D], query's dtype
    """Causal grouped-query attention over a flattened, paged batch.

    The batch mixes decode tokens, prefill chunks and prefills that start after a
    prefix-cache hit. Sequence ``b``'s query tokens are
    ``query[qsl[b]:qsl[b+1]]`` (``q_len_b`` of them); they sit at context positions
    ``seq_lens[b] - q_len_b ... seq_lens[b] - 1`` and attend causally to every context
    position ``<=`` their own. Their own K/V must already be in the cache
    (``reshape_and_cache`` runs first). Query head ``h`` uses KV head
    ``h // (Hq // Hkv)``. Math is in fp32; the result is cast to ``query.dtype``.
    Rows past ``qsl[B]`` (batch padding) are zeros.

    ``sliding_window = W`` (``None`` or 0: full causal attention) restricts the query at
    position ``p`` to keys at positions ``p - W < j <= p`` (transformers' sliding-window
    causal mask, Mistral / Gemma): it always sees at least itself.
    ``logits_soft_cap = c`` (``None`` or 0: no capping) caps the scores before the mask
    and the softmax as Gemma 2 does: ``s = c * tanh((q . k) * scale / c)``.

    ``max_query_len`` / ``max_seq_len`` are host-side hints for device kernels; this
    implementation reads the (host) metadata directly and ignores them.
    """
    del max_query_len, max_seq_len  # hints for device implementations
    window, soft_cap = check_window_and_soft_cap(sliding_window, logits_soft_cap)
    _, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads

    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: {q_len} query tokens but seq_len={seq_len}")
        num_blocks = -(-seq_len // block_size)
        block_ids = block_tables[b, :num_blocks].long()  # [nb]
        # Gather the context, token-major: [nb, BS, Hkv, D] -> [S, Hkv, D].
        k = dequantize(key_cache[block_ids]).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = dequantize(value_cache[block_ids]).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        # Heads first, fp32; expand KV heads to their query-head groups.
        q = query[q_start:q_end].transpose(0, 1).float()  # [Hq, q_len, D]
        k = k.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [Hq, S, D]
        v = v.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [Hq, S, D]
        scores = (q @ k.transpose(1, 2)) * scale  # [Hq, q_len, S]
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        # Query i is at position seq_len - q_len + i; it sees keys j <= that position,
        # and with a window W only those with j > position - W.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]  # [1, S]
        visible = k_pos <= q_pos  # [q_len, S] bool
        if window:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v  # [Hq, q_len, D]
        out[q_start:q_end] = o.transpose(0, 1).to(query.dtype)
    return out


def check_window_and_soft_cap(
    sliding_window: int | None, logits_soft_cap: float | None
) -> tuple[int, float]:
    """Normalise the attention options: ``(window, cap)`` with 0 meaning "off".

    Raises ``ValueError`` for a negative window or cap (or a non-finite cap).
    """
    window = int(sliding_window or 0)
    soft_cap = float(logits_soft_cap or 0.0)
    if window < 0:
        raise ValueError(f"paged_attention: sliding_window={sliding_window} must be >= 0")
    if soft_cap < 0 or not math.isfinite(soft_cap):
        raise ValueError(f"paged_attention: logits_soft_cap={logits_soft_cap} must be >= 0")
    return window, soft_cap


def copy_blocks(
    kv_cache: Tensor,  # [L, 2, NB, BS, Hkv, D]
    src: Tensor,  # [N] int64 block ids
    dst: Tensor,  # [N] int64 block ids
) -> None:
    """Copy block ``src[i]`` to ``dst[i]`` for K and V of every layer (copy-on-write).

    ``dst`` ids must be distinct and disjoint from ``src`` (the block manager hands out
    fresh blocks as copy-on-write targets), so the order of the copies does not matter.
    """
    if src.numel() == 0:
        return
    kv_cache[:, :, dst.long()] = kv_cache[:, :, src.long()]


# ---- the model's elementwise ops (references of the fused kernels) ---------------------------


def fused_add_rms_norm(
    x: Tensor,  # [T, H]
    residual: Tensor | None,  # [T, H]; updated in place to x + residual
    weight: Tensor,  # [H]
    eps: float,
    unit_offset: bool = False,
) -> Tensor:  # [T, H]
    """RMSNorm of ``x + residual`` (of ``x`` alone without a residual), as HF computes it:
    the sum rounded to the model dtype and stored into ``residual``, then
    ``weight * to_dtype(r * rsqrt(mean(r^2) + eps))`` with the statistics in fp32 (Llama).
    With ``unit_offset`` (Gemma): ``to_dtype(r * rsqrt(mean(r^2) + eps) * (1 + weight))``,
    the gain applied in fp32 before the one rounding."""
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def rotary_embedding(
    positions: Tensor,  # [T]
    query: Tensor,  # [T, Hq, D], rotated in place
    key: Tensor,  # [T, Hkv, D], rotated in place
    cos: Tensor,  # [max_len, D/2]
    sin: Tensor,  # [max_len, D/2]
) -> None:
    """Rotate each token's query and key heads by its position, NeoX style (HF Llama's
    ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``), in place."""
    c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1)
    for x in (query, key):
        x1, x2 = x.chunk(2, dim=-1)  # [T, h, D/2] each
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_and_mul(x: Tensor) -> Tensor:  # [T, 2I] -> [T, I]
    """SwiGLU's activation over the fused projection ``x = [gate | up]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: Tensor) -> Tensor:  # [T, 2I] -> [T, I]
    """GeGLU (Gemma) over the fused projection ``x = [gate | up]``: ``gelu_tanh(gate) * up``
    with transformers' ``gelu_pytorch_tanh`` (``F.gelu(approximate="tanh")``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
