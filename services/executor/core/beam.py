"""Beam search, one request's bookkeeping, with Hugging Face transformers' semantics
(``generate(num_beams=k, num_return_sequences=k, length_penalty, early_stopping)``, greedy).

Each step, every live beam of the request has the log-probabilities of its next token. The
candidates are the top ``K = max(2, 1 + number of end tokens) * k`` continuations of all
beams by cumulative log-probability. The best ``k`` that do not end (an end token, or the
length limit) run on; those among the first ``k`` candidates that end become finished
hypotheses, scored by cumulative log-probability / (generated length ** length_penalty),
of which the best ``k`` are kept. The request is done when no running beam can beat the
worst kept hypothesis (transformers' heuristic: ``early_stopping=False`` measures the best
running beam at its current length, ``"never"`` at the longest possible when the penalty
favours length), when ``k`` hypotheses are kept and ``early_stopping=True``, or when every
candidate ends. The engine keeps the beams as sequences that share their blocks: a beam
chosen by several continuations is forked (copy on write of the last block), one chosen by
none is freed (see ``Engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

_NEG = -1.0e9  # transformers' "cannot be chosen" score


@dataclass
class Hypothesis:
    score: float  # length-penalised
    token_ids: list[int]  # the output
    ended_by: int | None  # the end token, or None (the length limit)


@dataclass
class Continuation:
    beam: int  # the position, in this step's beams, of the beam it continues
    token: int
    score: float  # cumulative log-probability


@dataclass
class BeamState:
    """One beam-search request: ``width`` beams, whose running scores follow the order of
    :meth:`step`'s ``beams`` argument (best first)."""

    width: int
    length_penalty: float
    early_stopping: str  # "false" (the heuristic), "true" or "never"
    max_tokens: int
    scores: list[float] = field(default_factory=lambda: [0.0])  # per running beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True
    done: bool = False

    def step(
        self,
        logprobs: Tensor,  # [live beams, V] float32 log-softmax of each beam's next token
        outputs: list[list[int]],  # each beam's output so far (same length for all)
        end_tokens: frozenset[int],  # tokens that end a beam (EOS unless ignored, stop ids)
        room: int,  # tokens a beam may still add before max_model_len
        banned: tuple[int, ...] = (),  # end tokens banned until min_tokens
    ) -> list[Continuation]:
        """Choose this step's continuations; returns the running beams of the next step,
        best first (empty once :attr:`done`)."""
        k = self.width
        gen_len = len(outputs[0]) + 1  # the length of every candidate
        vocab = logprobs.shape[1]
        if banned:
            logprobs = logprobs.clone()
            logprobs[:, list(banned)] = float("-inf")
        total = logprobs + torch.tensor(self.scores, dtype=logprobs.dtype)[:, None]
        n_end = len(end_tokens)
        num_candidates = min(max(2, 1 + n_end) * k, total.numel())
        top_scores, top_ids = torch.topk(total.flatten(), num_candidates)
        at_limit = gen_len >= self.max_tokens or room <= 1
        candidates = [
            Continuation(i // vocab, i % vocab, s)
            for s, i in zip(top_scores.tolist(), top_ids.tolist(), strict=True)
        ]
        ends = [at_limit or c.token in end_tokens for c in candidates]
        # (a candidate at -inf, a token a grammar or min_tokens forbids, never runs on)
        running = [c for c, e in zip(candidates, ends, strict=True) if not e and c.score > _NEG]
        running = running[:k]
        # Finished: those of the first k candidates that end, unless no improvement is
        # possible any more or (early_stopping=True) every slot is taken.
        full = len(self.finished) == k and self.early_stopping == "true"
        if self.improvable and not full:
            penalty = gen_len**self.length_penalty
            for c, e in zip(candidates[:k], ends[:k], strict=True):
                if e and c.score > _NEG / 2:
                    out = [*outputs[c.beam], c.token]
                    ended = c.token if c.token in end_tokens else None
                    self.finished.append(Hypothesis(c.score / penalty, out, ended))
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones first on ties
            del self.finished[k:]
        self.scores = [c.score for c in running]
        if running and self.improvable and len(self.finished) == k:
            longest = self.max_tokens if self.early_stopping == "never" else gen_len
            hypothetical = longest if self.length_penalty > 0 else gen_len
            best = running[0].score / hypothetical**self.length_penalty
            self.improvable = best > self.finished[-1].score
        open_beam = not (len(self.finished) == k and self.early_stopping == "true")
        self.done = not (self.improvable and open_beam and running)
        return [] if self.done else running

    def results(self) -> list[Hypothesis]:
        """The hypotheses to return, best first."""
        return self.finished[: self.width]
