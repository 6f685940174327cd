"""Incremental detokenization: turning a sample's token ids into text deltas as they arrive.

One :class:`IncrementalDetokenizer` per sample. Each :meth:`~IncrementalDetokenizer.push`
decodes a small *window* of ids — a few context ids whose text was already accounted for,
plus the ids not yet fully emitted — and returns the part of the window's text beyond what
was accounted for (the prefix/read-offset technique of vLLM and ``tokenizers.DecodeStream``).
Decoding in context is what keeps a SentencePiece ``▁word`` token's leading space, which
decoding the token alone would strip; a bounded window keeps the cost per token O(window).

**Guarantee.** Let ``P`` be the prompt ids and ``O`` all ids pushed, and ``decode`` the
tokenizer's ``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``. The
concatenation of every :meth:`push` delta and :meth:`flush` is the text that ``O`` adds to the
prompt, ``decode(P + O)[L:]``, where ``L`` is the larger of

* ``len(decode(P[:c]))``, ``c`` being the prompt's last clean boundary: the largest
  ``c >= len(P) - 8`` (:data:`MAX_PROMPT_TAIL_TOKENS`) such that ``decode(P[:c])`` does not
  end in U+FFFD (0 if there is none), and
* the length of the longest common prefix of ``decode(P)`` and ``decode(P + O)``.

Normally ``c == len(P)``, ``decode(P)`` is a prefix of ``decode(P + O)`` and
``L == len(decode(P))``. When the prompt's ids end inside a UTF-8 character, the character
that ``O`` completes counts as output (``L`` stops before it); a prompt whose text really ends
in U+FFFD keeps it (nothing in ``O`` changes it). For byte-level BPE with a prompt ending on a
character boundary this is ``decode(O)``. For SentencePiece-style tokenizers it keeps the
leading space of a first ``▁word`` output token (which ``decode(O)`` strips); with an empty
prompt, or one that decodes to nothing (a skipped BOS), it is ``decode(O)``, stripped like the
tokenizer strips the start of any text.

Exact whenever ``decode(P + O)`` contains no U+FFFD, and for byte-level tokenizers also with
invalid bytes anywhere. A ByteFallback decoder turns a *whole* run of byte tokens into U+FFFD
when any byte in it is invalid, retroactively: characters of such a run that were already
streamed are not retracted, so the stream then differs from ``decode`` inside that run (the
text after the run is exact again).

**Never a broken character.** While the window's text ends in U+FFFD (an incomplete — or
invalid — UTF-8 sequence), that U+FFFD run is held back; the text before it is emitted.
:meth:`~IncrementalDetokenizer.flush` releases what is still held, so invalid trailing bytes
then appear as U+FFFD. A valid character spans at most 4 bytes, so when
:data:`MAX_HELD_TOKENS` ids in a row leave the text unfinished, the window is cut at its last
final boundary (see ``_release_held``); only invalid byte-fallback soup can leave none, and
then the held text is released, U+FFFD included. Either way the window stays bounded.

**Cost.** Per push, one decode of the window (at most :data:`MAX_CONTEXT_TOKENS` context ids
plus the ids not yet emitted, at most :data:`MAX_HELD_TOKENS` plus the push itself) and, when
text was emitted, one decode of the new context (usually the last id alone).

Not covered: ``clean_up_tokenization_spaces`` (a whole-text rewrite, not incremental; it is
never applied) and slow (pure-Python) tokenizers beyond ``tokenizer.decode`` semantics.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Longest context kept in front of the unemitted ids (after a large push, for instance).
MAX_CONTEXT_TOKENS = 8
# Unemitted ids held before giving up on completing the text (see module docstring).
MAX_HELD_TOKENS = 32
# Ids over which one incomplete UTF-8 character can spread (3 bytes before the last one).
_MAX_INCOMPLETE_TOKENS = 4
# How far back from the prompt's end to look for its last clean character boundary.
MAX_PROMPT_TAIL_TOKENS = 8

_Decode = Callable[[Sequence[int]], str]
_special_ids_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, frozenset[int]] = (
    weakref.WeakKeyDictionary()
)


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops, cached per tokenizer: for a
    fast tokenizer exactly the added tokens its backend marks special (that is what its decode
    skips), otherwise the declared special ids and the added tokens marked special."""
    with contextlib.suppress(KeyError, TypeError):
        return _special_ids_cache[tokenizer]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        added = backend.get_added_tokens_decoder()
        result = frozenset(i for i, tok in added.items() if tok.special)
    else:
        added = tokenizer.added_tokens_decoder
        special = {i for i, tok in added.items() if tok.special}
        result = frozenset(special | set(tokenizer.all_special_ids))
    with contextlib.suppress(TypeError):  # not weak-referenceable: recompute next time
        _special_ids_cache[tokenizer] = result
    return result


def _make_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> _Decode:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizer: skip the Python wrapper, same result
        return lambda ids: backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return lambda ids: cast(  # a list of ids decodes to one string
        str,
        tokenizer.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        ),
    )


def _stable_end(text: str) -> int:
    """Length of ``text`` without its trailing run of U+FFFD (the part that may still change)."""
    return len(text.rstrip(REPLACEMENT_CHAR))


class IncrementalDetokenizer:
    """Streams the text of one sample's output ids; see the module docstring for the contract.

    Not thread-safe; one instance per sample. After :meth:`flush`, :meth:`push` raises.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        # Skipped ids are dropped before windowing: decode ignores them anyway, and they would
        # otherwise sit in the window without ever producing text.
        self._skip_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._pieces: list[str] = []
        self._finished = False
        # Window = context ids (text accounted before this sample's output) + unemitted ids.
        self._window: list[int] = []
        self._num_context = 0  # ids at the front of the window that are context
        self._context_len = 0  # chars of decode(context)
        self._num_accounted = 0  # chars of decode(window) already emitted or context
        # Text of context + prompt ids after the prompt's last clean boundary, until resolved.
        self._prompt_tail_text: str | None = None
        self._prime([i for i in prompt_token_ids if i not in self._skip_ids])

    @property
    def text(self) -> str:
        """All text emitted so far (pushes and flush)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def finished(self) -> bool:
        """True once :meth:`flush` was called."""
        return self._finished

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output ids; return the new text they complete (possibly empty)."""
        if self._finished:
            raise RuntimeError("push() after flush(): the stream is finished")
        new_ids = [i for i in token_ids if i not in self._skip_ids]
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        text = self._decode(self._window)
        end = _stable_end(text)
        self._account_prompt_tail(text[:end], resolved=end == len(text))
        delta = text[self._num_accounted : end] if end > self._num_accounted else ""
        self._num_accounted = max(self._num_accounted, end)
        if end == len(text):
            if len(text) > self._context_len:  # the new ids made text: they become context
                self._rebase(len(self._window), self._num_accounted)
            elif len(self._window) - self._num_context > MAX_HELD_TOKENS:
                del self._window[self._num_context :]  # ids that never make any text
        elif len(self._window) - self._num_context > MAX_HELD_TOKENS:
            delta += self._release_held(text)
        return self._emit(delta)

    def flush(self) -> str:
        """End of the stream: return the text still held back (an incomplete or invalid UTF-8
        tail, as U+FFFD). Idempotent."""
        if self._finished:
            return ""
        self._finished = True
        text = self._decode(self._window) if len(self._window) > self._num_context else ""
        self._account_prompt_tail(text, resolved=True)
        delta = text[self._num_accounted :] if len(text) > self._num_accounted else ""
        return self._emit(delta)

    # -- internals --------------------------------------------------------------------------

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta

    def _prime(self, prompt_ids: list[int]) -> None:
        """Take context from the end of the prompt: a short suffix ending at its last clean
        boundary (at most :data:`MAX_PROMPT_TAIL_TOKENS` ids back). Prompt ids after that
        boundary stay in the window as a *tail*: their text is output only where the output's
        bytes change it (complete a character the prompt ends inside)."""
        n = len(prompt_ids)
        context: list[int] = []
        context_len = 0
        cut = max(n - MAX_PROMPT_TAIL_TOKENS, 0)  # no clean boundary: the tail alone
        for candidate in range(n, cut, -1):
            found = self._choose_context(prompt_ids[:candidate])
            if found is not None:
                (context, context_len), cut = found, candidate
                break
        self._window = [*context, *prompt_ids[cut:]]
        self._num_context = len(context)
        self._context_len = self._num_accounted = context_len
        if cut < n:
            self._prompt_tail_text = self._decode(self._window)

    def _account_prompt_tail(self, stable_text: str, resolved: bool) -> None:
        """Count as prompt the part of the prompt tail's text that the output left unchanged
        (its common prefix with ``stable_text``); once ``resolved``, forget the tail."""
        tail = self._prompt_tail_text
        if tail is None:
            return
        common = 0
        for a, b in zip(stable_text, tail, strict=False):
            if a != b:
                break
            common += 1
        self._num_accounted = max(self._num_accounted, common)
        if resolved:
            self._prompt_tail_text = None

    def _choose_context(self, ids: Sequence[int]) -> tuple[list[int], int] | None:
        """The shortest suffix of ``ids`` (at most :data:`MAX_CONTEXT_TOKENS`) whose text is
        non-empty and free of U+FFFD — so it starts on a character boundary and its first
        character absorbs any strip of a leading space — with its text length."""
        for size in range(1, min(len(ids), MAX_CONTEXT_TOKENS) + 1):
            suffix = list(ids[-size:])
            text = self._decode(suffix)
            if text and REPLACEMENT_CHAR not in text:
                return suffix, len(text)
        return None

    def _rebase(self, cut: int, text_len_at_cut: int) -> None:
        """Make ``window[:cut]`` (whose text is ``text_len_at_cut`` chars, all accounted and
        ending on a character boundary) context, keeping only a short suffix of it."""
        found = self._choose_context(self._window[:cut])
        if found is None:  # nothing clean to stand on: keep the last ids as they are
            context = self._window[max(cut - MAX_CONTEXT_TOKENS, 0) : cut]
            found = context, len(self._decode(context))
        context, context_len = found
        beyond = self._num_accounted - text_len_at_cut  # chars emitted from ids after cut
        self._window = [*context, *self._window[cut:]]
        self._num_context = len(context)
        self._context_len = context_len
        self._num_accounted = context_len + beyond
        self._prompt_tail_text = None

    def _release_held(self, text: str) -> str:
        """The window grew long while its text ends unfinished; runs at most once per
        :data:`MAX_HELD_TOKENS` ids. Rebase at the last boundary whose text is final:

        1. a clean one (text not ending in U+FFFD) among the last :data:`MAX_CONTEXT_TOKENS`
           ids — the usual case: a large push that stops inside a character (three ids back
           at most). The text up to it is emitted: a ByteFallback run holds back all its text
           until it is valid, so the boundary may lie beyond what was emitted;
        2. otherwise (invalid byte soup) one of the last three ids after which the text
           already moved on: lossy UTF-8 decoding (byte-level BPE) never revisits a U+FFFD
           that more text follows, so for byte-level tokenizers this always succeeds;
        3. otherwise give up on completing the text: emit it, U+FFFD included.
        """
        n = len(self._window)
        heads: dict[int, str] = {}
        for cut in range(n - 1, max(n - MAX_CONTEXT_TOKENS - 1, self._num_context), -1):
            heads[cut] = head = self._decode(self._window[:cut])
            if head and not head.endswith(REPLACEMENT_CHAR):
                return self._emit_and_rebase_at(cut, head)
        for cut in range(n - 1, max(n - _MAX_INCOMPLETE_TOKENS, self._num_context), -1):
            head = heads[cut]
            if len(head) < len(text) and text.startswith(head):
                return self._emit_and_rebase_at(cut, head)
        return self._emit_and_rebase_at(n, text)

    def _emit_and_rebase_at(self, cut: int, head: str) -> str:
        """Emit ``head`` (the final text of ``window[:cut]``) where not emitted yet, and make
        ``window[:cut]`` context."""
        delta = head[self._num_accounted :]
        self._num_accounted = max(self._num_accounted, len(head))
        self._rebase(cut, len(head))
        return delta
