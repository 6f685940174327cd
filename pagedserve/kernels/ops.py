"""Dispatch for the KV-cache ops used by the model.

Each op has the signature of its reference in :mod:`pagedserve.kernels.reference`. CUDA tensors go
to the Triton kernels; CPU tensors go to torch: attention to the fast CPU path
(:mod:`pagedserve.kernels.cpu_attention`; ``PAGEDSERVE_CPU_ATTENTION=reference`` selects the
reference instead), the residual add with RMSNorm, rotary, SiLU-and-mul and the K/V write in
fp32 to one native pass each (:mod:`pagedserve.kernels.cpu_layer_ops`), the other ops to
their reference, unless the environment
variable ``PAGEDSERVE_FORCE_TRITON=1`` is set (tests use it to run the Triton kernels
under the interpreter, ``TRITON_INTERPRET=1``). Triton is imported lazily, on first use,
so a CPU-only process never needs it and a test can set ``TRITON_INTERPRET`` first.

Attention picks between two kernels with :func:`split_kv_heuristic`: the unified kernel
(one program per query tile x KV head, the whole context in one program) and the
split-KV "flash-decoding" kernel (each sequence's context split across programs, merged
by log-sum-exp), which wins only when a decode batch has too few (sequence, KV head)
pairs to fill the GPU.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from pagedserve.kernels import cpu_layer_ops, reference
from pagedserve.kernels.cpu_attention import paged_attention_cpu
from pagedserve.kernels.cpu_linear import cpu_linear
from pagedserve.kernels.lora_reference import lora_expand_ref, lora_shrink_ref

__all__ = [
    "CPU_ATTENTION_ENV",
    "FORCE_TRITON_ENV",
    "copy_blocks",
    "cpu_attention_impl",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "linear",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "reshape_and_cache",
    "rotary_embedding",
    "silu_and_mul",
    "split_kv_heuristic",
]

FORCE_TRITON_ENV = "PAGEDSERVE_FORCE_TRITON"
CPU_ATTENTION_ENV = "PAGEDSERVE_CPU_ATTENTION"
_CPU_ATTENTION = {"fast": paged_attention_cpu, "reference": reference.paged_attention}


def cpu_attention_impl() -> str:
    """The attention serving CPU tensors: ``fast`` (default) or ``reference``."""
    name = os.environ.get(CPU_ATTENTION_ENV, "fast") or "fast"
    if name not in _CPU_ATTENTION:
        raise ValueError(f"{CPU_ATTENTION_ENV}={name!r}: choose one of {sorted(_CPU_ATTENTION)}")
    return name


# split_kv_heuristic tuning. See its docstring for the reasoning.
_PROGRAMS_PER_SM = 2  # target resident programs per SM for a memory-bound decode
_MIN_TOKENS_PER_SPLIT = 256  # below this, partial-result traffic + merge cost dominate
_MAX_SPLITS = 64
_DEFAULT_NUM_SMS = 132  # H100/H200; only used when no CUDA device is involved


def _use_triton(t: Tensor) -> bool:
    return t.is_cuda or os.environ.get(FORCE_TRITON_ENV, "") == "1"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_kv_heuristic(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int = _DEFAULT_NUM_SMS,
) -> int:
    """Number of context splits for attention; ``1`` means use the unified kernel.

    Rule: split only a pure-decode batch (``max_query_len == 1``) whose unified grid,
    ``num_seqs * num_kv_heads`` programs, is below ``2 * num_sms``. Decode attention is
    memory-bound; each program streams one (sequence, KV head) context, so with fewer
    programs than about two per SM the GPU cannot keep enough loads in flight and most
    of its bandwidth idles. Splitting multiplies the programs up to that target, as a
    power of two (rounded up; powers of two bound the compiled variants), but never below
    ``256`` context tokens per split (so the fp32 partials and the merge stay small
    against the K/V read) and never above 64 splits. Batches with prefill tokens already
    have ``ceil(q_len / BLOCK_Q)`` programs per sequence, and their partial buffers would
    scale with the token count, so they always use the unified kernel.

    Examples on an H200 (132 SMs), 8 KV heads: batch 64 or 256 -> 1 (>= 512 programs);
    batch 16 at 1k/4k/16k -> 4 (512 programs); batch 1 at 1k -> 4, at 4k -> 16, at
    16k -> 64.
    """
    if max_query_len != 1 or num_seqs <= 0:
        return 1
    programs = num_seqs * num_kv_heads
    target = _PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    want = -(-target // programs)  # ceil
    want_pow2 = 1 << (want - 1).bit_length()  # round up: fill the machine
    by_length = max_seq_len // _MIN_TOKENS_PER_SPLIT
    if by_length <= 1:
        return 1
    by_length_pow2 = 1 << (by_length.bit_length() - 1)  # round down: keep splits long
    return min(want_pow2, by_length_pow2, _MAX_SPLITS)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias``: on the CPU through :func:`pagedserve.kernels.cpu_linear.cpu_linear`
    (oneDNN for fp32), elsewhere ``torch.nn.functional.linear`` (cuBLAS)."""
    if x.device.type == "cpu":
        return cpu_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def reshape_and_cache(
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: Tensor,  # [T] int64, < 0 = padding
) -> None:
    """See :func:`pagedserve.kernels.reference.reshape_and_cache`."""
    if _use_triton(key):
        from pagedserve.kernels.reshape_and_cache import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    elif not cpu_layer_ops.write_kv(key, value, key_cache, value_cache, slot_mapping):
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: Tensor,  # [T, Hq, D]
    key_cache: Tensor,  # [NB, BS, Hkv, D]
    value_cache: Tensor,  # [NB, BS, Hkv, D]
    block_tables: Tensor,  # [B, max_blocks] int32
    query_start_loc: Tensor,  # [B + 1] int32
    seq_lens: Tensor,  # [B] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Tensor:  # [T, Hq, D]
    """See :func:`pagedserve.kernels.reference.paged_attention`.

    ``sliding_window = W`` limits each query to the ``W`` latest keys up to its own
    position, ``logits_soft_cap = c`` caps scores to ``c * tanh(score / c)`` (``None``
    or 0: off); every path (fast CPU, reference, both Triton kernels) honours both.

    On the Triton path, pass ``max_query_len`` and ``max_seq_len`` (known on the host
    when the batch is built) to avoid a device sync; without them they are read back.
    With a window, :func:`split_kv_heuristic` is given the effective context
    ``min(max_seq_len, W)``: that, not the full context, is what each decode row reads
    (the split-KV kernel splits only the window's span), so a short window over a long
    context is not split into idle programs.
    """
    if not _use_triton(query):
        return _CPU_ATTENTION[cpu_attention_impl()](
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    num_splits = 1
    if max_query_len == 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        num_sms = _num_sms(query.device.index or 0) if query.is_cuda else _DEFAULT_NUM_SMS
        context = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
        num_splits = split_kv_heuristic(
            num_seqs, key_cache.shape[2], max_query_len, context, num_sms
        )
    if num_splits > 1:
        from pagedserve.kernels.paged_attention_split_kv import paged_attention_split_kv_triton

        return paged_attention_split_kv_triton(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            num_splits=num_splits,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
    from pagedserve.kernels.paged_attention import paged_attention_triton

    return paged_attention_triton(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )


def copy_blocks(
    kv_cache: Tensor,  # [L, 2, NB, BS, Hkv, D]
    src: Tensor,  # [N] int64
    dst: Tensor,  # [N] int64
) -> None:
    """See :func:`pagedserve.kernels.reference.copy_blocks`."""
    if _use_triton(kv_cache):
        from pagedserve.kernels.copy_blocks import copy_blocks_triton

        copy_blocks_triton(kv_cache, src, dst)
    else:
        reference.copy_blocks(kv_cache, src, dst)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, unit_offset: bool = False
) -> Tensor:  # [T, H]
    """See :func:`pagedserve.kernels.reference.fused_add_rms_norm`."""
    if _use_triton(x):
        from pagedserve.kernels.fused_add_rms_norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps, unit_offset)
    out = cpu_layer_ops.add_rms_norm(x, residual, weight, eps, unit_offset)
    if out is not None:
        return out
    return reference.fused_add_rms_norm(x, residual, weight, eps, unit_offset)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos: Tensor, sin: Tensor
) -> None:
    """See :func:`pagedserve.kernels.reference.rotary_embedding`."""
    if _use_triton(query):
        from pagedserve.kernels.rotary_embedding import rotary_embedding_triton

        rotary_embedding_triton(positions, query, key, cos, sin)
    elif not cpu_layer_ops.rotary(positions, query, key, cos, sin):
        reference.rotary_embedding(positions, query, key, cos, sin)


def silu_and_mul(x: Tensor) -> Tensor:  # [T, 2I] -> [T, I]
    """See :func:`pagedserve.kernels.reference.silu_and_mul`."""
    if _use_triton(x):
        from pagedserve.kernels.silu_and_mul import silu_and_mul_triton

        return silu_and_mul_triton(x)
    out = cpu_layer_ops.silu_and_mul(x)
    return reference.silu_and_mul(x) if out is None else out


def gelu_tanh_and_mul(x: Tensor) -> Tensor:  # [T, 2I] -> [T, I]
    """See :func:`pagedserve.kernels.reference.gelu_tanh_and_mul`."""
    if _use_triton(x):
        from pagedserve.kernels.silu_and_mul import gelu_tanh_and_mul_triton

        return gelu_tanh_and_mul_triton(x)
    return reference.gelu_tanh_and_mul(x)


def fused_moe(
    x: Tensor,  # [T, H]
    topk_weights: Tensor,  # [T, k] float
    topk_ids: Tensor,  # [T, k] integer, in [0, E)
    w13: Tensor,  # [E, 2I, H]
    w2: Tensor,  # [E, H, I]
) -> Tensor:  # [T, H]
    """A sparse mixture of SwiGLU experts over routing already chosen (softmax, top-k and
    any renormalisation are the model's); contract of
    :func:`pagedserve.kernels.moe_reference.fused_moe_reference`.

    Triton (:mod:`.fused_moe`): grouped GEMMs over the rows sorted by expert, with no host
    sync. CPU (:mod:`.cpu_moe`): a loop over the experts hit, bit-identical to the reference
    and to transformers' expert loop.
    """
    if _use_triton(x):
        from pagedserve.kernels.fused_moe import fused_moe_triton

        return fused_moe_triton(x, topk_weights, topk_ids, w13, w2)
    from pagedserve.kernels.cpu_moe import fused_moe_cpu

    return fused_moe_cpu(x, topk_weights, topk_ids, w13, w2)


def lora_shrink(
    x: Tensor,  # [T, K]
    a: Tensor,  # [S, R, K]
    token_slots: Tensor,  # [T] int, in [-1, S)
) -> Tensor:  # [T, R] fp32
    """Each row times its own adapter's ``lora_A``; contract of
    :func:`pagedserve.kernels.lora_reference.lora_shrink_ref`.

    Triton (:mod:`.lora_triton`): rows grouped by slot on the device, one launch sized by
    shapes alone (no host sync, CUDA-graph capturable). CPU: the reference.
    """
    if _use_triton(x):
        from pagedserve.kernels.lora_triton import lora_shrink_triton

        return lora_shrink_triton(x, a, token_slots)
    return lora_shrink_ref(x, a, token_slots)


def lora_expand(
    s: Tensor,  # [T, R] fp32
    b: Tensor,  # [S, N, R]
    token_slots: Tensor,  # [T] int, in [-1, S)
    y: Tensor,  # [T, N], updated in place
) -> None:
    """``y`` plus each row's shrunk input times its own adapter's scaled ``lora_B``, in place;
    contract of :func:`pagedserve.kernels.lora_reference.lora_expand_ref`. Dispatch as for
    :func:`lora_shrink`."""
    if _use_triton(s):
        from pagedserve.kernels.lora_triton import lora_expand_triton

        lora_expand_triton(s, b, token_slots, y)
    else:
        lora_expand_ref(s, b, token_slots, y)
