"""RoPE frequencies and rotation agree with transformers for every supported scaling."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from services.executor.model.config import ModelConfig
from services.executor.model.layers.rotary import RotaryEmbedding, rope_inv_freq

ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
HEAD_DIM = 128


def _configs(rope: dict[str, Any]) -> tuple[LlamaConfig, ModelConfig]:
    hf = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_parameters=dict(rope),
    )
    return hf, ModelConfig.from_hf_config(hf.to_dict())


@pytest.mark.parametrize("kind", list(ROPES))
def test_inverse_frequencies_equal_transformers(kind: str) -> None:
    hf, ours = _configs(ROPES[kind])
    if kind == "default":
        expected = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
    else:
        expected = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")[0]
    torch.testing.assert_close(rope_inv_freq(ours.rope, HEAD_DIM), expected, rtol=0, atol=0)


def test_llama3_scaling_keeps_high_scales_low_and_smooths_middle_frequencies() -> None:
    _, ours = _configs(ROPES["llama3"])
    _, plain = _configs({"rope_type": "default", "rope_theta": 500000.0})
    ratio = rope_inv_freq(plain.rope, HEAD_DIM) / rope_inv_freq(ours.rope, HEAD_DIM)
    assert ratio[0] == 1.0 and ratio[-1] == 8.0
    assert ((ratio > 1.0) & (ratio < 8.0)).any()


@pytest.mark.parametrize("kind", list(ROPES))
def test_rotation_equals_transformers_apply_rotary_pos_emb(kind: str) -> None:
    hf, ours = _configs(ROPES[kind])
    rotary = RotaryEmbedding(ours.rope, HEAD_DIM, max_len=20000, dtype=torch.float32)
    rotary.compute_tables()
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 17, 4095, 8191, 12345, 19999])
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=gen)  # [T, Hq, D]
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=gen)  # [T, Hkv, D]

    cos, sin = LlamaRotaryEmbedding(hf)(q, positions[None])  # [1, T, D]
    # HF layout is [B, H, T, D]; ours is [T, H, D].
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = q.clone(), k.clone()
    rotary(positions, q_out, k_out)  # in place
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), rtol=0, atol=1e-5)
