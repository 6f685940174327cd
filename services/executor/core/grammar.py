"""Structured outputs in the engine: grammars compiled with xgrammar (cached by their
specification, compiled off the engine thread by the service), a matcher per constrained
sample, and the token bitmask applied to the logits before sampling.

JSON is compact (no free whitespace between tokens, as with vLLM's
``disable_any_whitespace``): a model may otherwise pad forever with blanks. A JSON schema
goes through xgrammar's converter to EBNF, and its strings bounded by ``minLength`` or
``maxLength`` are mended there before compiling (see :func:`json_schema_grammar`); a string
schema with keywords xgrammar would silently drop is refused instead.

A sample's matcher has accepted exactly its output tokens: a preemption keeps it (the
outputs do not change), a fork of an n > 1 request starts a fresh one per sample, and a
sample resumed from earlier outputs replays them. Once the matcher has accepted an end
token the output is complete and the sample stops.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import structlog
from torch import Tensor

from services.common.limits import FieldError
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredKind, StructuredOutputs
from services.executor.core.outputs import EngineError, RequestErrorCode

__all__ = [
    "GrammarCompiler",
    "Matcher",
    "accept",
    "compile_error_message",
    "json_schema_grammar",
    "request_matcher",
]

log = structlog.get_logger(__name__)

_CACHE_SIZE = 512


def _choice_grammar(choices: Sequence[str]) -> str:
    # JSON string escapes are EBNF string-literal escapes for xgrammar.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar (0.1.25 to 0.2.9, the latest; mlc-ai/xgrammar#800) writes a JSON string bounded by
# minLength / maxLength as a repetition of one character class, printed as _BOUNDED_CLASS: it
# lets the raw control characters U+0000-U+001F but CR and LF through, which JSON forbids
# unescaped (RFC 8259, section 7). Each occurrence becomes the class of the characters JSON
# allows unescaped. Escapes stay out of bounded strings, as before: an escape rule repeated
# there would leave xgrammar's fast path for a repeated character class (a mask then takes
# milliseconds a token, not microseconds).
_BOUNDED_CLASS = r"[^\"\\\r\n]"
_JSON_CLASS = r"[^\0-\x1f\"\\]"
# Both that class and the one of unbounded strings (_UNBOUNDED_CLASS) also take surrogate code
# points, UTF-8 encoded (ED A0 80 to ED BF BF): not UTF-8, they decode to three U+FFFD each,
# which breaks a bounded string's length. They are left out too where xgrammar's classes
# can leave them out (some versions, 0.1.34 and 0.2.0 among them, then take no ASCII at all).
_UNBOUNDED_CLASS = r"[^\0-\x1f\"\\\r\n]"
_UTF8_JSON_CLASS = r"[^\0-\x1f\"\\\ud800-\udfff]"
# A printed grammar's string literals (Regex("...") patterns among them) and character
# classes: a class is replaced as a whole token, never inside a literal or another class.
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', re.DOTALL)

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = frozenset(
    {"additionalItems", "additionalProperties", "contains", "else", "if", "items", "not"}
    | {"propertyNames", "then", "unevaluatedItems", "unevaluatedProperties"}
)
_SUBSCHEMAS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset(
    {"$defs", "definitions", "dependencies", "dependentSchemas", "patternProperties", "properties"}
)


@functools.lru_cache(maxsize=64)
def _known_format(name: str) -> bool:
    """xgrammar has a grammar for string format ``name`` (it ignores the others, as
    jsonschema does unless asked)."""
    import xgrammar as xgr

    def grammar(schema: dict[str, str]) -> str:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))

    unknown = {"type": "string", "format": "x-no-such-format"}
    return grammar({"type": "string", "format": name}) != grammar(unknown)


def _string_keywords(schema: dict[str, Any]) -> list[str]:
    """The string keywords of ``schema`` that xgrammar could enforce, each group apart (see
    :func:`_check_string_keywords`)."""
    found = []
    if isinstance(schema.get("format"), str) and _known_format(schema["format"]):
        found.append("format")
    if isinstance(schema.get("pattern"), str):
        found.append("pattern")
    bounds = [
        key
        for key, least in (("minLength", 1), ("maxLength", 0))
        if isinstance(schema.get(key), int) and schema[key] >= least  # minLength 0: no bound
    ]
    if bounds:
        found.append(" and ".join(bounds))
    return found


def _check_string_keywords(schema: Any, path: str = "#") -> None:
    """Raise ValueError for a subschema of ``schema`` (named by its JSON pointer from
    ``path``) with string keywords that xgrammar would drop silently, so that its outputs
    would not validate: it follows ``format``, else ``pattern``, else ``minLength`` /
    ``maxLength``, and only beside ``"type": "string"`` (with ``enum`` or ``const``, the
    values listed)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_string_keywords(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    found = [] if "enum" in schema or "const" in schema else _string_keywords(schema)
    if found and kind is None:
        raise ValueError(f'at {path}: without "type": "string", {", ".join(found)} is ignored')
    if len(found) > 1 and (kind == "string" or (isinstance(kind, list) and "string" in kind)):
        raise ValueError(
            f"at {path}: a string's {', '.join(found)} cannot all be enforced together "
            "(keep one: put length bounds in the pattern)"
        )
    for key, value in schema.items():
        if key in _SUBSCHEMA or key in _SUBSCHEMAS:
            _check_string_keywords(value, f"{path}/{key}")
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, item in value.items():
                _check_string_keywords(item, f"{path}/{key}/{name}")


@functools.cache
def _mended_classes() -> dict[str, str]:
    """xgrammar's character classes of JSON strings -> the classes that replace them: with
    surrogates left out if this xgrammar's classes do that right (tried on a small
    vocabulary: a, é, 🙂, U+D7FF, U+D800 encoded, U+0001)."""
    import xgrammar as xgr

    vocab = [b"a", "é".encode(), "🙂".encode(), b"\xed\x9f\xbf", b"\xed\xa0\x80", b"\x01", b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgr.GrammarCompiler(info).compile_grammar(f"root ::= {_UTF8_JSON_CLASS}")
    mask = xgr.allocate_token_bitmask(1, len(vocab))
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
    allowed = [bool(int(mask[0, 0]) >> i & 1) for i in range(len(vocab) - 1)]
    if allowed != [True, True, True, True, False, False]:
        return {_BOUNDED_CLASS: _JSON_CLASS}
    return {_BOUNDED_CLASS: _UTF8_JSON_CLASS, _UNBOUNDED_CLASS: _UTF8_JSON_CLASS}


def _mend_strings(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar of a JSON schema), its strings made of the
    characters JSON allows unescaped (see ``_BOUNDED_CLASS``)."""
    mended = _mended_classes()
    return _EBNF_TOKEN.sub(lambda m: mended.get(m.group(), m.group()), ebnf)


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar of compact JSON following ``schema``: xgrammar's, its strings bounded
    by ``minLength`` / ``maxLength`` mended (no raw control character) and, where this
    xgrammar can, no string taking an encoded surrogate. Raises ValueError for a schema
    with string keywords that xgrammar would not all enforce."""
    import xgrammar as xgr

    _check_string_keywords(json.loads(schema))
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    return _mend_strings(str(grammar))


# xgrammar's errors start with its log prefix, "[HH:MM:SS] /path/to/source.cc:LINE: ".
_SOURCE_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\]\s+\S+:\d+:\s*")


def compile_error_message(exc: Exception) -> str:
    """What ``exc``, an error compiling a specification, says about it: one line, without
    the library's log prefix (its time and source location)."""
    text = " ".join(_SOURCE_LOCATION.sub("", str(exc)).split())
    return text or type(exc).__name__


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` for one tokenizer and vocabulary; thread-safe.
    The ``max_cached`` latest compilations are kept, and a compilation in progress is
    shared by every request that asks for the same specification."""

    def __init__(
        self,
        tokenizer: Any,  # a transformers PreTrainedTokenizerBase
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_threads: int = 1,
        max_cached: int = _CACHE_SIZE,
    ) -> None:
        import xgrammar as xgr  # imported with the first compiler: optional elsewhere

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Future[Any]] = OrderedDict()
        self._max_cached = max_cached
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # host int32, grown on use

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of ``spec`` (an ``xgrammar.CompiledGrammar``), from the cache
        or compiled now; raises :class:`FieldError` naming ``spec``'s field."""
        with self._lock:
            future = self._cache.get(spec)
            owner = future is None
            if future is None:
                future = self._cache[spec] = Future()
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
        if owner:
            try:
                future.set_result(self._compile(spec))
            except Exception as exc:  # any compiler error is the request's
                error = FieldError(spec.field, f"cannot be compiled: {compile_error_message(exc)}")
                future.set_exception(error)
                with self._lock:
                    self._cache.pop(spec, None)  # not cached: it may be a transient failure
        return future.result()

    def _compile(self, spec: StructuredOutputs) -> Any:
        c = self._compiler
        match spec.kind:
            case StructuredKind.JSON:
                return c.compile_grammar(json_schema_grammar(spec.spec))
            case StructuredKind.JSON_OBJECT:
                return c.compile_grammar(json_schema_grammar('{"type": "object"}'))
            case StructuredKind.REGEX:
                return c.compile_regex(spec.spec)
            case StructuredKind.CHOICE:
                return c.compile_grammar(_choice_grammar(spec.choices))
            case StructuredKind.GRAMMAR:
                return c.compile_grammar(spec.spec)
        raise AssertionError(spec.kind)

    def matcher(self, spec: StructuredOutputs, output_token_ids: Sequence[int] = ()) -> Matcher:
        """A matcher for a sample of ``spec`` that has already produced ``output_token_ids``
        (a resumed sample); raises :class:`FieldError` if they do not follow it."""
        m = Matcher(self.compile(spec), self)
        for i, token in enumerate(output_token_ids):
            if not m.accept(token):
                raise FieldError(
                    f"resume.output_token_ids[{i}]", f"token {token} does not follow {spec.field}"
                )
        return m

    def mask_logits(self, logits: Tensor, rows: dict[int, Matcher]) -> None:
        """Mask, in place, each row of ``logits`` in ``rows`` to the tokens its matcher
        allows next (the bitmask is filled on the host, then applied where the logits are)."""
        if not rows:
            return
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        mask = self._bitmask[: logits.shape[0]]
        for row, m in rows.items():
            m.inner.fill_next_token_bitmask(mask, row)
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits, mask, indices=list(rows))


class Matcher:
    """One sample's position in its grammar."""

    __slots__ = ("compiled", "compiler", "failed", "inner")

    def __init__(self, compiled: Any, compiler: GrammarCompiler) -> None:
        self.compiled = compiled  # the xgrammar.CompiledGrammar
        self.compiler = compiler
        self.inner = compiler._xgr.GrammarMatcher(compiled)
        self.failed = False

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it (nothing changes)."""
        return bool(self.inner.accept_token(token))

    @property
    def done(self) -> bool:
        """The output is complete (an end token was accepted), or cannot go on."""
        return self.failed or bool(self.inner.is_terminated())

    def fresh(self) -> Matcher:
        """A matcher at the start of this one's grammar (for a forked sample)."""
        return Matcher(self.compiled, self.compiler)

    def copy(self) -> Matcher:
        """A matcher in this one's state (for a forked beam), independent of it."""
        twin = Matcher.__new__(Matcher)
        twin.compiled, twin.compiler, twin.failed = self.compiled, self.compiler, self.failed
        twin.inner = self.inner.fork()
        return twin


def accept(matcher: Matcher, token: int) -> None:
    """Advance a sample's matcher by the token it sampled. A token its grammar refuses can
    only come from a row with nothing left to sample (every allowed token banned, e.g. the
    end token before ``min_tokens``): the sample then ends there."""
    if not matcher.accept(token):
        matcher.failed = True
        log.warning("grammar_refused_sampled_token", token=token)


def request_matcher(
    grammars: GrammarCompiler | None, params: SamplingParams, outputs: list[int]
) -> Matcher | None:
    """The grammar matcher of a request's sample (past ``outputs``), or None; raises
    :class:`EngineError` (INVALID_ARGUMENT, naming the field) for a grammar it cannot serve."""
    spec = params.structured_outputs
    if spec is None:
        return None
    if grammars is None:
        raise EngineError(
            RequestErrorCode.INVALID_ARGUMENT,
            f"sampling_params.{spec.field}: this executor has no tokenizer to compile "
            "grammars with (its model directory has none)",
        )
    try:
        return grammars.matcher(spec, outputs)
    except FieldError as exc:
        under = exc if exc.field.startswith("resume.") else exc.under("sampling_params")
        raise EngineError(RequestErrorCode.INVALID_ARGUMENT, str(under)) from None
