"""The EAGLE-3 draft head of speculative decoding (``--speculative-config``'s ``eagle3``).

A head is one Llama decoder layer that reads the target's own features: the residual streams
entering three of the target's layers (``eagle_aux_hidden_state_layer_ids``, by default
vLLM's ``(2, L // 2, L - 3)``), concatenated and projected by ``fc`` to the head's width.
At position ``i`` it reads the target's features of ``i`` and the embedding of token
``i + 1``, and predicts token ``i + 2``; further drafts feed its own pre-norm output back in
place of the target's features. Its layer's queries and keys come from both halves at once:
``qkv_proj`` reads ``[input_layernorm(embedding), hidden_norm(features)]`` (``2 H`` wide).

Checkpoints are those vLLM and SGLang serve (EAGLE's and SpecForge's format):
``config.json`` of architecture ``LlamaForCausalLMEagle3`` with ``draft_vocab_size`` and
optionally ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids`` and
``norm_before_residual``; tensors ``fc``, ``midlayer.*`` (or ``layers.0.*``), ``norm``,
``lm_head`` over the draft vocabulary, ``d2t`` (draft id -> target id offset) and, optionally,
``embed_tokens`` (else the target's is shared). The head has its own KV cache of one layer
over the target's blocks, as a draft model has (:mod:`.draft`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from torch import Tensor, nn

from services.executor.model.config import ModelConfig
from services.executor.model.cuda_graphs import GraphBackend
from services.executor.model.eagle_graphs import HeadGraphs
from services.executor.model.errors import ModelLoadError
from services.executor.model.forward_batch import BatchBuilder, ForwardBatch, SeqChunk
from services.executor.model.kv_cache import allocate_kv_cache, bytes_per_block
from services.executor.model.layers.attention import Attention
from services.executor.model.layers.linear import Linear
from services.executor.model.layers.mlp import MLP
from services.executor.model.layers.norm import RMSNorm
from services.executor.model.layers.rotary import RotaryEmbedding
from services.executor.model.loader import (
    iter_checkpoint_slices,
    iter_checkpoint_weights,
    read_json_object,
)
from services.executor.model.models import DecoderLM
from services.executor.model.parallel import SingleComm

__all__ = [
    "EAGLE3_ARCHITECTURES",
    "Eagle3Config",
    "Eagle3Head",
    "Eagle3Runner",
    "default_aux_layers",
    "eagle3_bytes_per_block",
    "load_eagle3",
    "read_eagle3_config",
]

log = structlog.get_logger(__name__)

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_FIELD = "speculative_config.model"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default target layers for a model of ``num_layers``: ``(2, L // 2, L - 3)``,
    kept within the model for a shallow one; in layer order, as the features are."""
    return tuple(
        sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))
    )


@dataclass(frozen=True)
class Eagle3Config:
    """A head's configuration: ``model`` its decoder layer as a one-layer Llama (vocabulary:
    the target's), and what is EAGLE-3's own."""

    model: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False


def read_eagle3_config(path: str | Path, target: ModelConfig) -> Eagle3Config:
    """The head's ``config.json`` at ``path``, checked against ``target``; a ModelLoadError
    naming ``speculative_config.model`` when it cannot be the target's head."""
    try:
        hf = read_json_object(Path(path) / "config.json")
    except ModelLoadError as exc:
        raise ModelLoadError(f"{_FIELD}: {exc}") from None
    arch = (hf.get("architectures") or [None])[0]
    if arch not in EAGLE3_ARCHITECTURES:
        raise ModelLoadError(
            f"{_FIELD}: architecture {arch!r} is not an EAGLE-3 head ({EAGLE3_ARCHITECTURES[0]})"
        )
    if hf.get("num_hidden_layers", 1) != 1:
        raise ModelLoadError(f"{_FIELD}: num_hidden_layers must be 1 (one midlayer) for EAGLE-3")
    if hf.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ModelLoadError(
            f"{_FIELD}: vocab_size {hf['vocab_size']} is not the target's {target.vocab_size}"
        )
    llama = {
        **hf,
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": target.vocab_size,
        "num_hidden_layers": 1,
        "max_position_embeddings": max(
            int(hf.get("max_position_embeddings", 0)), target.max_model_len
        ),
    }
    try:
        model = ModelConfig.from_hf_config(llama, max_model_len=target.max_model_len)
    except (ModelLoadError, ValueError) as exc:
        raise ModelLoadError(f"{_FIELD}: {exc}") from None
    eagle = hf.get("eagle_config") or {}
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    aux = tuple(sorted(ids)) if ids else default_aux_layers(target.num_layers)
    if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i < target.num_layers for i in aux):
        raise ModelLoadError(
            f"{_FIELD}: eagle_aux_hidden_state_layer_ids must be 3 layers of the target's "
            f"{target.num_layers}, got {list(aux)}"
        )
    target_hidden = int(hf.get("target_hidden_size") or model.hidden_size)
    if target_hidden != target.hidden_size:
        raise ModelLoadError(
            f"{_FIELD}: target_hidden_size {target_hidden} is not the target's hidden size "
            f"{target.hidden_size}"
        )
    return Eagle3Config(
        model=model,
        draft_vocab_size=int(hf.get("draft_vocab_size") or target.vocab_size),
        target_hidden_size=target_hidden,
        aux_layers=aux,
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
    )


class _MidLayer(nn.Module):
    """The head's decoder layer (checkpoint prefix ``midlayer.``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.hidden_norm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = Attention(config, dtype, SingleComm())
        self.self_attn.qkv_proj = Linear(  # reads [embedding, features]: 2 H wide
            2 * h, config.q_size + 2 * config.kv_size, bias=config.qkv_bias, dtype=dtype
        )
        self.mlp = MLP(config, dtype, SingleComm())


class Eagle3Head(nn.Module):
    """An EAGLE-3 head (see the module docstring); ``embed`` is the target's embedding table
    when the checkpoint has none of its own."""

    def __init__(self, config: Eagle3Config, dtype: torch.dtype, embed: Tensor | None) -> None:
        super().__init__()
        mc = config.model
        self.config, self.dtype = config, dtype
        self.norm_before_residual = config.norm_before_residual
        h = mc.hidden_size
        self.shares_embed = embed is not None
        self.embed_tokens = (
            nn.Embedding(embed.shape[0], h, _weight=embed, _freeze=True)  # (no copy made)
            if embed is not None
            else nn.Embedding(mc.vocab_size, h, dtype=dtype)
        )
        self.fc = Linear(3 * config.target_hidden_size, h, bias=False, dtype=dtype)
        self.midlayer = _MidLayer(mc, dtype)
        self.norm = RMSNorm(h, mc.rms_norm_eps, dtype)
        self.lm_head = Linear(h, config.draft_vocab_size, bias=False, dtype=dtype)
        # Target id of draft id d: d + d2t[d].
        self.d2t: Tensor
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        # The target ids of the draft ids, from d2t once loaded (None: the same ids).
        self.target_ids: Tensor | None = None
        self.rotary_emb = RotaryEmbedding(mc.rope, mc.head_dim, mc.max_model_len, dtype)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_cache: Tensor, hidden: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Run ``batch``'s tokens, each with its ``hidden`` row: the target's features
        ``[T, 3 Ht]`` (projected by ``fc``) or the head's own pre-norm output ``[T, H]``.
        Writes K/V into ``kv_cache`` ``[1, 2, NB, BS, Hkv, D]``; returns, for
        ``batch.logits_indices``, fp32 logits over the target's vocabulary (draft ids mapped,
        the others -inf) ``[K, V]`` and the pre-norm output ``[K, H]``."""
        if hidden.shape[-1] != self.config.model.hidden_size:
            hidden = self.fc(hidden.to(self.dtype))
        layer = self.midlayer
        embeds = layer.input_layernorm(self.embed_tokens(batch.input_ids))
        if self.norm_before_residual:
            hidden = residual = layer.hidden_norm(hidden)
        else:
            residual, hidden = hidden.clone(), layer.hidden_norm(hidden)
        x = layer.self_attn(
            torch.cat([embeds, hidden], dim=-1), batch, self.rotary_emb, kv_cache[0]
        )
        x = layer.post_attention_layernorm(x, residual)  # residual += attention output
        x = layer.mlp(x)
        idx = batch.logits_indices
        prenorm = residual[idx]  # (a copy: the norm adds x into it)
        logits = self.lm_head(self.norm(x[idx], prenorm)).float()  # [K, Vd]
        if self.target_ids is None:
            return logits, prenorm
        full = logits.new_full((logits.shape[0], self.config.model.vocab_size), float("-inf"))
        full[:, self.target_ids] = logits
        return full, prenorm

    @torch.inference_mode()
    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Copy a checkpoint's tensors in (q/k/v and gate/up stacked); a ModelLoadError naming
        ``speculative_config.model`` for a tensor missing, unknown or of the wrong shape."""
        named = {p: w for n, w in weights.items() if (p := _param_name(n)) is not None}
        for fused, parts in (
            ("midlayer.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("midlayer.mlp.gate_up_proj", ("gate_proj", "up_proj")),
        ):
            base = fused.rsplit(".", 1)[0]
            for suffix in ("weight", "bias"):
                names = [f"{base}.{p}.{suffix}" for p in parts]
                if all(n in named for n in names):
                    named[f"{fused}.{suffix}"] = torch.cat([named.pop(n) for n in names])
        params: dict[str, Tensor] = dict(self.named_parameters())
        params["d2t"] = self.d2t
        needed = set(params) - ({"embed_tokens.weight"} if self.shares_embed else set())
        for name, weight in named.items():
            target = params.get(name)
            if target is None:
                raise ModelLoadError(
                    f"{_FIELD}: checkpoint tensor {name!r} has no place in the head"
                )
            if tuple(weight.shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"{_FIELD}: checkpoint tensor {name!r} has shape {tuple(weight.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(weight)
            needed.discard(name)
        if needed:
            raise ModelLoadError(f"{_FIELD}: checkpoint lacks {sorted(needed)[:8]}")
        ids = torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t
        full = ids.shape[0] == self.config.model.vocab_size and bool((self.d2t == 0).all())
        self.target_ids = None if full else ids


def _read_weights(path: Path) -> dict[str, Tensor]:
    """A head's tensors: from safetensors, or from the ``pytorch_model.bin`` EAGLE's own
    releases ship (read as weights only)."""
    try:
        if (path / "pytorch_model.bin").is_file() and not any(path.glob("*.safetensors")):
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
            return {str(k): v for k, v in state.items()}
        return dict(iter_checkpoint_weights(path))
    except (ModelLoadError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"{_FIELD}: {exc}") from None


def _target_embeddings(target: DecoderLM, target_dir: str | Path) -> Tensor:
    """The target's whole embedding table, from its checkpoint (a sharded target holds a
    slice of it on each rank)."""
    for name, weight in iter_checkpoint_slices(target_dir):
        if target.checkpoint_name(name) == "model.embed_tokens.weight":
            return weight[:]
    raise ModelLoadError(f"{_FIELD}: the head has no embed_tokens, nor the target's checkpoint")


def _param_name(name: str) -> str | None:
    """Our name of checkpoint tensor ``name`` (None: skipped)."""
    name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
    return None if name == "t2d" or name.endswith("rotary_emb.inv_freq") else name


def load_eagle3(path: str, target: DecoderLM, target_dir: str | Path) -> Eagle3Head:
    """The EAGLE-3 head at ``path`` for ``target`` (on rank 0, in its dtype on its device; the
    checkpoint at ``target_dir``); sets the target's :attr:`DecoderLM.aux_layers` so that its
    forwards keep the features."""
    config = read_eagle3_config(path, target.config)
    weights = _read_weights(Path(path))
    device = next(target.parameters()).device
    shared: Tensor | None = None
    if "embed_tokens.weight" not in {_param_name(n) for n in weights}:
        # The target's: this rank's rows when it holds them all, else read whole.
        shared = target.embed_tokens.weight
        if target.shard.size > 1:
            shared = _target_embeddings(target, target_dir).to(device, target.dtype)
    with torch.device(device):
        head = Eagle3Head(config, target.dtype, shared)
    head.load_weights(weights)
    head.rotary_emb.compute_tables()
    head.eval().requires_grad_(False)
    target.aux_layers = config.aux_layers
    log.info(
        "eagle3_head_loaded",
        model_dir=path,
        aux_layers=list(config.aux_layers),
        draft_vocab_size=config.draft_vocab_size,
        shares_target_embeddings=shared is not None,
        num_params=sum(p.numel() for p in head.parameters() if p is not shared),
    )
    return head


def eagle3_bytes_per_block(head: Eagle3Head, block_size: int) -> int:
    """What one block of the head's one-layer cache costs, beside the target's."""
    return bytes_per_block(head.config.model, block_size, head.dtype, 1)


class Eagle3Runner:
    """Runs ``head`` over its own cache of the target's ``num_blocks`` blocks: eagerly, or
    its drafting forwards through :class:`~.eagle_graphs.HeadGraphs` once captured."""

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int) -> None:
        mc = head.config.model
        self.head = head
        self.device = next(head.parameters()).device
        self.kv_cache = allocate_kv_cache(mc, num_blocks, block_size, head.dtype, self.device, 1)
        self.builder = BatchBuilder(
            block_size,
            self.device,
            num_blocks=num_blocks,
            max_model_len=mc.max_model_len,
            vocab_size=mc.vocab_size,
            num_groups=1,
        )
        self.graphs: HeadGraphs | None = None

    def capture(self, sizes: Sequence[int], backend: GraphBackend) -> None:
        """Capture the head's drafting forwards (one token a sequence) for batch ``sizes``."""
        head, mc = self.head, self.head.config.model
        graphs = HeadGraphs(
            head,
            mc.hidden_size,
            head.dtype,
            mc.max_model_len,
            self.kv_cache,
            self.builder,
            sizes,
            backend,
        )
        graphs.capture()
        log.info(
            "eagle3_graphs_captured", sizes=list(graphs.sizes), seconds=round(graphs.capture_s, 2)
        )
        self.graphs = graphs

    def execute(self, chunks: Sequence[SeqChunk], hidden: Tensor) -> tuple[Tensor, Tensor]:
        """One forward of ``chunks``, ``hidden`` a row per token (see :meth:`Eagle3Head.forward`):
        (logits, pre-norm output) of the rows ``need_logits`` asks for."""
        graphs = self.graphs
        key = graphs.serves(chunks, hidden) if graphs is not None else None
        if key is not None:
            assert graphs is not None
            return graphs.run(chunks, hidden, key)
        host = self.builder.prepare(chunks).host
        d64, d32 = self.builder.upload_packed(host)
        batch = host.layout.views(d64, d32, host.max_query_len, host.max_seq_len)
        return self.head(batch, self.kv_cache, hidden)
