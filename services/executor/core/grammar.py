"""Structured outputs in the engine: grammars compiled with xgrammar (cached by their
specification, compiled off the engine thread by the service), a matcher per constrained
sample, and the token bitmask applied to the logits before sampling.

JSON is compact (no free whitespace between tokens, as with vLLM's
``disable_any_whitespace``): a model may otherwise pad forever with blanks.

A sample's matcher has accepted exactly its output tokens: a preemption keeps it (the
outputs do not change), a fork of an n > 1 request starts a fresh one per sample, and a
sample resumed from earlier outputs replays them. Once the matcher has accepted an end
token the output is complete and the sample stops.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import structlog
from torch import Tensor

from services.common.limits import FieldError
from services.common.structured_outputs import StructuredKind, StructuredOutputs

__all__ = ["GrammarCompiler", "Matcher", "accept"]

log = structlog.get_logger(__name__)

_CACHE_SIZE = 512


def _choice_grammar(choices: Sequence[str]) -> str:
    # JSON string escapes are EBNF string-literal escapes for xgrammar.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


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
                error = FieldError(spec.field, f"cannot be compiled: {exc}")
                future.set_exception(error)
                with self._lock:
                    self._cache.pop(spec, None)  # not cached: it may be a transient failure
        return future.result()

    def _compile(self, spec: StructuredOutputs) -> Any:
        c = self._compiler
        match spec.kind:
            case StructuredKind.JSON:
                return c.compile_json_schema(spec.spec, any_whitespace=False)
            case StructuredKind.JSON_OBJECT:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
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
