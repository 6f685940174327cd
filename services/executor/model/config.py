"""The model hyper-parameters the executor needs, parsed from a Hugging Face ``config.json``.

Supported (:data:`SUPPORTED_ARCHITECTURES`), all decoder-only transformers built from the
shared layers in ``services.executor.model.layers``:

- Llama 2/3 (``LlamaForCausalLM``), Mistral (``MistralForCausalLM``), Qwen2
  (``Qwen2ForCausalLM``);
- Qwen3 (``Qwen3ForCausalLM``): per-head RMSNorm of q and k (QK-norm), an explicit
  ``head_dim``;
- Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): fused checkpoint tensors cut at load, partial
  rotary and LongRoPE;
- the mixtures of experts Mixtral (``MixtralForCausalLM``) and Qwen3-MoE
  (``Qwen3MoeForCausalLM``), described by :class:`MoEConfig`;
- Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 (``Gemma3ForCausalLM``, and the language model
  of ``Gemma3ForConditionalGeneration``): ``(1 + w)`` RMSNorms, four per layer, GELU-tanh,
  scaled embeddings, ``query_pre_attn_scalar``, logit soft-capping, and sliding-window layers
  interleaved with global ones (Gemma 3's with their own RoPE base).

Sliding-window attention is per layer (:meth:`ModelConfig.window`): in the layers that
transformers builds as sliding, a query at position p sees the keys in (p - W, p], as
transformers masks it. A window at least as long as ``max_model_len`` is full attention and is
recorded as none. The KV cache still keeps every token of every layer.

Fields a config omits take transformers' defaults for that family (:data:`_FAMILY_DEFAULTS`).
Anything else raises :class:`UnsupportedModelError` with a message saying what and why; a
malformed field raises :class:`ModelLoadError` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.executor.model.errors import ModelLoadError, UnsupportedModelError
from services.executor.model.rope_config import DEFAULT_ROPE_THETA, RopeConfig, parse_rope

__all__ = ["CLASSIFIER_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "MoEConfig", "ModelConfig"]
__all__ += ["RopeConfig"]

#: HF architecture class name -> our family name (HF ``model_type``, Gemma 3 unified).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
#: Sequence classifiers (a ``score`` head of ``num_labels`` rows over the last token's state),
#: served by ``--runner pooling``: the families whose text-only decoder we run.
CLASSIFIER_ARCHITECTURES: dict[str, str] = {
    arch.replace("ForCausalLM", "ForSequenceClassification"): family
    for arch, family in SUPPORTED_ARCHITECTURES.items()
    if arch.endswith("ForCausalLM") and family != "gemma3"
}
SUPPORTED_ARCHITECTURES.update(CLASSIFIER_ARCHITECTURES)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}
#: Named refusals: families people ask for that this executor does not serve (yet).
_REFUSED = {
    "GptOssForCausalLM": "gpt-oss (attention sinks, MXFP4 experts)",
    "Llama4ForConditionalGeneration": "Llama 4 (chunked attention, multimodal)",
    "Llama4ForCausalLM": "Llama 4 (chunked attention)",
    "Qwen3NextForCausalLM": "Qwen3-Next (linear attention layers)",
}

_GEMMA_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
# transformers' defaults for the fields we read, where a family's differ from our generic ones.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"sliding_window": 4096, "max_window_layers": 28, "head_dim": 128},
    "qwen3_moe": {"sliding_window": 4096, "max_window_layers": 28},
    "gemma2": {
        **_GEMMA_DEFAULTS,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3": {
        **_GEMMA_DEFAULTS,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131_072,
    },
}
_GEMMA = ("gemma2", "gemma3")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

HiddenAct = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture of experts: ``top_k`` of ``num_experts`` SwiGLU experts of width
    ``intermediate_size`` per token, in the decoder layers ``layers`` (the others are dense).
    ``hf_prefix`` and ``hf_parts`` name the checkpoint's tensors:
    ``model.layers.{i}.{hf_prefix}.experts.{e}.{part}.weight`` for the gate, up and down
    projections, and ``model.layers.{i}.{hf_prefix}.gate.weight`` for the router."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # top-k weights divided by their sum
    layers: tuple[int, ...]
    hf_prefix: str = "mlp"
    hf_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Routing weights multiply the expert outputs in fp32 (Mixtral), or are first cast to
    # the activations' dtype (Qwen3-MoE), as transformers does for each.
    fp32_weights: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model, the KV cache and the scheduler need to know about a checkpoint."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    model_type: str  # our family: a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    max_model_len: int  # longest sequence (prompt + output) we serve; <= max_position_embeddings
    rope: RopeConfig  # every layer's, or the full-attention layers' where sliding_rope is set
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama if attention_bias)
    o_bias: bool  # bias on the output projection (Llama's attention_bias only)
    mlp_bias: bool
    tie_word_embeddings: bool
    torch_dtype: str | None  # the checkpoint's declared dtype, e.g. "bfloat16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    moe: MoEConfig | None = None  # a sparse mixture of experts (Mixtral, Qwen3-MoE)
    hidden_act: HiddenAct = "silu"  # the gated MLP's activation
    norm_unit_offset: bool = False  # Gemma: every RMSNorm scales by (1 + w)
    embed_scale: float | None = None  # Gemma: embeddings multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this), not head_dim
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    #: The layers transformers builds as sliding-window layers, and their window: None when
    #: none or when it is at least max_model_len (then they attend to everything anyway).
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    sliding_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own RoPE
    #: A sequence classifier's labels (``id2label`` in order; ``num_labels`` of them), its
    #: ``score`` head in place of the LM head; empty for a causal LM.
    labels: tuple[str, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: ``query_pre_attn_scalar ** -0.5`` where set, else
        ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def all_layers_slide(self) -> bool:
        """Every layer attends to one sliding window (Mistral-style): the KV cache can be one
        sliding group."""
        return self.sliding_window is not None and len(self.sliding_layers) == self.num_layers

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE settings layer ``layer`` rotates with."""
        if self.sliding_rope is not None and layer in self.sliding_layers:
            return self.sliding_rope
        return self.rope

    @classmethod
    def from_hf_config(
        cls, hf_raw: Mapping[str, Any], *, max_model_len: int | None = None
    ) -> ModelConfig:
        """Parse a ``config.json`` dict.

        ``max_model_len`` caps the served context (default: ``max_position_embeddings``).
        Raises :class:`UnsupportedModelError` for other architectures or unimplemented
        features and :class:`ModelLoadError` for missing or inconsistent fields.
        """
        architecture = _architecture(hf_raw)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        hf = {**_FAMILY_DEFAULTS.get(model_type, {}), **_text_config(hf_raw, architecture)}

        hidden_size = _int(hf, "hidden_size")
        num_heads = _int(hf, "num_attention_heads")
        num_kv_heads = _int(hf, "num_key_value_heads", default=num_heads)
        head_dim = hf.get("head_dim") or _exact_div(hidden_size, num_heads, "hidden_size")
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ModelLoadError(
                f"config.json: head_dim must be a positive even int, got {head_dim!r}"
            )
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        act_key = "hidden_activation" if model_type in _GEMMA else "hidden_act"
        act = hf.get(act_key, "silu")
        if act not in _ACTIVATIONS or (model_type not in _GEMMA and act != "silu"):
            raise UnsupportedModelError(f"config.json: {act_key}={act!r} is not supported")

        max_position_embeddings = _int(hf, "max_position_embeddings")
        if max_model_len is None:
            max_model_len = max_position_embeddings
        if not 0 < max_model_len <= max_position_embeddings:
            raise ModelLoadError(
                f"max_model_len={max_model_len} must be in [1, max_position_embeddings="
                f"{max_position_embeddings}]"
            )
        num_layers = _int(hf, "num_hidden_layers")
        sliding_layers, sliding_window = _sliding(hf, model_type, num_layers, max_model_len)
        rope, sliding_rope = _ropes(hf, model_type, head_dim, max_model_len)
        if rope.partial_rotary_factor != 1.0 and model_type != "phi3":
            raise UnsupportedModelError(
                f"config.json: partial_rotary_factor={rope.partial_rotary_factor} "
                f"({model_type} rotates whole heads)"
            )

        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type in ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3"):
            attention_bias = bool(hf.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, bool(hf.get("mlp_bias"))
        else:  # mistral, mixtral, phi3: no biases
            qkv_bias, o_bias, mlp_bias = False, False, False

        eos = hf.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        torch_dtype = hf.get("dtype") or hf.get("torch_dtype")
        gemma = model_type in _GEMMA
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_position_embeddings,
            max_model_len=max_model_len,
            rope=rope,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            torch_dtype=str(torch_dtype) if torch_dtype is not None else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3"),
            moe=_moe_config(hf, model_type),
            hidden_act=_ACTIVATIONS[act],  # type: ignore[arg-type]
            norm_unit_offset=gemma,
            embed_scale=hidden_size**0.5 if gemma else None,
            query_pre_attn_scalar=_positive(hf, "query_pre_attn_scalar") if gemma else None,
            attn_logit_softcap=_positive(hf, "attn_logit_softcapping"),
            final_logit_softcap=_positive(hf, "final_logit_softcapping"),
            sliding_layers=sliding_layers,
            sliding_window=sliding_window,
            sliding_rope=sliding_rope,
            labels=_labels(hf) if architecture in CLASSIFIER_ARCHITECTURES else (),
        )


def _labels(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """A classifier's labels: ``id2label`` by id, else ``LABEL_i`` for ``num_labels``
    (transformers' default 2)."""
    id2label = hf.get("id2label") or {}
    num = hf.get("num_labels", len(id2label) or 2)
    if not isinstance(num, int) or num < 1:
        raise ModelLoadError(f"config.json: num_labels must be a positive int, got {num!r}")
    try:
        named = {int(k): str(v) for k, v in dict(id2label).items()}
    except (TypeError, ValueError):
        raise ModelLoadError("config.json: id2label must map label ids to names") from None
    return tuple(named.get(i, f"LABEL_{i}") for i in range(max(num, len(named))))


def _architecture(hf: Mapping[str, Any]) -> str:
    architectures = hf.get("architectures") or []
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    for arch in architectures:
        if arch in _REFUSED:
            raise UnsupportedModelError(
                f"config.json: architecture {arch} ({_REFUSED[arch]}) is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
    if architectures:
        raise UnsupportedModelError(
            f"config.json: architectures={architectures} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = hf.get("model_type")
    if model_type in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[model_type]
    raise UnsupportedModelError(
        f"config.json: model_type={model_type!r} is not supported; "
        f"supported: {sorted(_ARCH_BY_MODEL_TYPE)}"
    )


def _text_config(hf: Mapping[str, Any], architecture: str) -> Mapping[str, Any]:
    """The language model's fields: a multimodal checkpoint nests them in ``text_config``
    (the top level keeps ids and the dtype it may not repeat)."""
    if architecture != "Gemma3ForConditionalGeneration":
        return hf
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelLoadError("config.json: Gemma3ForConditionalGeneration needs a text_config")
    inherited = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "dtype", "torch_dtype")
    return {**{k: hf[k] for k in inherited if k in hf}, **text}


def _sliding(
    hf: Mapping[str, Any], model_type: str, num_layers: int, max_model_len: int
) -> tuple[tuple[int, ...], int | None]:
    """(the sliding-window layers, as transformers builds them; their effective window)."""
    window = hf.get("sliding_window")
    if model_type in ("mistral", "mixtral", "phi3"):
        sliding = [True] * num_layers  # every layer, when the config has a window
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen: no window unless use_sliding_window; then the layers layer_types marks, or
        # those from max_window_layers on.
        if not hf.get("use_sliding_window"):
            window = None
        layer_types = hf.get("layer_types")
        if layer_types:
            sliding = [t == "sliding_attention" for t in layer_types]
        else:
            first = hf.get("max_window_layers", 28)
            sliding = [i >= first for i in range(num_layers)]
    elif model_type in _GEMMA:
        layer_types = hf.get("layer_types")
        if not layer_types:
            period = 2 if model_type == "gemma2" else _int(hf, "sliding_window_pattern")
            layer_types = [
                "sliding_attention" if (i + 1) % period else "full_attention"
                for i in range(num_layers)
            ]
        sliding = [t == "sliding_attention" for t in layer_types]
        unknown = set(layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"config.json: layer_types {sorted(unknown)}")
    else:
        return (), None
    if len(sliding) != num_layers:
        raise ModelLoadError(
            f"config.json: layer_types has {len(sliding)} entries for {num_layers} layers"
        )
    if window is None:
        return (), None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelLoadError(f"config.json: sliding_window must be a positive int, got {window!r}")
    layers = tuple(i for i, s in enumerate(sliding) if s)
    # A window at least max_model_len long covers every context: full attention.
    return layers, (window if window < max_model_len and layers else None)


def _ropes(
    hf: Mapping[str, Any], model_type: str, head_dim: int, max_model_len: int
) -> tuple[RopeConfig, RopeConfig | None]:
    """(the RoPE of every layer, or of the global layers; the sliding layers' own, if any)."""
    # Legacy: top-level rope_theta + rope_scaling; transformers >= 5: rope_parameters, which
    # Gemma 3 keys by layer type.
    params: dict[str, Any] = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kw = {"head_dim": head_dim, "max_model_len": max_model_len}
    if model_type != "gemma3":
        return parse_rope(params, hf, **kw), None
    per_type = {k: params.pop(k) for k in ("full_attention", "sliding_attention") if k in params}
    full = {**params, **(per_type.get("full_attention") or {})}
    local = per_type.get("sliding_attention") or {
        "rope_type": "default",
        "rope_theta": hf.get("rope_local_base_freq", DEFAULT_ROPE_THETA),
    }
    return parse_rope(full, hf, **kw), parse_rope(local, hf, **kw)


def _moe_config(hf: Mapping[str, Any], model_type: str) -> MoEConfig | None:
    num_layers = _int(hf, "num_hidden_layers")
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=_int(hf, "num_local_experts"),
            top_k=_int(hf, "num_experts_per_tok"),
            intermediate_size=_int(hf, "intermediate_size"),
            renormalize=True,
            layers=tuple(range(num_layers)),
            hf_prefix="block_sparse_moe",
            hf_parts=("w1", "w3", "w2"),
            fp32_weights=True,
        )
    if model_type != "qwen3_moe":
        return None
    # Hub checkpoints say num_experts; transformers >= 5 writes num_local_experts.
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    num_experts = _int(hf, key)
    step = _int(hf, "decoder_sparse_step", default=1)
    dense = set(hf.get("mlp_only_layers") or [])
    layers = tuple(
        i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )
    return MoEConfig(
        num_experts=num_experts,
        top_k=_int(hf, "num_experts_per_tok"),
        intermediate_size=_int(hf, "moe_intermediate_size"),
        renormalize=bool(hf.get("norm_topk_prob", False)),
        layers=layers,
    )


def _positive(hf: Mapping[str, Any], key: str) -> float | None:
    """An optional positive number (None when absent or null)."""
    value = hf.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if value is None and default is not None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config.json: {key} must be a positive int, got {value!r}")
    return value


def _exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ModelLoadError(f"config.json: {what}={a} is not divisible by num_attention_heads={b}")
    return a // b
