"""Gemma 2 and Gemma 3: the shared decoder with Gemma's layer structure and checkpoint names.

What differs from Llama is configuration, read from :class:`ModelConfig` by the shared layers
(``(1 + w)`` RMSNorm gains, GeGLU, scaled embeddings, ``query_pre_attn_scalar``, soft-capping,
sliding-window layers with their own RoPE base, Gemma 3's QK-norm), plus two things here:

- the "sandwich" layer: each sub-block's output is normalised before it joins the residual
  stream, ``h + post_norm(attn(input_norm(h)))`` then ``h + post_ff_norm(mlp(pre_ff_norm(h)))``;
- ``Gemma3ForConditionalGeneration`` checkpoints, whose language model is nested
  (``model.language_model.*`` as transformers 5 writes it, ``language_model.model.*`` on the
  Hub); the vision tower and the projector are skipped without being read.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from services.executor.model.config import ModelConfig
from services.executor.model.forward_batch import ForwardBatch
from services.executor.model.layers.attention import Attention
from services.executor.model.layers.mlp import MLP
from services.executor.model.layers.rotary import RotaryEmbedding
from services.executor.model.models.llama import DecoderLM, hidden_norm, input_norm
from services.executor.model.parallel import Comm

__all__ = ["GemmaDecoderLayer", "GemmaLM"]

# Checkpoint prefixes of a multimodal Gemma 3 -> ours; None: not the language model, skipped.
_NESTED: tuple[tuple[str, str | None], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", None),
    ("model.multi_modal_projector.", None),
    ("vision_tower.", None),
    ("multi_modal_projector.", None),
)


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3's layer: four norms, the residual adds fused into the next pre-norm."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, comm: Comm, layer_idx: int = 0
    ) -> None:
        super().__init__()
        self.input_layernorm = hidden_norm(config, dtype)  # (1 + w) gains: Gemma's config
        self.self_attn = Attention(config, dtype, comm, layer_idx)
        self.post_attention_layernorm = hidden_norm(config, dtype)
        self.pre_feedforward_layernorm = hidden_norm(config, dtype)
        self.mlp = MLP(config, dtype, comm)
        self.post_feedforward_layernorm = hidden_norm(config, dtype)

    def forward(
        self,
        h: Tensor,  # [T, H]: the previous layer's output (the embeddings for layer 0)
        residual: Tensor | None,  # [T, H]: the residual stream before h was added; updated
        batch: ForwardBatch,
        rotary_emb: RotaryEmbedding,
        kv_cache: Tensor,
    ) -> tuple[Tensor, Tensor]:  # (this layer's output, the residual stream before it)
        x, residual = input_norm(self.input_layernorm, h, residual)
        x = self.post_attention_layernorm(self.self_attn(x, batch, rotary_emb, kv_cache))
        x = self.pre_feedforward_layernorm(x, residual)  # residual += normed attention
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaLM(DecoderLM):
    """Gemma 2 / Gemma 3 (text, or the language model of the multimodal checkpoint)."""

    layer_class = GemmaDecoderLayer

    def checkpoint_name(self, name: str) -> str | None:
        for prefix, ours in _NESTED:
            if name.startswith(prefix):
                return None if ours is None else ours + name.removeprefix(prefix)
        return name
