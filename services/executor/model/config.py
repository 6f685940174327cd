"""The model hyper-parameters the executor needs, parsed from a Hugging Face ``config.json``.

Supported: the Llama family as implemented by ``services.executor.model.models.llama`` — Llama 2/3
(``LlamaForCausalLM``), Mistral (``MistralForCausalLM``), Qwen2 (``Qwen2ForCausalLM``) and
Qwen3 (``Qwen3ForCausalLM``: per-head RMSNorm of q and k, an explicit ``head_dim``), and
Phi-3 (``Phi3ForCausalLM``, no biases, its fused checkpoint tensors cut at load), and
the mixtures of experts Mixtral (``MixtralForCausalLM``) and Qwen3-MoE
(``Qwen3MoeForCausalLM``), described by :class:`MoEConfig`.
Anything else raises :class:`UnsupportedModelError` with a message saying what and why.

Both serialisations of RoPE settings are accepted: the legacy one (top-level ``rope_theta``
plus an optional ``rope_scaling`` dict keyed by ``type`` or ``rope_type``) and the one written
by transformers >= 5 (a ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``).

Sliding-window attention (Mistral, Qwen2/3 with ``use_sliding_window``) is not implemented. A
window only changes the result for sequences longer than the window, so such a model is
accepted exactly when ``max_model_len <= sliding_window``: every sequence then fits in the
window and full causal attention is the same computation. Otherwise loading fails and the
message tells the caller to cap ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.executor.model.errors import ModelLoadError, UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "MoEConfig", "ModelConfig", "RopeConfig"]

#: HF architecture class name -> HF ``model_type``.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
}
_ARCH_BY_MODEL_TYPE = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}

RopeType = Literal["default", "linear", "llama3"]
_DEFAULT_ROPE_THETA = 10000.0
_HF_DEFAULT_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    ``default``: ``inv_freq[i] = theta ** (-2i / head_dim)``. ``linear``: ``inv_freq / factor``
    (position interpolation). ``llama3``: Llama 3.1's frequency-dependent rescaling; low
    frequencies are divided by ``factor``, high ones kept, the band between interpolated
    (the four llama3 fields are set only for this type).
    """

    theta: float = _DEFAULT_ROPE_THETA
    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


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


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model, the KV cache and the scheduler need to know about a checkpoint."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3"
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
    rope: RopeConfig
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama if attention_bias)
    o_bias: bool  # bias on the output projection (Llama's attention_bias only)
    mlp_bias: bool
    tie_word_embeddings: bool
    torch_dtype: str | None  # the checkpoint's declared dtype, e.g. "bfloat16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    moe: MoEConfig | None = None  # a sparse mixture of experts (Mixtral, Qwen3-MoE)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(
        cls, hf: Mapping[str, Any], *, max_model_len: int | None = None
    ) -> ModelConfig:
        """Parse a ``config.json`` dict.

        ``max_model_len`` caps the served context (default: ``max_position_embeddings``).
        Raises :class:`UnsupportedModelError` for other architectures or unimplemented
        features and :class:`ModelLoadError` for missing or inconsistent fields.
        """
        architecture = _architecture(hf)
        model_type = SUPPORTED_ARCHITECTURES[architecture]

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
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"config.json: hidden_act={hidden_act!r}; only 'silu'")

        max_position_embeddings = _int(hf, "max_position_embeddings")
        if max_model_len is None:
            max_model_len = max_position_embeddings
        if not 0 < max_model_len <= max_position_embeddings:
            raise ModelLoadError(
                f"max_model_len={max_model_len} must be in [1, max_position_embeddings="
                f"{max_position_embeddings}]"
            )
        _check_sliding_window(hf, model_type, max_model_len)

        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type in ("llama", "qwen3", "qwen3_moe"):
            attention_bias = bool(hf.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, bool(hf.get("mlp_bias"))
        else:  # mistral, mixtral, phi3: no biases
            qkv_bias, o_bias, mlp_bias = False, False, False

        eos = hf.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        torch_dtype = hf.get("dtype") or hf.get("torch_dtype")
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(hf, "intermediate_size"),
            num_layers=_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_position_embeddings,
            max_model_len=max_model_len,
            rope=_rope_config(hf, max_position_embeddings),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            torch_dtype=str(torch_dtype) if torch_dtype is not None else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=_moe_config(hf, model_type),
        )


def _architecture(hf: Mapping[str, Any]) -> str:
    architectures = hf.get("architectures") or []
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
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


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, max_model_len: int) -> None:
    # transformers' Mistral and Qwen2 configs default to a 4096-token window when the key is
    # absent; an explicit null means no window.
    # (Phi-3's config defaults to no window.)
    default = None if model_type == "phi3" else _HF_DEFAULT_SLIDING_WINDOW
    window = hf.get("sliding_window", default)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen2/3 window layers >= max_window_layers, or those that layer_types marks.
        layer_types = hf.get("layer_types")
        if layer_types:
            has_window_layers = "sliding_attention" in layer_types
        else:
            has_window_layers = hf.get("max_window_layers", 28) < hf.get("num_hidden_layers", 0)
        uses_window = bool(hf.get("use_sliding_window")) and has_window_layers
    else:
        uses_window = model_type in ("mistral", "mixtral", "phi3")
    if uses_window and window is not None and window < max_model_len:
        raise UnsupportedModelError(
            f"config.json: sliding_window={window} < max_model_len={max_model_len}; "
            "sliding-window attention is not implemented. Pass max_model_len <= "
            f"{window} to serve this model with (then identical) full attention."
        )


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


def _rope_config(hf: Mapping[str, Any], max_position_embeddings: int) -> RopeConfig:
    # Legacy: top-level rope_theta + rope_scaling; transformers >= 5: rope_parameters.
    params: dict[str, Any] = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError("config.json: per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor={partial}; only 1.0")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=_rope_float(params, "factor"))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings", max_position_embeddings)
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
        )
    raise UnsupportedModelError(
        f"config.json: rope type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


def _rope_float(params: Mapping[str, Any], key: str) -> float:
    value = params.get(key)
    if not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"config.json: rope {key} must be a positive number, got {value!r}")
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
