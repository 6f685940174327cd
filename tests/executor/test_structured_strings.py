"""JSON schema string keywords under the real grammar compiler (xgrammar) and the tiny
model's byte-level tokenizer: seeded random walks through each grammar (any token its
mask allows) end in JSON that parses and validates, for ``maxLength``, ``minLength``,
``pattern``, ``format``, ``enum`` and ``const``; bounded strings admit no raw control
character (xgrammar's own bounded strings do: mlc-ai/xgrammar#800); the keywords xgrammar
would silently drop are refused; compile errors carry no library source location."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from services.common.limits import FieldError
from services.common.structured_outputs import StructuredKind, StructuredOutputs
from services.executor.core import grammar
from services.executor.core.grammar import GrammarCompiler, Matcher
from services.executor.model.loader import load_tokenizer

# Formats whose grammar xgrammar makes exact enough for jsonschema's format checker. Not
# "date" (2023-02-31: a day is 01-31 in every month) nor "ipv4" (leading zeros, 64.059.0.1).
CHECKED_FORMATS = {"email", "uuid"}
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _obj(**props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


# name -> schema; every string keyword, alone, in arrays, nullable, and behind a $ref.
SCHEMAS = {
    "maxLength": _obj(name={"type": "string", "maxLength": 20}),  # the reported schema
    "minLength": _obj(name={"type": "string", "minLength": 5}),
    "min_and_maxLength": _obj(name={"type": "string", "minLength": 2, "maxLength": 8}),
    "one_character": _obj(c={"type": "string", "minLength": 1, "maxLength": 1}),
    "empty_only": _obj(e={"type": "string", "maxLength": 0}),
    "bounded_items": _obj(
        tags={
            "type": "array",
            "items": {"type": "string", "maxLength": 3},
            "maxItems": 3,
        }
    ),
    "nullable_bounded": _obj(n={"type": ["string", "null"], "maxLength": 4}),
    "bounded_ref": {
        "$defs": {"Short": {"type": "string", "minLength": 1, "maxLength": 6}},
        **_obj(a={"$ref": "#/$defs/Short"}, b={"$ref": "#/$defs/Short"}),
    },
    "pattern": _obj(
        word={"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        phone={"type": "string", "pattern": r"^\d{3}-\d{4}$"},
        not_x={"type": "string", "pattern": "^[^x]{1,6}$"},  # a negated class
    ),
    "format": _obj(
        day={"type": "string", "format": "date"},
        mail={"type": "string", "format": "email"},
        id={"type": "string", "format": "uuid"},
        ip={"type": "string", "format": "ipv4"},
    ),
    "enum_and_const": _obj(
        pick={"enum": ["tab\there", 'quote"d', "back\\slash", "naïve", "x"]},
        fixed={"const": "line\nbreak"},
        mixed={"enum": ["a", 1, None, True]},
    ),
    "plain_string": _obj(free={"type": "string"}),
}
WALKS = 24
MAX_STEPS = 160
FINISH_AFTER = 60  # steps; then closing tokens are preferred
# Past FINISH_AFTER steps, the first of these a mask allows is taken (after the end token):
# they close strings, arrays and objects (an email's local part takes "}" but not "@").
CLOSERS = ('"', "]", "@", "}")


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(str(tiny_checkpoint("llama")))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _json(schema: dict) -> StructuredOutputs:
    return StructuredOutputs(StructuredKind.JSON, json.dumps(schema))


def _walk(
    compiler: GrammarCompiler, matcher: Matcher, rng: random.Random, closers: list[int]
) -> list[int]:
    """Tokens chosen at random among those the mask allows, until the matcher has accepted
    an end token; past ``FINISH_AFTER`` steps the end token or a closing one is taken when
    allowed, so that walks through unbounded strings end too. [] if it never ends."""
    eos = compiler.stop_token_ids[0]
    tokens: list[int] = []
    for step in range(MAX_STEPS):
        logits = torch.zeros(1, compiler.vocab_size)
        compiler.mask_logits(logits, {0: matcher})
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        assert allowed, f"no token allowed after {tokens}"
        ending = [t for t in [eos, *closers] if t in allowed] if step >= FINISH_AFTER else []
        token = ending[0] if ending else rng.choice(allowed)
        assert matcher.accept(token)
        if matcher.done:
            return tokens
        tokens.append(token)
    return []


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_random_walk_through_a_string_schema_ends_in_valid_json(compiler, tokenizer, name):
    """Before the fix, the maxLength / minLength schemas failed: their strings took raw
    control-character tokens (the tiny tokenizer has one per byte), which json.loads
    refuses."""
    schema = SCHEMAS[name]
    spec = _json(schema)
    closers = tokenizer.convert_tokens_to_ids(list(CLOSERS))
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER)
    rng = random.Random(f"walk-{name}")
    ended = 0
    for _ in range(WALKS):
        tokens = _walk(compiler, compiler.matcher(spec), rng, closers)
        if not tokens:
            continue
        ended += 1
        text = tokenizer.decode(tokens)
        value = json.loads(text)  # strict: no raw control character in a string
        errors = [
            e
            for e in validator.iter_errors(value)
            if e.validator != "format" or e.validator_value in CHECKED_FORMATS
        ]
        assert not errors, (text, [e.message for e in errors])
    assert ended >= WALKS // 2, f"only {ended} of {WALKS} walks ended"


@pytest.mark.parametrize(
    ("string", "length"),
    [
        ({"type": "string", "maxLength": 20}, 3),
        ({"type": "string", "minLength": 3}, 3),
        ({"type": "string", "minLength": 1, "maxLength": 1}, 1),  # the class inline
        ({"type": ["string", "null"], "maxLength": 5}, 2),
        ({"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}]}, 4),
    ],
)
def test_bounded_strings_take_printable_characters_but_no_raw_control_character(
    compiler, string, length
):
    """RFC 8259 forbids U+0000-U+001F unescaped in a string; xgrammar's bounded strings let
    all but CR and LF through (mlc-ai/xgrammar#800). ``length`` is one the bounds allow."""
    spec = _json(_obj(v=string))

    def accepts(value: str) -> bool:
        return bool(compiler.matcher(spec).inner.accept_string('{"v": "' + value + '"}'))

    for code in range(0x20):
        assert not accepts("a" * (length - 1) + chr(code)), hex(code)
    for chars in ("abc", "a b", "naï", "日本語", "🙂~!", "\x7f/'"):
        assert accepts((chars * length)[:length]), chars


def test_bounded_strings_keep_their_bounds(compiler):
    spec = _json(_obj(v={"type": "string", "minLength": 2, "maxLength": 20}))

    def accepts(value: str) -> bool:
        return bool(compiler.matcher(spec).inner.accept_string('{"v": "' + value + '"}'))

    assert accepts("é" * 20) and accepts("🙂" * 2)  # characters, not bytes
    assert not accepts("x" * 21) and not accepts("x")


@pytest.mark.parametrize(
    "string",
    [{"type": "string"}, {"type": "string", "maxLength": 4}, {"type": "string", "minLength": 1}],
)
def test_strings_take_no_utf8_encoded_surrogate(compiler, string):
    """ED A0 80 (U+D800 encoded) is not UTF-8: it decodes to three U+FFFD, so a string of
    maxLength 1 would come out 3 long. xgrammar lets it into every JSON string."""
    if grammar._UTF8_JSON_CLASS not in grammar._mended_classes().values():
        pytest.skip("this xgrammar's character classes cannot leave the surrogates out")
    spec = _json(_obj(v=string))

    def accepts(value: bytes) -> bool:
        return bool(compiler.matcher(spec).inner.accept_string(b'{"v": "' + value + b'"}'))

    for surrogate in (b"\xed\xa0\x80", b"\xed\xbf\xbf"):
        assert not accepts(surrogate)
    for character in (b"\xed\x9f\xbf", b"\xee\x80\x80", "🙂".encode()):  # U+D7FF, U+E000
        assert accepts(character)


@pytest.mark.parametrize(
    ("string", "says"),
    [
        (
            {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
            ": a string's pattern, maxLength",
        ),
        ({"type": "string", "format": "email", "minLength": 5}, ": a string's format, minLength"),
        ({"type": "string", "format": "date", "pattern": "^x$"}, ": a string's format, pattern"),
        (
            {"type": "string", "pattern": "^a+$", "minLength": 2, "maxLength": 4},
            ": a string's pattern, minLength and maxLength",
        ),
        ({"maxLength": 3}, ': without "type": "string", maxLength is ignored'),
        ({"allOf": [{"type": "string"}, {"pattern": "^a$"}]}, "/allOf/1: without"),
    ],
)
def test_string_keywords_xgrammar_would_drop_are_refused_naming_the_subschema(
    compiler, string, says
):
    """xgrammar follows format, else pattern, else the length bounds, and only beside
    "type": "string"; it drops the rest silently, and its outputs would not validate. The
    refusal names the keywords and where they are."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": string}}}
    with pytest.raises(FieldError) as info:
        compiler.compile(_json(schema))
    assert info.value.field == "structured_outputs.json"
    assert f"cannot be compiled: at #/properties/items/items{says}" in str(info.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^a+$", "minLength": 0},  # minLength 0 bounds nothing
        {"type": "integer", "pattern": "^a+$", "maxLength": 3},  # not a string: ignored
        {"type": "string", "format": "no-such-format", "maxLength": 3},  # unknown: ignored
        {"properties": {"pattern": {"type": "string"}, "maxLength": {"type": "integer"}}},
        {"enum": ["abc", 1], "maxLength": 5},  # the values listed
        {"type": ["string", "null"], "maxLength": 3},
    ],
)
def test_string_keywords_that_do_not_clash_still_compile(compiler, schema):
    compiler.compile(_json(schema))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (_json({"type": "no-such-type"}), 'Unsupported type "no-such-type"'),
        (
            _json({"type": "integer", "minimum": 5, "maximum": 1}),
            "Invalid range: minimum greater than maximum",
        ),
        (_json({"type": "string", "pattern": "([a-"}), "Regex parsing error at position 5"),
        (StructuredOutputs(StructuredKind.REGEX, "([a-"), "Regex parsing error at position 5"),
        (
            StructuredOutputs(StructuredKind.GRAMMAR, "root ::= missing_rule"),
            'EBNF parser error at line 1, column 10: Rule "missing_rule" is not defined',
        ),
    ],
)
def test_compile_errors_say_what_is_wrong_without_the_library_source_location(compiler, spec, says):
    """xgrammar's messages start with its log prefix, e.g. "[09:08:40]
    /project/cpp/json_schema_converter.cc:5082: "; the client is told only the rest."""
    with pytest.raises(FieldError) as info:
        compiler.compile(spec)
    message = str(info.value)
    assert message.startswith(f"{spec.field}: cannot be compiled: {says}"), message
    assert ".cc:" not in message and "/project/" not in message and "\n" not in message
