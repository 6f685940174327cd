"""``--speculative-config`` (vLLM's JSON) is checked at start-up: a bad value is a one-line
configuration error naming the field; a method not served yet is refused by name, as is a
draft model for a model with no full-attention layer."""

from __future__ import annotations

import json

import pytest

from services.blockmgr.client import InProcessClient
from services.executor.core.spec.config import SpeculativeConfig
from services.executor.model.errors import ModelLoadError
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine


def test_vllms_json_is_read_with_its_defaults() -> None:
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        5,
        1,
        3,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "speculative_config is not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "medusa"}', "speculative_config.method: 'medusa' is not served"),
        ('{"method": "eagle3"}', "speculative_config.model: eagle3 needs the EAGLE-3 head"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be in [1, 16]"),
        ('{"num_speculative_tokens": "3"}', "num_speculative_tokens must be a int"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min <="),
        ('{"num_spec_tokens": 3}', "speculative_config.num_spec_tokens: unknown field"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        ExecutorConfig(model="m", speculative_config=text).validate()
    assert str(info.value).startswith("--speculative-config: ")
    assert message in str(info.value)


def test_a_draft_model_for_a_model_whose_every_layer_slides_is_refused(tiny_checkpoint) -> None:
    """A draft model reads a full-attention group's block tables; Mistral's window is on every
    layer (the ngram method serves it)."""
    model = str(tiny_checkpoint("mistral_window"))
    config = ExecutorConfig(
        model=model,
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_model_len=128,
        speculative_config=json.dumps({"model": model}),
    )
    with pytest.raises(ModelLoadError, match="every layer of this model slides"):
        build_engine(
            config, runner=build_runner(config.runner_config()), blockmgr=InProcessClient()
        )
