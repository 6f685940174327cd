"""Pooling (``--runner pooling``, vLLM's names): a request's prompt becomes one vector.

The model returns its final hidden states (after the last norm) instead of logits. LAST
pooling reads the row of the prompt's last token, the one a generating request samples from,
so it may use prefix hits; MEAN (the average of every prompt row) and CLS (the first row)
need every prompt row computed, as prompt log-probabilities do: their runner computes every
row of each chunk, and prefix caching is off for them (``--pooler-config`` checks it).
The vector is truncated to a request's ``dimensions`` (Matryoshka embeddings), then
L2-normalized unless the request or the pooler config says not to.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

import torch
from torch import Tensor

from services.executor.core.outputs import EngineError, RequestErrorCode
from services.executor.core.plan import ScheduledBatch

__all__ = [
    "Classifier",
    "PoolState",
    "PoolerConfig",
    "PoolingParams",
    "PoolingType",
    "finish",
    "take_pooled",
    "wrong_runner",
]


class PoolingType(enum.StrEnum):
    LAST = "LAST"
    MEAN = "MEAN"
    CLS = "CLS"


@dataclass(frozen=True)
class PoolerConfig:
    """``--pooler-config``: vLLM's JSON, ``{"pooling_type": "MEAN", "normalize": false}``."""

    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True
    # A reranker of a causal LM (vLLM's ``classifier_from_token``, Qwen3-Reranker's
    # ``["no", "yes"]``): the vector is one score, sigmoid(logit[yes] - logit[no]) of the
    # pooled state, from those two rows of the LM head.
    classifier_from_token: tuple[str, ...] = ()

    @property
    def every_row(self) -> bool:
        """Whether the pooling reads every prompt row (not only the last one)."""
        return self.pooling_type is not PoolingType.LAST

    @classmethod
    def parse(cls, text: str | None) -> PoolerConfig:
        """The config of ``text`` (None or empty: the defaults); ``ValueError`` names the
        key at fault."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError("must be a JSON object")
        unknown = sorted(set(raw) - {"pooling_type", "normalize", "classifier_from_token"})
        if unknown:
            raise ValueError(
                f"{unknown[0]}: unknown key (pooling_type, normalize, classifier_from_token are "
                "served)"
            )
        kind = raw.get("pooling_type", "LAST")
        if not isinstance(kind, str) or kind.upper() not in PoolingType.__members__:
            raise ValueError(f"pooling_type: must be LAST, MEAN or CLS, got {kind!r}")
        tokens = raw.get("classifier_from_token", [])
        if tokens and (
            not isinstance(tokens, list)
            or len(tokens) != 2
            or not all(isinstance(t, str) and t for t in tokens)
        ):
            raise ValueError(
                f'classifier_from_token: must be two tokens, [no, yes] (e.g. ["no", "yes"]), '
                f"got {tokens!r}"
            )
        normalize = raw.get("normalize", not tokens)
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {normalize!r}")
        if tokens and normalize:
            raise ValueError("normalize: a classifier's one score is not normalized")
        return cls(PoolingType(kind.upper()), normalize, tuple(tokens))


@dataclass(frozen=True)
class PoolingParams:
    """One request's: keep the first ``dimensions`` values (None: all), and normalize them
    (None: as the pooler config says)."""

    dimensions: int | None = None
    normalize: bool | None = None


class PoolState:
    """A pooling request's progress over its prompt (``Sequence.pooled``): the running sum
    and count of its rows (MEAN) or its first row (CLS)."""

    __slots__ = ("count", "first", "params", "total")

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.total: Tensor | None = None
        self.first: Tensor | None = None
        self.count = 0

    def add(self, start: int, rows: Tensor) -> None:
        """The rows of prompt positions ``start ..``: a chunk from position 0 starts over
        (a recomputation after preemption)."""
        if start == 0:
            self.total, self.first, self.count = None, rows[0], 0
        if start != self.count:
            raise AssertionError(f"pooled rows up to {self.count}, a chunk from {start}")
        chunk = rows.sum(dim=0)
        self.total = chunk if self.total is None else self.total + chunk
        self.count += rows.shape[0]

    def result(self, kind: PoolingType) -> Tensor:
        assert self.total is not None and self.first is not None
        return self.first if kind is PoolingType.CLS else self.total / self.count


def take_pooled(batch: ScheduledBatch, hidden: Tensor, config: PoolerConfig) -> Tensor:
    """The pooled vector of each chunk that ends its prompt, in order (``[n, H]``), from
    ``hidden``: a row per chunk that ends its prompt (LAST), or every row of every chunk
    (MEAN / CLS, recorded on the sequences). Runs before ``after_forward``: a chunk starts
    at its sequence's ``num_computed_tokens``."""
    if not config.every_row:
        return hidden
    pooled: list[Tensor] = []
    row = 0
    for seq, k, ends_prompt in batch.chunks:
        state: PoolState = seq.pooled
        state.add(seq.num_computed_tokens, hidden[row : row + k])
        row += k
        if ends_prompt:
            pooled.append(state.result(config.pooling_type))
    return torch.stack(pooled) if pooled else hidden[:0]


@dataclass(frozen=True)
class Classifier:
    """Scores of a pooled vector in place of the vector. ``pair``: a reranker of a causal LM
    (``classifier_from_token``): ``rows`` are the LM head's ``[no, yes]`` and the one score is
    sigmoid(logit[yes] - logit[no]), the logits soft-capped as the model caps them
    (``softcap``). Else a sequence classifier's ``score`` head (``[num_labels, H]``): one
    label gives sigmoid(logit), as a cross-encoder's relevance; more give the softmax
    probabilities of each, as transformers' classifiers are read."""

    rows: Tensor
    pair: bool = False
    softcap: float | None = None

    @property
    def num_labels(self) -> int:
        return 1 if self.pair else int(self.rows.shape[0])

    def scores(self, vectors: Tensor) -> list[list[float]]:
        logits = vectors.float() @ self.rows.float().T  # [n, C]
        if self.pair:
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return [[s] for s in torch.sigmoid(logits[:, 1] - logits[:, 0]).cpu().tolist()]
        probs = torch.sigmoid(logits) if logits.shape[1] == 1 else torch.softmax(logits, dim=-1)
        return probs.cpu().tolist()


def finish(
    vectors: Tensor,
    states: list[PoolState],
    config: PoolerConfig,
    classifier: Classifier | None = None,
) -> list[list[float]]:
    """Each request's vector as it is returned: its first ``dimensions`` values, normalized
    (L2) unless it or ``config`` says not to; or with a ``classifier``, its scores."""
    if classifier is not None:
        return classifier.scores(vectors)
    out: list[Tensor] = []
    for vector, state in zip(vectors.float(), states, strict=True):
        p = state.params
        v = vector[: p.dimensions] if p.dimensions else vector
        normalize = config.normalize if p.normalize is None else p.normalize
        out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return [v.cpu().tolist() for v in out]


def wrong_runner(runner: str, field: str) -> EngineError:
    """The refusal of a request of the other kind than this executor's ``--runner``."""
    if runner == "generate":
        why = "it samples tokens; embeddings need an executor started with --runner pooling"
    else:
        why = "it returns embeddings; generation needs an executor started with --runner generate"
    return EngineError(
        RequestErrorCode.INVALID_ARGUMENT, f"{field}: this executor runs --runner {runner} ({why})"
    )
