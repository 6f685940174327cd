"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, and with a sparse mixture
of experts in place of the MLP, Mixtral and Qwen3-MoE) over a paged KV cache.

One implementation for the family; the members differ only in configuration (biases, RoPE
scaling, tied embeddings), all read from :class:`ModelConfig`. The forward pass runs on a
FLATTENED batch: the query tokens of every sequence in the step are concatenated on one
token axis ``T``, with no padding; :class:`ForwardBatch` says where each sequence's tokens
and cached context are. Attention goes through ``pagedserve.kernels.ops`` (Triton on CUDA,
torch on CPU).

Shapes: T tokens in the step, H hidden size, Hq/Hkv query/KV heads, D head dim, I MLP
intermediate size, V vocabulary, K rows whose logits are wanted, L layers,
NB blocks of BS slots in the cache.

Numerics follow Hugging Face transformers (RMSNorm in fp32, RoPE with the rotate-half
convention and cos/sin cast to the model dtype) so that results match it in fp32.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from services.executor.model.config import ModelConfig, MoEConfig
from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import ForwardBatch
from services.executor.model.kv_layout import KVCacheLayout, plan_kv_layout
from services.executor.model.layers.attention import Attention
from services.executor.model.layers.linear import (
    Linear,
    Placement,
    VocabParallelEmbedding,
    tensor_shape,
)
from services.executor.model.layers.mlp import MLP
from services.executor.model.layers.moe import SparseMoE
from services.executor.model.layers.norm import RMSNorm
from services.executor.model.layers.rotary import RotaryEmbedding
from services.executor.model.parallel import Comm, ShardPlan, SingleComm

__all__ = ["DecoderLM", "hidden_norm", "input_norm"]


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``; the residual
    adds are fused into the next norm."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, comm: Comm, layer_idx: int = 0
    ) -> None:
        super().__init__()
        self.input_layernorm = hidden_norm(config, dtype)
        self.self_attn = Attention(config, dtype, comm, layer_idx)
        self.post_attention_layernorm = hidden_norm(config, dtype)
        moe = config.moe
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config.hidden_size, moe, dtype, comm)
            if moe is not None and layer_idx in moe.layers
            else MLP(config, dtype, comm)
        )

    def forward(
        self,
        h: Tensor,  # [T, H]: the previous layer's output (the embeddings for layer 0)
        residual: Tensor | None,  # [T, H]: the residual stream before h was added; updated
        batch: ForwardBatch,
        rotary_emb: RotaryEmbedding,
        kv_cache: Tensor,
    ) -> tuple[Tensor, Tensor]:  # (this layer's output, the residual stream before it)
        x, residual = input_norm(self.input_layernorm, h, residual)
        x = self.self_attn(x, batch, rotary_emb, kv_cache)
        x = self.post_attention_layernorm(x, residual)  # residual += attention output
        return self.mlp(x), residual


def input_norm(norm: RMSNorm, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    """A layer's first norm: of the embeddings ``h`` for layer 0 (which start the residual
    stream), else of ``h + residual`` with the sum kept in ``residual``. Returns (normed,
    residual stream)."""
    if residual is None:
        return norm(h), h
    return norm(h, residual), residual  # residual += h


def hidden_norm(config: ModelConfig, dtype: torch.dtype) -> RMSNorm:
    """An RMSNorm over the hidden size, with the family's gain (``1 + w`` for Gemma)."""
    return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, config.norm_unit_offset)


# Our fused projections and the HF projections stacked into them, in order along dim 0.
_FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# An fp8 checkpoint's per-layer KV scales (llm-compressor's names).
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale")
# Our mixture-of-experts parameters: layers.{i}.mlp.{gate.weight | w13 | w2}.
_MOE_PARAM = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|w13|w2)")
# Row-parallel projections: each rank holds a slice of the input columns; the bias is added
# once, by rank 0 (the others hold zeros), before the all-reduce.
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


class DecoderLM(nn.Module):
    """The whole causal LM: embeddings, decoder layers, final norm, LM head; one rank's shard
    of it under tensor parallelism (``shard`` and ``comm``; one rank by default).

    A family with another layer structure sets :attr:`layer_class`; one whose checkpoint names
    its tensors otherwise overrides :meth:`checkpoint_name`.
    """

    layer_class: type[nn.Module] = DecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        shard: ShardPlan | None = None,
        comm: Comm | None = None,
    ) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.shard = shard or ShardPlan.of(config)
        self.comm: Comm = comm or SingleComm()
        if self.comm.size != self.shard.size:
            raise ValueError(f"a shard of {self.shard.size} ranks over {self.comm.size}")
        #: This rank's heads and MLP width: its layers and its KV-cache shard are built from it.
        self.local_config = lc = self.shard.local_config(config)
        self.embed_tokens = VocabParallelEmbedding(self.shard, config.hidden_size, dtype, self.comm)
        self.layers = nn.ModuleList(
            self.layer_class(lc, dtype, self.comm, i) for i in range(lc.num_layers)
        )
        self.norm = hidden_norm(config, dtype)
        self.lm_head = Linear(config.hidden_size, self.shard.vocab_rows, bias=False, dtype=dtype)
        if config.labels:  # a sequence classifier: its score head (the LM head is tied: unused)
            rows = torch.empty(len(config.labels), config.hidden_size, dtype=dtype)
            self.score = nn.Parameter(rows, requires_grad=False)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, config.max_model_len, dtype)
        # Gemma: sqrt(hidden), rounded to the model dtype as transformers rounds it.
        self.embed_scale: float | None = None
        if config.embed_scale is not None:
            self.embed_scale = float(torch.tensor(config.embed_scale, device="cpu", dtype=dtype))
        # Gemma 3's sliding layers rotate with their own base.
        self.rotary_emb_local: RotaryEmbedding | None = None
        if config.sliding_rope is not None:
            self.rotary_emb_local = RotaryEmbedding(
                config.sliding_rope, config.head_dim, config.max_model_len, dtype
            )
        self.kv_layout = plan_kv_layout(lc, hybrid=False)  # every layer its own slice
        #: EAGLE-3 (speculative decoding): the layers whose input residual streams each
        #: forward keeps, concatenated in this order in :attr:`aux_hidden` ``[T, len * H]``
        #: (none: not kept).
        self.aux_layers: tuple[int, ...] = ()
        # --runner pooling: forward returns the final hidden states, not logits.
        self.pooling = False
        self.aux_hidden: Tensor | None = None
        #: The dtype its KV cache stores K/V in (``--kv-cache-dtype``; default: its own).
        self.kv_cache_dtype: torch.dtype = dtype
        # Per layer, the checkpoint's fp8 KV scales (llm-compressor's k_scale / v_scale).
        self.kv_scales: dict[tuple[int, str], float] = {}
        self._tie_weights()

    def use_kv_layout(self, layout: KVCacheLayout) -> None:
        """Read and write the KV cache as ``layout`` lays it out (set before the cache is
        sized): each layer through its group's block table, in its slot of the cache."""
        if len(layout.layer_group) != len(self.layers):
            raise ValueError(f"a KV layout of {len(layout.layer_group)} layers")
        self.kv_layout = layout
        for layer, group in zip(self.layers, layout.layer_group, strict=True):
            attention = layer.self_attn
            assert isinstance(attention, Attention)
            attention.kv_group = group

    def use_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Store K/V in ``dtype``. An fp8 one: each layer divides them by its scales (the
        checkpoint's ``k_scale`` / ``v_scale``, else 1.0) on write, and its attention
        multiplies them back (the scores' scale by ``k_scale``, the output by ``v_scale``).
        bf16 (for an fp32 model) stores them rounded, int8 as records each carrying its own
        scale (:mod:`pagedserve.kernels.kv_quant`): no per-layer scales."""
        self.kv_cache_dtype = dtype
        if not dtype.is_floating_point or dtype.itemsize != 1:
            return
        for i, layer in enumerate(self.layers):
            attention = layer.self_attn
            assert isinstance(attention, Attention)
            attention.quantize_kv(
                dtype, self.kv_scales.get((i, "k"), 1.0), self.kv_scales.get((i, "v"), 1.0)
            )

    @classmethod
    def empty(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ShardPlan | None = None,
        comm: Comm | None = None,
    ) -> DecoderLM:
        """A model on ``device`` with uninitialised weights (no time spent on random init),
        ready for :meth:`load_weights`; the RoPE tables are computed. A shard of several
        ranks is zero-filled first: its padding rows and the row-parallel biases of ranks
        other than 0 are never loaded and must be zero.
        """
        with torch.device("meta"):
            model = cls(config, dtype, shard, comm)
        model.to_empty(device=device)
        model._tie_weights()  # to_empty gives each module its own new parameter
        if model.shard.size > 1:
            for param in model.parameters():
                param.detach().zero_()
        model.rotary_emb.compute_tables()
        if model.rotary_emb_local is not None:
            model.rotary_emb_local.compute_tables()
        return model.eval().requires_grad_(False)

    def _tie_weights(self) -> None:
        if self.config.tie_word_embeddings or self.config.labels:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: Tensor) -> Tensor:
        """Run every token of ``batch``, writing its K/V into ``kv_cache``
        ``[S, 2, NB, BS, Hkv, D]`` (this rank's KV heads, a slot per layer of a KV-cache group:
        :attr:`kv_layout`); return fp32 logits ``[K, V]`` for ``batch.logits_indices`` only (on
        rank 0; other ranks return a placeholder), or with :attr:`pooling` the final hidden
        states ``[K, H]`` of those rows.
        """
        c = self.config
        h = self.embed_tokens(batch.input_ids)  # [T, H]
        if self.embed_scale is not None:  # Gemma
            h = h * self.embed_scale
        residual: Tensor | None = None
        aux: dict[int, Tensor] = {}
        for i, (layer, slot) in enumerate(zip(self.layers, self.kv_layout.layer_slot, strict=True)):
            if i in self.aux_layers:  # the residual stream entering layer i
                aux[i] = h.clone() if residual is None else h + residual  # (h: added into)
            rotary = self.rotary_emb
            if self.rotary_emb_local is not None and i in c.sliding_layers:
                rotary = self.rotary_emb_local
            h, residual = layer(h, residual, batch, rotary, kv_cache[slot])  # [T, H] x2
        assert residual is not None
        if aux:
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        idx = batch.logits_indices  # the norm is per token: only the rows whose logits we need
        h = self.norm(h[idx], residual[idx])  # [K, H]
        if self.pooling:
            return h.float().contiguous()  # [K, H] (every rank holds them whole)
        logits = self.lm_head(h)  # [K, V / N padded]
        if self.comm.size > 1:
            logits = self.comm.gather_last_dim(logits)  # rank 0: [K, N * V/N padded]
            if self.comm.rank != 0:
                return logits  # rank 0 samples; nobody reads this
            logits = logits[:, : c.vocab_size]
        if c.final_logit_softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            cap = c.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float().contiguous()  # [K, V]

    def hf_weight_names(self) -> set[str]:
        """The tensor names a complete HF-format checkpoint of this model provides."""
        names: set[str] = set()
        for name, _ in self.named_parameters():  # a tied lm_head is listed once, as embed
            hf_name = name if name == "lm_head.weight" else f"model.{name}"
            if name == "score":
                hf_name = "score.weight"
            expert_names = self._expert_hf_names(hf_name)
            if expert_names is not None:
                names |= expert_names
                continue
            for fused, parts in _FUSED_PARTS.items():
                if f".{fused}." in hf_name:
                    names |= {hf_name.replace(fused, part) for part in parts}
                    break
            else:
                names.add(hf_name)
        return names

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named tensors into the model (converting dtype, stacking q/k/v and
        gate/up into the fused projections). A weight is a tensor or a safetensors slice
        (``safe_open(...).get_slice(name)``): a shard reads only the rows or columns it
        holds, so no rank ever holds the whole model.

        Raises :class:`ModelLoadError` for an unknown name, a wrong shape, or (at the end)
        a tensor of :meth:`hf_weight_names` the stream did not provide.
        """
        params = dict(self.named_parameters())
        missing = self.hf_weight_names()
        renamed = ((self.checkpoint_name(name), w) for name, w in weights)
        for hf_name, weight in self._unfused((n, w) for n, w in renamed if n is not None):
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # some old checkpoints store the (recomputed) RoPE frequencies
            scale = _KV_SCALE.fullmatch(hf_name)
            if scale is not None:  # an fp8 checkpoint's KV scales (used with an fp8 cache)
                layer, which = int(scale.group(1)), scale.group(2)
                self.kv_scales[(layer, which)] = float(torch.as_tensor(weight[...]).float().max())
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the LM head
            place = self._place(params, hf_name)
            if place is None:
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}"
                )
            missing.discard(hf_name)
            expected = list(place.target.shape)
            if place.dim is not None:
                expected[place.dim] = place.total
            if tensor_shape(weight) != tuple(expected):
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has shape {tensor_shape(weight)}, "
                    f"expected {tuple(expected)}"
                )
            if not place.copy:
                continue
            if place.dim is None:
                place.target.copy_(weight[:])
            elif place.target.numel():
                n = place.target.shape[place.dim]
                index = (slice(None),) * place.dim + (slice(place.start, place.start + n),)
                place.target.copy_(weight[index])
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors: {sorted(missing)[:8]}")

    def checkpoint_name(self, name: str) -> str | None:
        """The name under which a checkpoint tensor is placed (None: skip the tensor).
        Identity here; a family whose checkpoints nest the language model overrides it."""
        return name

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights`` with checkpoints' own fused projections (Phi-3 stores ``qkv_proj`` and
        ``gate_up_proj``) cut into the parts the other families store, so that one path
        places every part on its rank. Slicing a safetensors slice reads only that part."""
        c = self.config
        for hf_name, weight in weights:
            for fused, parts in _FUSED_PARTS.items():
                if f".{fused}." not in hf_name:
                    continue
                bounds: tuple[int, ...]
                if fused == "self_attn.qkv_proj":
                    bounds = (0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)
                else:
                    bounds = (0, c.intermediate_size, 2 * c.intermediate_size)
                if tensor_shape(weight)[0] != bounds[-1]:
                    raise ModelLoadError(
                        f"checkpoint tensor {hf_name!r} has shape {tensor_shape(weight)}, "
                        f"expected {bounds[-1]} rows"
                    )
                for part, start, end in zip(parts, bounds[:-1], bounds[1:], strict=True):
                    yield hf_name.replace(fused, part), weight[start:end]
                break
            else:
                yield hf_name, weight

    def _place(self, params: dict[str, nn.Parameter], hf_name: str) -> Placement | None:
        """Where checkpoint tensor ``hf_name`` goes on this rank (None: nowhere, an error)."""
        if hf_name == "score.weight" and self.config.labels:
            return Placement(params["score"])  # (every rank: pooling reads full states)
        if hf_name == "lm_head.weight":
            name = hf_name
        elif hf_name.startswith("model.") and not hf_name.startswith("model.lm_head."):
            name = hf_name.removeprefix("model.")
        else:
            return None
        s, c = self.shard, self.config
        if c.moe is not None:
            expert = self._place_expert(params, name, c.moe)
            if expert is not None:
                return expert
        if name in ("embed_tokens.weight", "lm_head.weight"):
            param = params.get(name)
            if param is None:
                return None
            return Placement(param[: s.num_real_vocab], 0, s.vocab_start, c.vocab_size)
        for fused, parts in _FUSED_PARTS.items():
            for part_index, part in enumerate(parts):
                if f".{part}." in name:
                    param = params.get(name.replace(part, fused))
                    if param is None:
                        return None
                    offset, rows, start, total = self._fused_part(fused, part_index)
                    return Placement(param[offset : offset + rows], 0, start, total)
        for row_parallel in _ROW_PARALLEL:
            if f".{row_parallel}." in name:
                param = params.get(name)
                if param is None:
                    return None
                if name.endswith(".bias"):
                    return Placement(param, copy=s.rank == 0)
                if row_parallel == "self_attn.o_proj":
                    d = c.head_dim
                    return Placement(param, 1, s.q_head_start * d, c.q_size)
                n = s.num_real_intermediate
                return Placement(param[:, :n], 1, s.intermediate_start, c.intermediate_size)
        param = params.get(name)
        return None if param is None else Placement(param)

    def _expert_hf_names(self, hf_name: str) -> set[str] | None:
        """The checkpoint names behind a mixture-of-experts parameter (None: not one)."""
        moe = self.config.moe
        match = _MOE_PARAM.fullmatch(hf_name)
        if moe is None or match is None:
            return None
        layer, param = match.group(1), match.group(2)
        base = f"model.layers.{layer}.{moe.hf_prefix}"
        if param == "gate.weight":
            return {f"{base}.gate.weight"}
        parts = moe.hf_parts[:2] if param == "w13" else moe.hf_parts[2:]
        return {
            f"{base}.experts.{e}.{part}.weight" for e in range(moe.num_experts) for part in parts
        }

    def _place_expert(
        self, params: dict[str, nn.Parameter], name: str, moe: MoEConfig
    ) -> Placement | None:
        """Where a mixture-of-experts checkpoint tensor goes (None: it is not one). The router
        is replicated; each expert's gate and up rows (``[I, H]`` each) and down columns
        (``[H, I]``) are this rank's slice of ``I``, as the dense MLP's are; the padding
        past the real rows stays zero."""
        prefix = re.escape(moe.hf_prefix)
        router = re.fullmatch(rf"layers\.(\d+)\.{prefix}\.gate\.weight", name)
        if router is not None:
            param = params.get(f"layers.{router.group(1)}.mlp.gate.weight")
            return None if param is None else Placement(param)
        match = re.fullmatch(rf"layers\.(\d+)\.{prefix}\.experts\.(\d+)\.(\w+)\.weight", name)
        if match is None or match.group(3) not in moe.hf_parts:
            return None
        layer, expert, part = match.group(1), int(match.group(2)), match.group(3)
        which = moe.hf_parts.index(part)  # 0 gate, 1 up, 2 down
        param = params.get(f"layers.{layer}.mlp.{'w2' if which == 2 else 'w13'}")
        if param is None or expert >= moe.num_experts:
            return None
        s, total = self.shard, moe.intermediate_size
        n, start = s.num_real_moe_intermediate, s.moe_intermediate_start
        if which == 2:
            return Placement(param[expert, :, :n], 1, start, total)
        rows = s.moe_intermediate_rows
        return Placement(param[expert, which * rows : which * rows + n], 0, start, total)

    def _fused_part(self, fused: str, part_index: int) -> tuple[int, int, int, int]:
        """(first row in the fused parameter, rows filled, first checkpoint row, checkpoint
        rows in all) of part ``part_index`` of ``fused`` on this rank."""
        s, c = self.shard, self.config
        if fused == "self_attn.qkv_proj":
            d = c.head_dim
            q, kv = s.num_heads * d, s.num_kv_heads * d
            return (
                (0, q, s.q_head_start * d, c.q_size),
                (q, kv, s.kv_head_start * d, c.kv_size),
                (q + kv, kv, s.kv_head_start * d, c.kv_size),
            )[part_index]
        rows = s.intermediate_rows
        return (
            part_index * rows,
            s.num_real_intermediate,
            s.intermediate_start,
            c.intermediate_size,
        )
