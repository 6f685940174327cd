"""Sampling parameters cross two protos by walking one definition of the fields: every field
is in both protos, a round trip through the executor's proto is exact, and an unset public
field takes the dataclass's default."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from pagedserve.v1 import executor_pb2, generation_pb2
from services.common.sampling_params import (
    PARAM_FIELDS,
    SamplingParams,
    params_from_message,
    params_to_message,
)
from services.common.structured_outputs import StructuredKind, StructuredOutputs


def _f32(x: float) -> float:
    """``x`` as a proto ``float`` holds it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def test_every_sampling_field_is_in_both_protos():
    for message in (executor_pb2.ExecutorSamplingParams, generation_pb2.SamplingParams):
        names = set(message.DESCRIPTOR.fields_by_name)
        missing = [f.name for f in PARAM_FIELDS if f.name not in names]
        assert not missing, f"{message.DESCRIPTOR.full_name} lacks {missing}"


def test_unset_public_fields_take_the_dataclass_defaults():
    params = params_from_message(generation_pb2.SamplingParams())
    assert params == SamplingParams()


def test_a_default_given_by_the_caller_applies_only_when_the_field_is_unset():
    unset = params_from_message(generation_pb2.SamplingParams(), max_tokens=99)
    set_ = params_from_message(generation_pb2.SamplingParams(max_tokens=5), max_tokens=99)
    assert (unset.max_tokens, set_.max_tokens) == (99, 5)


floats = st.floats(min_value=-2, max_value=2, allow_nan=False).map(_f32)
params_strategy = st.builds(
    SamplingParams,
    n=st.integers(1, 8),
    temperature=floats.map(abs),
    top_p=floats,
    top_k=st.integers(-1, 100),
    min_p=floats,
    seed=st.none() | st.integers(0, 2**63 - 1),
    max_tokens=st.integers(1, 4096),
    min_tokens=st.integers(0, 16),
    stop_token_ids=st.lists(st.integers(0, 2**31), max_size=4).map(tuple),
    ignore_eos=st.booleans(),
    repetition_penalty=floats,
    presence_penalty=floats,
    frequency_penalty=floats,
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    logit_bias=st.dictionaries(st.integers(0, 2**32 - 1), floats, max_size=4).map(
        lambda bias: tuple(sorted(bias.items()))
    ),
    structured_outputs=st.none()
    | st.builds(
        StructuredOutputs,
        kind=st.sampled_from([StructuredKind.JSON, StructuredKind.REGEX, StructuredKind.GRAMMAR]),
        spec=st.text(min_size=1, max_size=20),
    )
    | st.builds(
        StructuredOutputs,
        kind=st.just(StructuredKind.CHOICE),
        choices=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4).map(tuple),
    )
    | st.just(StructuredOutputs(StructuredKind.JSON_OBJECT)),
)


@given(params_strategy)
def test_params_survive_the_executor_proto_exactly(params: SamplingParams):
    msg = params_to_message(params, executor_pb2.ExecutorSamplingParams())
    wire = executor_pb2.ExecutorSamplingParams.FromString(msg.SerializeToString())
    assert params_from_message(wire) == params


@given(params_strategy)
def test_params_survive_the_public_proto_exactly(params: SamplingParams):
    msg = params_to_message(params, generation_pb2.SamplingParams())
    assert params_from_message(msg) == params
