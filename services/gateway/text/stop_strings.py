"""Stop strings: finding them in streamed text, across any split into deltas.

One :class:`StopStringMatcher` per sample, fed the detokenizer's deltas in order. It holds
back only the text that could still be the start of a stop string, so everything else streams
at once, and reports a stop string as soon as one is complete.

Semantics (matching is by Unicode code point, as Python ``str`` compares):

* A stop string is *complete* once all its characters have been fed. At the first
  :meth:`~StopStringMatcher.feed` where at least one stop string is complete, the matcher
  finishes with the match that starts earliest in the text; among those starting at the same
  place, the longest. A longer stop string that is still only partly fed does not delay the
  decision: generation stops as early as possible (as in vLLM and HF ``generate``).
* The text returned by all feeds and :meth:`~StopStringMatcher.flush` is the fed text up to
  the match (plus the stop string itself if ``include_stop_str_in_output``), or all of it if
  nothing matched.
* After a match, or after :meth:`~StopStringMatcher.flush`, the matcher is finished: further
  feeds return ``("", None)`` and ignore their text (an executor may still deliver tokens of
  the step in which the gateway decided to stop).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas; see the module docstring."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a string")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._include = include_stop_str_in_output
        self._held = ""
        self._matched: str | None = None
        self._finished = False

    @property
    def stops(self) -> tuple[str, ...]:
        """The distinct stop strings, in the order given."""
        return self._stops

    @property
    def held_text(self) -> str:
        """Text fed but not yet returned: the longest suffix of it that is a proper prefix of
        some stop string (empty once finished)."""
        return self._held

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched

    @property
    def finished(self) -> bool:
        """True after a match or :meth:`flush`."""
        return self._finished

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add the next text delta. Returns ``(text safe to emit now, matched stop string)``;
        a non-None match means the text is complete: stop generating."""
        if self._finished:
            return "", None
        text = self._held + delta
        match = self._find_earliest(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self._matched = stop
            self._finished = True
            end = start + len(stop) if self._include else start
            return text[:end], stop
        hold = holdback_len(text, self._stops)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """End of generation without a match: release the held-back text and finish."""
        if self._finished:
            return ""
        self._finished = True
        held, self._held = self._held, ""
        return held

    def _find_earliest(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the earliest complete stop string in ``text``; ties: longest."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            if best is None or start < best[0] or (start == best[0] and len(stop) > len(best[1])):
                best = (start, stop)
        return best


def holdback_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops``:
    the text that may still become one, held back while text streams.

    Only lengths ``k`` where the stop's ``k``-th character equals the text's last one are
    compared (found with ``str.rfind``), so typical stops cost a few C-level compares and
    memory stays linear in the stops' length, whatever a client sends."""
    if not text:
        return 0
    n, last, best = len(text), text[-1], 0
    for stop in stops:
        j = stop.rfind(last, 0, min(len(stop) - 1, n))  # candidate k = j + 1
        while j >= best:  # i.e. k > best
            if text[n - j - 1] == stop[0] and stop.startswith(text[n - j - 1 :]):
                best = j + 1
                break
            j = stop.rfind(last, 0, j)
    return best
