"""Structured outputs in the engine (xgrammar), with the tiny random Llama and its real
byte-level tokenizer: every finished output follows its JSON schema, regex, choice or
grammar, whatever the sampling, forks, batching or preemption; constrained greedy decoding
equals transformers' greedy decoding under the same grammar (xgrammar's HF logits
processor); specifications that cannot be compiled are refused naming the field."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor

from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredKind, StructuredOutputs
from services.executor.core.engine import Engine
from services.executor.core.grammar import json_schema_grammar
from services.executor.core.outputs import EngineError
from services.executor.core.sequence import FinishReason, RequestKey, Resume
from services.executor.model.launch import build_runner
from services.executor.model.loader import load_tokenizer
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

from .greedy import run_engine

# Bounded, so that even a random model completes it within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "size", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{2,4}( (kg|g))?"
CHOICES = ("paged attention", "continuous batching", "prefix caching")
GRAMMAR = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num){0,3}\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)"

SPECS = {
    "json": StructuredOutputs(StructuredKind.JSON, json.dumps(SCHEMA)),
    "json_object": StructuredOutputs(StructuredKind.JSON_OBJECT),
    "regex": StructuredOutputs(StructuredKind.REGEX, REGEX),
    "choice": StructuredOutputs(StructuredKind.CHOICE, choices=CHOICES),
    "grammar": StructuredOutputs(StructuredKind.GRAMMAR, GRAMMAR),
}


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(GRAMMAR_RE, text) is not None


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine_factory(model_dir):
    config = ExecutorConfig(
        model=model_dir, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=128
    )
    runner = build_runner(config.runner_config())

    def make(**kw) -> Engine:
        cfg = dataclasses.replace(config, **kw)
        own = runner if "num_kv_blocks" not in kw else build_runner(cfg.runner_config())
        engine, _ = build_engine(cfg, runner=own, blockmgr=InProcessClient())
        return engine

    return make


def _prompt(tokenizer, i: int) -> list[int]:
    return tokenizer(f"Request {i}: describe the item as asked").input_ids


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_every_sampled_output_follows_its_specification(engine_factory, tokenizer, kind):
    """24 samples at temperature 1 (8 requests of n = 3, seeded), batched together. (Any
    JSON object is not a bounded language: a random model may never close a string; its
    mask is checked against transformers below.)"""
    params = SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=120, structured_outputs=SPECS[kind]
    )
    requests = {f"r{i}": (_prompt(tokenizer, i), params) for i in range(8)}
    tokens, finals = run_engine(engine_factory(), requests)
    assert len(finals) == 24
    for key, final in finals.items():
        text = _text(tokenizer, tokens[key])
        assert final.finish_reason is FinishReason.STOP, (key, text)
        assert follows(kind, text), (key, text)


def test_constrained_greedy_equals_transformers_under_the_same_grammar(
    engine_factory, tokenizer, hf_model, model_dir
):
    model = hf_model("llama")
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    compiler = xgr.GrammarCompiler(info)
    compiled = {  # JSON schemas as the engine has xgrammar write them (json_schema_grammar)
        "json": compiler.compile_grammar(json_schema_grammar(json.dumps(SCHEMA))),
        "regex": compiler.compile_regex(REGEX),
        "grammar": compiler.compile_grammar(GRAMMAR),
        "json_object": compiler.compile_grammar(json_schema_grammar('{"type": "object"}')),
    }
    requests = {
        f"{kind}{i}": (
            _prompt(tokenizer, i),
            SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SPECS[kind]),
        )
        for kind in compiled
        for i in range(3)
    }
    tokens, _ = run_engine(engine_factory(), requests)
    for rid, (prompt, _) in requests.items():
        kind = rid.rstrip("0123456789")
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=60,
                do_sample=False,
                logits_processor=[LogitsProcessor(compiled[kind])],
                pad_token_id=tokenizer.pad_token_id,
            )
        assert tokens[(rid, 0)] == out[0, len(prompt) :].tolist(), rid


def test_preemption_and_resume_keep_the_grammar_state(engine_factory, tokenizer):
    """A KV cache too small for the batch preempts (recomputes) constrained samples; a
    sample resumed from its first tokens goes on in its grammar: both give the outputs of
    an undisturbed run."""
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SPECS["json"])
    requests = {f"r{i}": (_prompt(tokenizer, i) * 3, params) for i in range(12)}
    roomy, _ = run_engine(engine_factory(), requests)
    tight_engine = engine_factory(num_kv_blocks=24, max_num_seqs=12)
    tight, _ = run_engine(tight_engine, requests)
    assert tight_engine.scheduler.num_preemptions > 0
    assert tight == roomy
    full = roomy[("r0", 0)]
    engine = engine_factory()
    engine.add_request(
        RequestKey(0, "resumed"), requests["r0"][0], params, resume=Resume(0, tuple(full[:9]))
    )
    resumed, _ = run_engine(engine, {})
    assert resumed[("resumed", 0)] == full[9:]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            StructuredOutputs(StructuredKind.REGEX, "([a-"),
            "sampling_params.structured_outputs.regex",
        ),
        (
            StructuredOutputs(StructuredKind.GRAMMAR, "root ::= missing_rule"),
            "sampling_params.structured_outputs.grammar",
        ),
        (
            StructuredOutputs(StructuredKind.JSON, '{"type": "no-such-type"}'),
            "sampling_params.structured_outputs.json",
        ),
    ],
)
def test_specifications_that_do_not_compile_are_refused_naming_the_field(
    engine_factory, tokenizer, spec, field
):
    engine = engine_factory()
    with pytest.raises(EngineError) as info:
        engine.add_request(
            RequestKey(0, "bad"),
            _prompt(tokenizer, 0),
            SamplingParams(max_tokens=8, structured_outputs=spec),
        )
    assert info.value.message.startswith(field + ": cannot be compiled")
    assert not engine.has_work


def test_resumed_tokens_outside_the_grammar_are_refused(engine_factory, tokenizer):
    bad = tuple(tokenizer("not json", add_special_tokens=False).input_ids)
    with pytest.raises(EngineError) as info:
        engine_factory().add_request(
            RequestKey(0, "bad"),
            _prompt(tokenizer, 0),
            SamplingParams(max_tokens=30, structured_outputs=SPECS["json"]),
            resume=Resume(0, bad),
        )
    assert info.value.message.startswith("resume.output_token_ids[0]")


def test_beam_search_under_a_grammar_returns_only_valid_beams(engine_factory, tokenizer):
    """Each beam follows its grammar (forks replay the parent's state): every returned beam
    of a width-4 search parses and validates."""
    params = SamplingParams(
        n=4, use_beam_search=True, max_tokens=80, structured_outputs=SPECS["json"]
    )
    requests = {f"r{i}": (_prompt(tokenizer, i), params) for i in range(3)}
    tokens, finals = run_engine(engine_factory(), requests)
    assert len(finals) == 12
    for key, final in finals.items():
        assert final.finish_reason is FinishReason.STOP, key
        assert follows("json", _text(tokenizer, tokens[key])), _text(tokenizer, tokens[key])


def test_beam_search_under_a_grammar_ends_each_beam_when_complete_even_ignoring_eos(
    engine_factory, tokenizer
):
    choices = StructuredOutputs(StructuredKind.CHOICE, choices=("yes", "no", "maybe"))
    params = SamplingParams(
        n=2, use_beam_search=True, max_tokens=20, ignore_eos=True, structured_outputs=choices
    )
    tokens, finals = run_engine(engine_factory(), {"c": (_prompt(tokenizer, 0), params)})
    assert sorted(finals) == [("c", 0), ("c", 1)]
    assert all(_text(tokenizer, tokens[key]) in choices.choices for key in finals)


def test_a_grammar_with_fewer_outputs_than_beams_still_ends_every_beam(engine_factory, tokenizer):
    """The regex has one word: the other three beams end empty (LENGTH), not never."""
    params = SamplingParams(
        n=4,
        use_beam_search=True,
        max_tokens=20,
        structured_outputs=StructuredOutputs(StructuredKind.REGEX, "abc"),
    )
    tokens, finals = run_engine(engine_factory(), {"r": (_prompt(tokenizer, 0), params)})
    assert sorted(finals) == [("r", i) for i in range(4)]
    assert _text(tokenizer, tokens[("r", 0)]) == "abc"
    assert finals[("r", 0)].finish_reason is FinishReason.STOP


def test_min_tokens_with_structured_outputs_is_refused(engine_factory, tokenizer):
    params = SamplingParams(max_tokens=8, min_tokens=2, structured_outputs=SPECS["regex"])
    with pytest.raises(EngineError, match=r"sampling_params\.min_tokens"):
        engine_factory().add_request(RequestKey(0, "m"), _prompt(tokenizer, 0), params)
