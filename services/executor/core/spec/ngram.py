"""The n-gram proposer (prompt lookup): the tokens that followed an earlier occurrence of the
sequence's last n tokens, in its prompt or its output (pure logic, no torch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["propose_ngram"]


def propose_ngram(
    token_ids: Sequence[int],
    num_tokens: int,
    *,
    min_n: int = 1,
    max_n: int = 3,
    stop_token_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Up to ``num_tokens`` draft tokens for a sequence of ``token_ids``: for n from ``max_n``
    down to ``min_n``, the first (earliest) earlier occurrence of the last n tokens that has
    a continuation gives that continuation. Drafts stop before a stop token (none is drafted).
    This is transformers' ``PromptLookupCandidateGenerator`` with ``max_matching_ngram_size``
    = ``max_n`` and ``num_output_tokens`` = ``num_tokens`` (which searches down to n = 1)."""
    length = len(token_ids)
    if num_tokens <= 0 or length < 2:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = ids[length - n :]
        # Candidate starts: where the first token of the n-gram occurs, before the tail
        # itself (a match at length - n has no continuation).
        starts = np.flatnonzero(ids[: length - n] == tail[0])
        for start in starts:
            if n > 1 and not np.array_equal(ids[start : start + n], tail):
                continue
            begin = int(start) + n
            drafts = [int(t) for t in ids[begin : min(begin + num_tokens, length)]]
            if not drafts:
                continue
            for i, token in enumerate(drafts):
                if token in stop_token_ids:
                    return drafts[:i]
            return drafts
    return []
