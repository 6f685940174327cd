"""EAGLE-3 heads for tests and benchmarks: a dense torch reference of the head (the same
computation as ``services.executor.model.eagle``, in transformers' numerics and
differentiable, so it can be trained), and writing a head checkpoint for a target.

``pagedserve make-tiny-model DIR --eagle3-for TARGET`` writes a random head for the checkpoint
at ``TARGET``; ``bench.common.eagle3`` trains one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from services.executor.model.eagle import default_aux_layers

__all__ = ["Eagle3Reference", "head_config", "save_head", "target_features", "write_random_head"]

ARCHITECTURE = "LlamaForCausalLMEagle3"


def head_config(target: dict[str, Any], aux_layers: tuple[int, ...] | None = None) -> dict:
    """A head's ``config.json`` for a target of config ``target``: the target's width,
    heads, RoPE and vocabulary, one layer, the full vocabulary as the draft one."""
    text = target.get("text_config", target)
    num_layers = int(text["num_hidden_layers"])
    if aux_layers is None:
        aux_layers = default_aux_layers(num_layers)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    theta = float(
        text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta") or 1e4
    )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(text["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.get("num_key_value_heads", heads)),
        "head_dim": int(text.get("head_dim") or hidden // heads),
        "num_hidden_layers": 1,
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "max_position_embeddings": int(text["max_position_embeddings"]),
        "vocab_size": int(text["vocab_size"]),
        "draft_vocab_size": int(text["vocab_size"]),
        "target_hidden_size": hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
        "torch_dtype": "float32",
    }


class _Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, lc: LlamaConfig, head_dim: int) -> None:
        super().__init__()
        h, eps = lc.hidden_size, lc.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps)
        self.hidden_norm = LlamaRMSNorm(h, eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        heads = int(lc.num_attention_heads)
        self.self_attn = _Attention(h, heads, int(lc.num_key_value_heads or heads), head_dim)
        self.mlp = LlamaMLP(lc)


class Eagle3Reference(nn.Module):
    """A dense EAGLE-3 head with the checkpoint's tensor names (q/k/v and gate/up apart).

    :meth:`forward` runs ``depth`` drafting steps over a batch of sequences at once, as
    EAGLE-3's training-time test does: step 1 reads the target's features ``f_i`` and token
    ``t_{i+1}`` at position ``i``; step ``s`` reads its own step ``s - 1`` output and token
    ``t_{i+s}`` at position ``i + s - 1``, attending to step 1's keys up to ``i`` and its own
    chain's later keys, as drafting does. Step ``s``'s logits at ``i`` predict ``t_{i+s+1}``."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        lc = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
        lc._attn_implementation = "eager"
        h, d = lc.hidden_size, config["head_dim"]
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(d)
        vd = config["draft_vocab_size"]
        self.embed_tokens = nn.Embedding(lc.vocab_size, h)
        self.fc = nn.Linear(3 * config["target_hidden_size"], h, bias=False)
        self.midlayer = _MidLayer(lc, d)
        self.norm = LlamaRMSNorm(h, lc.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.d2t: Tensor
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
        self.rotary = LlamaRotaryEmbedding(lc)

    def forward(
        self, tokens: Tensor, features: Tensor, depth: int = 1
    ) -> list[tuple[Tensor, Tensor]]:
        """``tokens`` ``[B, T + depth]`` (t_0 ..), ``features`` ``[B, T, 3 Ht]`` (f_0 ..);
        returns per step (draft-vocabulary logits ``[B, T, Vd]``, pre-norm ``[B, T, H]``)."""
        b, t = features.shape[:2]
        mid, attn = self.midlayer, self.midlayer.self_attn
        hidden = self.fc(features)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        out = []
        roots = torch.arange(t, device=features.device)
        for s in range(1, depth + 1):
            embeds = mid.input_layernorm(self.embed_tokens(tokens[:, s : s + t]))
            if self.config.get("norm_before_residual"):
                residual = normed = mid.hidden_norm(hidden)
            else:
                residual, normed = hidden, mid.hidden_norm(hidden)
            x = torch.cat([embeds, normed], dim=-1)
            q = attn.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            positions = (roots + s - 1).expand(b, t)
            cos, sin = self.rotary(v, positions)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.append(k)
            values.append(v)
            ks = torch.cat(keys, dim=2).repeat_interleave(self.num_heads // self.num_kv_heads, 1)
            vs = torch.cat(values, dim=2).repeat_interleave(self.num_heads // self.num_kv_heads, 1)
            # Step 1's keys up to the query's root, and its own chain's keys of later steps.
            allowed = [roots[None, :] <= roots[:, None]]
            allowed += [roots[None, :] == roots[:, None]] * (s - 1)
            mask = torch.cat(allowed, dim=1)  # [T, s * T]
            scores = (q @ ks.transpose(2, 3)) * self.head_dim**-0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            a = (probs @ vs).transpose(1, 2).reshape(b, t, -1)
            h = attn.o_proj(a) + residual
            y = mid.mlp(mid.post_attention_layernorm(h)) + h  # the pre-norm output
            out.append((self.lm_head(self.norm(y)), y))
            hidden = y
        return out

    def target_logits(self, draft_logits: Tensor, vocab_size: int) -> Tensor:
        """Draft-vocabulary logits over the target's vocabulary (the others -inf)."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
        ids = torch.arange(draft_logits.shape[-1], device=draft_logits.device) + self.d2t
        full[..., ids] = draft_logits
        return full


@torch.no_grad()
def target_features(model: nn.Module, tokens: Tensor, aux_layers: tuple[int, ...]) -> Tensor:
    """A transformers target's features of ``tokens`` ``[B, T]``: the residual streams entering
    ``aux_layers``, concatenated in layer order ``[B, T, 3 H]`` (``hidden_states[i]`` enters
    layer ``i``)."""
    states = model(tokens, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in sorted(aux_layers)], dim=-1)


def save_head(head: Eagle3Reference, out_dir: Path, with_embed: bool = True) -> Path:
    """Write ``head`` as a checkpoint (``config.json`` + ``model.safetensors``); without
    ``embed_tokens`` unless ``with_embed`` (the executor then shares the target's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().contiguous().clone()
        for k, v in head.state_dict().items()
        if not k.startswith("rotary.") and (with_embed or k != "embed_tokens.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head.config, indent=2) + "\n")
    return out_dir


def write_random_head(
    target_dir: Path,
    out_dir: Path,
    seed: int = 0,
    std: float = 0.25,
    draft_vocab_size: int | None = None,
    **config: Any,
) -> Path:
    """A random head for the checkpoint at ``target_dir``, seeded (norm gains near one); with
    ``draft_vocab_size``, over that many of the target's ids, drawn (``d2t`` maps them);
    ``config``: other ``config.json`` entries (e.g. ``norm_before_residual``)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    torch.manual_seed(seed)
    cfg = head_config(target)
    if draft_vocab_size is not None:
        cfg["draft_vocab_size"] = draft_vocab_size
    head = Eagle3Reference({**cfg, **config})
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
        if draft_vocab_size is not None:
            ids = torch.randperm(cfg["vocab_size"])[:draft_vocab_size].sort().values
            head.d2t.copy_(ids - torch.arange(draft_vocab_size))
    return save_head(head, out_dir)
