"""The facade's data: what a step and a generate call hand back, the engine's counters, the
KV usage of the running sequences, and what a runner hook is told about each forward.

Plain data, no behaviour: the facade (:mod:`.engine`) builds them from the engine's own
types, so that a caller never holds an engine object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from services.executor.core.outputs import TokenLogprob, Usage
from services.executor.core.sequence import FinishReason

__all__ = [
    "CompletionOutput",
    "EngineStats",
    "ForwardInfo",
    "KVUsage",
    "RequestOutput",
    "RunnerHook",
    "StepOutput",
]


@dataclass(slots=True)
class StepOutput:
    """The new tokens of one sample of one request in one step, and its end if it ended
    (read it, do not change it: made per sample and step, it is not frozen, for speed).

    ``usage`` comes with a sample's first token (its prompt's cache hits) and with its end;
    ``prompt_logprobs`` with sample 0's first output when the request asked for them. A beam
    search emits nothing until it is done, then each beam whole, best first."""

    request_id: str
    index: int  # which of the request's n samples (beams: rank, best first)
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS or stop token that ended it, if one did
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One finished sample of a :meth:`~.engine.InProcessEngine.generate` request."""

    index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stop_token_id: int | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    text: str | None = None  # decoded when the prompt was given as text


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished :meth:`~.engine.InProcessEngine.generate` request: its samples by index."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counters since it was built (a snapshot; cheap to take)."""

    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens computed, recomputation after preemption included
    num_generation_tokens: int
    num_cached_prompt_tokens: int  # prompt tokens of finished requests served from the cache
    num_round_trips: int  # block-manager Steps sent
    num_steps_ahead: int  # steps whose Step was sent during the forward before (async)
    num_running: int
    num_waiting: int
    last_step_host_s: float  # the last step's wall time outside the forward
    last_step_forward_s: float  # and inside it (batch build and model)
    # Speculative decoding (vLLM's counters; 0 without it): sequence-steps that verified
    # drafts, draft tokens verified, drafts accepted, and accepted by draft position.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a sequence on average: 1 + accepted drafts."""
        return 1.0 + self.num_spec_accepted_tokens / max(1, self.num_spec_drafts)


@dataclass(frozen=True, slots=True)
class KVUsage:
    """The block tables of the running sequences now (their first KV-cache group's).

    ``num_unused_slots``: slots of the tables holding no token, less the slots granted ahead
    for the next forward (async scheduling): the paging's internal waste, under one block
    per sequence by design. Meant for full-attention tables: a sliding table's released
    entries count as slots too."""

    num_seqs: int
    num_blocks: int  # table entries, summed over the sequences (a shared block counts again)
    num_distinct_blocks: int  # distinct blocks the tables reference (sharing counted once)
    num_slots: int  # the tables' token slots: entries x block size
    num_unused_slots: int
    max_seq_unused_slots: int  # the largest of one sequence


class ForwardInfo(NamedTuple):
    """What one forward computes: ``num_seqs`` sequences, ``num_tokens`` new tokens in all,
    over ``num_context_tokens`` (each sequence's cached tokens plus its new ones)."""

    num_seqs: int
    num_tokens: int
    num_context_tokens: int

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token (a pure decode step)."""
        return self.num_tokens == self.num_seqs


#: Called around every forward of the model: ``hook(info, forward)`` must call ``forward()``
#: exactly once and return its result (the logits); what it does around that call (timing,
#: counting, profiling) is its own. ``forward()`` is the device half of the forward (the
#: batch uploaded and the model run; on CUDA it may return before the device is done), the
#: host batch being built before the hook is called. It runs on the engine's thread, inside
#: ``step()``.
RunnerHook = Callable[[ForwardInfo, Callable[[], Tensor]], Tensor]
