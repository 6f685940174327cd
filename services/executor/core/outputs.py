"""What the engine hands back: per-step outputs of each sample, and refusals (pure data)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.executor.core.sequence import FinishReason, RequestKey, Sequence


class RequestErrorCode(enum.Enum):
    """Why a request was refused; each member means the gRPC status code of its name (the
    proto's ``RequestErrorCode``)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"  # an unknown LoRA adapter
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # an adapter in use, or changed on disk


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request refused at the executor's edge: nothing was queued for it."""

    request_id: str
    code: RequestErrorCode
    message: str  # names the offending field


class EngineError(Exception):
    """Raised by :meth:`Engine.add_request` for a request it refuses (nothing queued)."""

    def __init__(self, code: RequestErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @classmethod
    def of(cls, seq: Sequence) -> Usage:
        return cls(seq.prompt_len, seq.num_output_tokens, seq.num_cached_tokens)


@dataclass(slots=True)
class SeqOutput:
    """New tokens of one sample of one request in one step (and its end, if it ended)."""

    req_id: RequestKey
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None
    # Sample 0's first output of a request that asked for them: prompt tokens 1.. .
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    embedding: list[float] | None = None  # a pooling request's vector (its one output)
