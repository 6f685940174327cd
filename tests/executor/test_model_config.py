"""Parsing HF ``config.json`` files of the Llama family, and refusing everything else."""

from __future__ import annotations

import math
from typing import Any

import pytest

from services.executor.model.config import ModelConfig, RopeConfig
from services.executor.model.errors import ModelLoadError, UnsupportedModelError

# Abridged from the published config.json files (the fields we read).
LLAMA2_7B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": 32000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA31_8B: dict[str, Any] = {
    **LLAMA2_7B,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
MISTRAL_7B_V01: dict[str, Any] = {
    **LLAMA2_7B,
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
}
QWEN2_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
    "eos_token_id": 151643,
}


def test_llama2_legacy_config_parses_with_derived_head_dim_and_default_rope() -> None:
    c = ModelConfig.from_hf_config(LLAMA2_7B)
    assert (c.architecture, c.model_type) == ("LlamaForCausalLM", "llama")
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 32, 32, 128)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (4096, 11008, 32000)
    assert c.rope == RopeConfig(theta=10000.0)
    assert c.max_model_len == c.max_position_embeddings == 4096
    assert (c.qkv_bias, c.o_bias, c.mlp_bias, c.tie_word_embeddings) == (False,) * 4
    assert (c.torch_dtype, c.bos_token_id, c.eos_token_ids) == ("float16", 1, (2,))


def test_llama31_legacy_rope_scaling_llama3_is_parsed() -> None:
    c = ModelConfig.from_hf_config(LLAMA31_8B, max_model_len=8192)
    assert c.rope == RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert c.num_kv_heads == 8 and c.max_model_len == 8192
    assert c.eos_token_ids == (128001, 128008, 128009)


def test_transformers5_rope_parameters_format_is_parsed() -> None:
    hf = {k: v for k, v in LLAMA2_7B.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 250.0}
    assert ModelConfig.from_hf_config(hf).rope == RopeConfig(250.0, "linear", factor=2.0)


def test_legacy_rope_scaling_type_key_linear_is_parsed() -> None:
    hf = {**LLAMA2_7B, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert ModelConfig.from_hf_config(hf).rope == RopeConfig(10000.0, "linear", factor=4.0)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "mrope"])
def test_unsupported_rope_type_is_a_clear_error(rope_type: str) -> None:
    hf = {**LLAMA2_7B, "rope_scaling": {"rope_type": rope_type, "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match=f"rope type '{rope_type}'"):
        ModelConfig.from_hf_config(hf)


def test_llama3_rope_missing_factor_is_a_clear_error() -> None:
    hf = {
        **LLAMA2_7B,
        "rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    }
    with pytest.raises(ModelLoadError, match="rope factor"):
        ModelConfig.from_hf_config(hf)


def test_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    c = ModelConfig.from_hf_config({**LLAMA2_7B, "head_dim": 64})
    assert c.head_dim == 64 and c.q_size == 32 * 64 and c.kv_size == 32 * 64


def test_mistral_slides_every_layer_and_an_absent_window_is_transformers_4096() -> None:
    c = ModelConfig.from_hf_config(MISTRAL_7B_V01)
    assert c.sliding_layers == tuple(range(32)) and c.sliding_window == 4096
    assert c.window(0) == c.window(31) == 4096
    # A window as long as the served context is full attention: recorded as none.
    capped = ModelConfig.from_hf_config(MISTRAL_7B_V01, max_model_len=4096)
    assert capped.sliding_window is None and capped.window(0) is None
    no_window = ModelConfig.from_hf_config({**MISTRAL_7B_V01, "sliding_window": None})
    assert no_window.sliding_window is None and no_window.max_model_len == 32768
    absent = {k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}
    assert ModelConfig.from_hf_config(absent).sliding_window == 4096


def test_qwen2_has_qkv_bias_only_and_ignores_disabled_sliding_window() -> None:
    c = ModelConfig.from_hf_config(QWEN2_7B)
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == (True, False, False)
    assert (c.head_dim, c.num_kv_heads, c.rope.theta) == (128, 4, 1000000.0)


def test_qwen2_enabled_sliding_window_applies_from_max_window_layers_on() -> None:
    hf = {**QWEN2_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 4}
    c = ModelConfig.from_hf_config(hf)
    assert c.sliding_layers == tuple(range(4, 28)) and c.sliding_window == 4096
    assert c.window(3) is None and c.window(4) == 4096
    # Enabled, but max_window_layers covers every layer: no layer uses the window.
    assert ModelConfig.from_hf_config({**hf, "max_window_layers": 28}).sliding_window is None
    # layer_types, where given, decide.
    types = ["sliding_attention" if i % 2 else "full_attention" for i in range(28)]
    alternating = ModelConfig.from_hf_config({**hf, "layer_types": types})
    assert alternating.sliding_layers == tuple(range(1, 28, 2))


def test_llama_attention_bias_puts_bias_on_all_four_projections() -> None:
    c = ModelConfig.from_hf_config({**LLAMA2_7B, "attention_bias": True, "mlp_bias": True})
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == (True, True, True)


def test_architecture_falls_back_to_model_type() -> None:
    hf = {k: v for k, v in QWEN2_7B.items() if k != "architectures"}
    assert ModelConfig.from_hf_config(hf).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "falcon"}, "falcon"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_models_raise_unsupported_model_error_naming_the_feature(
    overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=match) as info:
        ModelConfig.from_hf_config({**LLAMA2_7B, **overrides})
    assert isinstance(info.value, NotImplementedError)  # also catchable as that


@pytest.mark.parametrize(
    ("overrides", "max_model_len", "match"),
    [
        ({"hidden_size": None}, None, "hidden_size"),
        ({"num_key_value_heads": 5}, None, "num_key_value_heads=5"),
        ({}, 4097, "max_model_len=4097"),
        ({"vocab_size": "32000"}, None, "vocab_size"),
    ],
)
def test_invalid_configs_raise_model_load_error_naming_the_field(
    overrides: dict[str, Any], max_model_len: int | None, match: str
) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf_config({**LLAMA2_7B, **overrides}, max_model_len=max_model_len)


def test_config_is_frozen() -> None:
    c = ModelConfig.from_hf_config(LLAMA2_7B)
    with pytest.raises(AttributeError):
        c.vocab_size = 1  # type: ignore[misc]


# Abridged from Qwen3-0.6B's config.json.
QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def test_qwen3_has_qk_norm_its_own_head_dim_and_no_biases() -> None:
    c = ModelConfig.from_hf_config(QWEN3_0_6B)
    assert (c.architecture, c.model_type, c.qk_norm) == ("Qwen3ForCausalLM", "qwen3", True)
    assert (c.head_dim, c.q_size, c.kv_size) == (128, 2048, 1024)  # q_size != hidden_size
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias)
    assert c.tie_word_embeddings and c.rope.theta == 1_000_000
    assert not ModelConfig.from_hf_config(LLAMA2_7B).qk_norm


def test_qwen3_with_sliding_window_layers_slides_them_as_qwen2_does() -> None:
    hf = {**QWEN3_0_6B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 4}
    assert ModelConfig.from_hf_config(hf, max_model_len=8192).window(4) == 4096
    assert ModelConfig.from_hf_config(hf, max_model_len=4096).sliding_window is None


# Abridged from Mixtral-8x7B-v0.1's and Qwen3-30B-A3B's config.json.
MIXTRAL_8X7B: dict[str, Any] = {
    **LLAMA2_7B,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": None,
    "rope_theta": 1e6,
}
QWEN3_30B_A3B: dict[str, Any] = {
    **QWEN3_0_6B,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}


def test_mixtral_is_a_top2_mixture_of_experts_in_every_layer_under_its_checkpoint_names():
    moe = ModelConfig.from_hf_config(MIXTRAL_8X7B).moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (
        8,
        2,
        14336,
        True,
    )
    assert moe.layers == tuple(range(32))
    assert (moe.hf_prefix, moe.hf_parts) == ("block_sparse_moe", ("w1", "w3", "w2"))


def test_qwen3_moe_takes_its_sparse_layers_from_the_step_and_the_dense_list():
    c = ModelConfig.from_hf_config(QWEN3_30B_A3B)
    assert c.qk_norm and c.moe is not None
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (128, 8, 768)
    assert c.moe.layers == tuple(range(48))
    sparse = {**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1, 3]}
    layers = ModelConfig.from_hf_config(sparse).moe.layers  # type: ignore[union-attr]
    assert layers[:4] == (5, 7, 9, 11)  # odd layers (step 2), less layers 1 and 3
    assert (
        ModelConfig.from_hf_config({**QWEN3_30B_A3B, "norm_topk_prob": False}).moe.renormalize
        is False
    )  # type: ignore[union-attr]
    assert ModelConfig.from_hf_config(LLAMA2_7B).moe is None


# Abridged from Phi-3-mini-4k-instruct's config.json.
PHI3_MINI_4K: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "vocab_size": 32064,
    "bos_token_id": 1,
    "eos_token_id": 32000,
}


def test_phi3_has_no_biases_and_slides_every_layer():
    c = ModelConfig.from_hf_config(PHI3_MINI_4K)
    assert (c.model_type, c.head_dim) == ("phi3", 96)
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias or c.qk_norm) and c.moe is None
    assert c.sliding_window == 2047 and c.sliding_layers == tuple(range(32))
    no_window = {k: v for k, v in PHI3_MINI_4K.items() if k != "sliding_window"}
    assert ModelConfig.from_hf_config(no_window).sliding_window is None  # absent: none


# Abridged from Phi-4-mini-instruct's config.json (48 factors each, invented values).
PHI4_MINI: dict[str, Any] = {
    **PHI3_MINI_4K,
    "hidden_size": 3072,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75,
    "sliding_window": 262144,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0] * 48,
        "long_factor": [1.0 + i / 8 for i in range(48)],
    },
}


def test_phi4_mini_rotates_three_quarters_of_each_head_with_longrope():
    c = ModelConfig.from_hf_config(PHI4_MINI, max_model_len=4096)
    assert c.head_dim == 128 and c.rope.rotary_dim(c.head_dim) == 96
    assert c.rope.rope_type == "longrope" and c.rope.ext_factors == (1.0,) * 48
    assert c.rope.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    assert c.sliding_window is None  # 262144 > any context served
    long = ModelConfig.from_hf_config(PHI4_MINI, max_model_len=8192)
    assert long.rope.ext_factors == tuple(1.0 + i / 8 for i in range(48))


def test_longrope_factors_of_the_wrong_length_name_the_field():
    hf = {**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "long_factor": [1.0]}}
    with pytest.raises(ModelLoadError, match="long_factor"):
        ModelConfig.from_hf_config(hf)


# Abridged from gemma-3-1b-it's and gemma-2-2b-it's config.json.
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
}
GEMMA2_2B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
}


def test_gemma3_has_five_sliding_layers_per_global_one_each_with_its_rope_base():
    c = ModelConfig.from_hf_config(GEMMA3_1B)
    assert c.sliding_layers == tuple(i for i in range(26) if (i + 1) % 6)
    assert c.window(0) == 512 and c.window(5) is None
    assert c.layer_rope(0).theta == 10000 and c.layer_rope(5).theta == 1_000_000
    assert c.qk_norm and c.norm_unit_offset and c.hidden_act == "gelu_tanh"
    assert c.embed_scale == pytest.approx(1152**0.5)
    assert c.attention_scale == pytest.approx(256**-0.5) and c.tie_word_embeddings
    assert c.eos_token_ids == (1, 106)


def test_gemma3_multimodal_config_parses_its_text_config():
    mm = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {k: v for k, v in GEMMA3_1B.items() if k != "architectures"},
        "vision_config": {"model_type": "siglip_vision_model"},
        "eos_token_id": [1, 106],
    }
    c = ModelConfig.from_hf_config(mm)
    assert c.architecture == "Gemma3ForConditionalGeneration" and c.model_type == "gemma3"
    assert c.hidden_size == 1152 and c.sliding_window == 512


def test_gemma2_soft_caps_and_alternates_sliding_and_global_layers():
    c = ModelConfig.from_hf_config(GEMMA2_2B)
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
    assert c.sliding_layers == tuple(range(0, 26, 2)) and c.sliding_window == 4096
    assert not c.qk_norm and c.sliding_rope is None
    assert c.attention_scale == pytest.approx(1 / 16)


@pytest.mark.parametrize(
    ("arch", "named"),
    [
        ("GptOssForCausalLM", "gpt-oss"),
        ("Llama4ForConditionalGeneration", "Llama 4"),
        ("Qwen3NextForCausalLM", "Qwen3-Next"),
    ],
)
def test_out_of_scope_families_are_refused_by_name_with_the_supported_list(arch, named):
    with pytest.raises(UnsupportedModelError, match=named) as info:
        ModelConfig.from_hf_config({**LLAMA2_7B, "architectures": [arch]})
    assert "Gemma3ForCausalLM" in str(info.value)
