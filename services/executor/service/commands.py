"""What crosses between the gRPC handlers and the engine thread: sessions, the commands the
handlers send, and the deliveries and load snapshots the engine thread sends back."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from services.common.sampling_params import SamplingParams
from services.executor.core.outputs import RequestError, SeqOutput
from services.executor.core.pooling import PoolingParams
from services.executor.core.sequence import Resume

_session_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's load after a step, published by the engine thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_usable_blocks: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_steps: int = 0
    num_blockmgr_round_trips: int = 0
    num_running_tokens: int = 0
    num_waiting_tokens: int = 0
    num_steps_ahead: int = 0
    num_offloaded_blocks: int = 0
    num_onboarded_blocks: int = 0
    num_spilled_blocks: int = 0
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    num_failed_moves: int = 0
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one session receives after one step, or after the commands that refused some of
    its requests."""

    step: int
    outputs: list[SeqOutput]
    errors: list[RequestError]
    load: Load


@dataclass(eq=False)
class Session:
    """One gateway stream. ``deliver`` is called from the engine thread and must only
    enqueue; ``None`` means the stream is done (half-closed and nothing left running)."""

    deliver: Callable[[Delivery | None], object]
    session_id: int = field(default_factory=lambda: next(_session_ids))
    live: dict[str, int] = field(default_factory=dict)  # request id (its own) -> sequences (n)
    half_closed: bool = False

    @property
    def num_seqs(self) -> int:
        """Sequences this session holds, waiting or running: its share of the engine."""
        return sum(self.live.values())


@dataclass(frozen=True, slots=True)
class Open:
    session: Session


@dataclass(frozen=True, slots=True)
class Add:
    session: Session
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None: a pooling request (``pooling`` set)
    priority: int = 0
    cache_salt: bytes = b""
    resume: Resume | None = None
    lora_name: str = ""
    pooling: PoolingParams | None = None

    @property
    def num_samples(self) -> int:
        return self.params.n if self.params is not None else 1


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn`` on the engine (between steps, on its thread); its result or exception goes
    to ``future`` (the adapters' load, unload and listing)."""

    fn: Callable[[Any], Any]
    future: Future[Any]


@dataclass(frozen=True, slots=True)
class Refuse:
    """A request the handler refused before it could be decoded; delivered in order with the
    engine's own refusals."""

    session: Session
    error: RequestError


@dataclass(frozen=True, slots=True)
class Abort:
    """Idempotent: the whole request, or only sample ``index`` of an n > 1 request."""

    session: Session
    request_id: str
    index: int | None = None


@dataclass(frozen=True, slots=True)
class HalfClose:
    """The gateway sends nothing more; the session ends once its requests have."""

    session: Session


@dataclass(frozen=True, slots=True)
class Close:
    """The stream is gone: abort everything it added."""

    session: Session


@dataclass(frozen=True, slots=True)
class Fail:
    """Something the engine depends on is gone (a tensor-parallel rank died): the engine
    thread raises ``error`` and stops, ending every session."""

    error: BaseException


Command = Open | Add | Call | Refuse | Abort | HalfClose | Close | Fail
