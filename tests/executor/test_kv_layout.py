"""KV-cache groups of a model (vLLM's hybrid layout): which layers share a block table and a
slot of the cache tensor, the padding where the layer counts do not divide, and what the
cache must hold for one sequence."""

from __future__ import annotations

import dataclasses

import pytest

from services.executor.model.config import ModelConfig
from services.executor.model.kv_layout import plan_kv_layout
from services.executor.service.startup import kv_cache_groups

BASE = ModelConfig.from_hf_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 512,
    }
)


def _config(num_layers: int, sliding: tuple[int, ...], window: int = 64) -> ModelConfig:
    return dataclasses.replace(
        BASE, num_layers=num_layers, sliding_layers=sliding, sliding_window=window
    )


def test_gemma3_shape_gets_a_group_per_layer_in_one_slot():
    layout = plan_kv_layout(_config(6, (0, 1, 2, 3, 4)))  # 5 sliding, 1 global
    assert layout.num_slots == 1 and layout.num_groups == 6
    assert layout.windows == (64, 64, 64, 64, 64, 0)
    assert layout.group_layers == ((0,), (1,), (2,), (3,), (4,), (5,))
    assert layout.layer_slot == (0,) * 6
    # ceil(512 / 16) for the global layer + 5 x (ceil(64 / 16) + 1) for the sliding ones
    assert layout.blocks_per_sequence(512, 16) == 32 + 5 * 5


def test_alternating_layers_make_two_groups_of_equal_size():
    layout = plan_kv_layout(_config(4, (0, 2)))  # Gemma 2: sliding, global, sliding, global
    assert layout.num_slots == 2
    assert layout.group_layers == ((0, 2), (1, 3))
    assert layout.windows == (64, 0)
    assert layout.layer_group == (0, 1, 0, 1) and layout.layer_slot == (0, 0, 1, 1)


def test_counts_that_do_not_divide_pad_a_group_cut_strided_as_vllm_does():
    layout = plan_kv_layout(_config(7, (0, 1, 2, 4, 5)))  # 5 sliding, 2 global
    assert layout.num_slots == 2
    assert layout.group_layers == ((0, 4), (1, 5), (2,), (3, 6))
    assert layout.windows == (64, 64, 64, 0)
    assert layout.layer_slot[2] == 0  # the padded group uses slot 0; its slot 1 is padding


def test_nearly_equal_counts_take_the_larger_as_the_group_size():
    # 6 sliding, 5 global: 6 < 1.25 x 5, so 2 groups of 6 slots (1 padding), not 5 groups
    layout = plan_kv_layout(_config(11, (0, 2, 4, 6, 8, 10)))
    assert layout.num_slots == 6 and layout.num_groups == 2
    assert layout.group_layers == ((0, 2, 4, 6, 8, 10), (1, 3, 5, 7, 9))


def test_gemma3_27b_shape_gets_ten_slots_and_seven_groups():
    sliding = tuple(i for i in range(62) if i % 6 != 5)  # 52 sliding, 10 global
    layout = plan_kv_layout(_config(62, sliding))
    assert layout.num_slots == 10 and layout.num_groups == 7
    assert layout.windows.count(0) == 1


@pytest.mark.parametrize(
    ("sliding", "window", "hybrid", "expected_window"),
    [
        ((), 0, True, 0),  # full attention everywhere
        ((0, 1, 2, 3, 4, 5), 64, True, 64),  # Mistral: one sliding group
        ((0, 1, 2, 3, 4), 64, False, 0),  # hybrid manager off: every block kept
    ],
    ids=["full", "all-sliding", "disabled"],
)
def test_one_kind_of_layer_or_disabled_is_one_group_of_every_layer(
    sliding, window, hybrid, expected_window
):
    config = _config(6, sliding, window) if window else BASE
    layout = plan_kv_layout(config, hybrid=hybrid)
    assert layout.num_groups == 1 and layout.num_slots == 6
    assert layout.layer_slot == tuple(range(6)) and layout.windows == (expected_window,)


def test_the_pool_is_registered_with_the_layouts_groups():
    assert kv_cache_groups(plan_kv_layout(BASE)) == ()  # one full group: nothing to ask
    (sliding,) = kv_cache_groups(plan_kv_layout(_config(6, tuple(range(6)))))
    assert (sliding.kind.value, sliding.sliding_window) == ("sliding", 64)
    groups = kv_cache_groups(plan_kv_layout(_config(4, (0, 2))))
    assert [(g.kind.value, g.sliding_window, g.layers) for g in groups] == [
        ("sliding", 64, (0, 2)),
        ("full", 0, (1, 3)),
    ]


def test_a_chunked_sequence_needs_its_chunk_and_window_in_a_sliding_group():
    layout = plan_kv_layout(_config(2, (0,)))
    # full: 32 blocks; sliding: the chunk (512) + window (64) + 2 blocks of slack = 38 > 32
    assert layout.blocks_per_sequence(512, 16, chunk=512) == 32 + 32
    assert layout.blocks_per_sequence(512, 16, chunk=16) == 32 + (16 + 64 + 32) // 16
