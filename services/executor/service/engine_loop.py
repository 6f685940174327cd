"""The engine's own thread: it owns the :class:`Engine` and is the only code that touches it.

gRPC handlers talk to it through a command inbox (:mod:`.commands`); commands are applied at
step boundaries, so an abort takes effect at the next step. After each step the outputs are
grouped per session (gateway stream): one delivery per step per session. The engine's load
is published as an immutable snapshot (:attr:`EngineLoop.load`) that any thread may read.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from typing import Any

import structlog

from services.executor.core.engine import Engine
from services.executor.core.outputs import EngineError, RequestError, RequestErrorCode, SeqOutput
from services.executor.core.sequence import FinishReason, RequestKey
from services.executor.service.commands import (
    Abort,
    Add,
    Call,
    Close,
    Command,
    Delivery,
    Fail,
    HalfClose,
    Load,
    Open,
    Refuse,
    Session,
)

log = structlog.get_logger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, *, max_seqs_per_session: int = 1024) -> None:
        """``max_seqs_per_session``: sequences (samples) one gateway session may hold at once;
        a request over it is refused RESOURCE_EXHAUSTED, so one gateway cannot starve the
        others."""
        self.engine = engine
        self.max_seqs_per_session = max_seqs_per_session
        self._inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # None: wake up
        self._sessions: dict[int, Session] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self.load: Load = self._snapshot()

    # ---- called from any thread ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stack(self) -> str:
        """Where the engine thread is now (for a log line when it seems stuck)."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def submit(self, command: Command) -> None:
        self._inbox.put(command)

    def fail(self, error: BaseException) -> None:
        """Stop the engine with ``error`` at its next step boundary (any thread)."""
        self._inbox.put(Fail(error))

    # ---- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_work)
                if self._stopping.is_set():
                    break
                if not self.engine.has_work:
                    self.engine.keepalive()
                    continue
                if self.engine.has_work:
                    outputs = self.engine.step()
                    self.load = self._snapshot()
                    self._dispatch(outputs)
                    if not self.engine.has_work:
                        self._broadcast_load()
        except BaseException as exc:  # the engine is broken: say so loudly, end every stream
            self.error = exc
            log.exception("engine_loop_crashed")
            for session in list(self._sessions.values()):
                session.deliver(None)

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        errors: dict[int, list[RequestError]] = {}
        while True:
            if command is not None:
                self._apply(command, errors)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        if errors:
            self.load = self._snapshot()
        # Refusals go out before a half-closed session is ended, never after.
        for session_id, errs in errors.items():
            session = self._sessions.get(session_id)
            if session is not None:
                session.deliver(Delivery(self.engine.num_steps, [], errs, self.load))
        for session in list(self._sessions.values()):
            self._maybe_finish(session)

    def _apply(self, command: Command, errors: dict[int, list[RequestError]]) -> None:
        match command:
            case Open(session):
                self._sessions[session.session_id] = session
            case Add(session, request_id, prompt, params, priority, cache_salt, resume, lora):
                n = command.num_samples
                try:
                    if session.num_seqs + n > self.max_seqs_per_session:
                        raise EngineError(
                            RequestErrorCode.RESOURCE_EXHAUSTED,
                            f"this session holds {session.num_seqs} sequences; n={n} "
                            f"more would pass --max-seqs-per-session="
                            f"{self.max_seqs_per_session}; retry later",
                        )
                    self.engine.add_request(
                        RequestKey(session.session_id, request_id),
                        prompt,
                        params,  # type: ignore[arg-type]  # (None: a pooling engine's)
                        priority=priority,
                        cache_salt=cache_salt,
                        resume=resume,
                        lora_name=lora,
                        pooling=command.pooling,
                    )
                except EngineError as exc:
                    errors.setdefault(session.session_id, []).append(
                        RequestError(request_id, exc.code, exc.message)
                    )
                    return
                session.live[request_id] = n
            case Call(fn, future):
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as exc:  # the caller's to report (an EngineError)
                        future.set_exception(exc)
            case Refuse(session, error):
                errors.setdefault(session.session_id, []).append(error)
            case Abort(session, request_id, index):
                self.engine.abort_request(RequestKey(session.session_id, request_id), index)
            case HalfClose(session):
                session.half_closed = True
            case Close(session):
                for request_id in session.live:
                    self.engine.abort_request(RequestKey(session.session_id, request_id))
                session.live.clear()
                self._sessions.pop(session.session_id, None)
                log.info("session_closed", session_id=session.session_id)
            case Fail(error):
                raise error

    def _dispatch(self, outputs: list[SeqOutput]) -> None:
        by_session: dict[int, list[SeqOutput]] = {}
        errors: dict[int, list[RequestError]] = {}
        for out in outputs:
            session = self._sessions.get(out.req_id.session_id)
            if session is None:
                continue  # its session was closed: the request is being aborted
            if out.finish_reason is FinishReason.ERROR:
                # The executor could not serve it: the whole request fails with INTERNAL, its
                # other samples are stopped, and nothing else is disturbed.
                errors.setdefault(session.session_id, []).append(
                    RequestError(
                        out.req_id.request_id,
                        RequestErrorCode.INTERNAL,
                        "the executor could not serve this request (its KV blocks could not be "
                        "trusted); retry it",
                    )
                )
                self.engine.abort_request(out.req_id)
                continue
            by_session.setdefault(session.session_id, []).append(out)
        # Forget finished requests only after routing every output of this step: the samples
        # of an n > 1 request often finish together.
        for out in outputs:
            if out.finish_reason is not None and out.req_id not in self.engine.requests:
                session = self._sessions.get(out.req_id.session_id)
                if session is not None:
                    session.live.pop(out.req_id.request_id, None)
        for session_id in by_session.keys() | errors.keys():
            session = self._sessions[session_id]
            outs, errs = by_session.get(session_id, []), errors.get(session_id, [])
            session.deliver(Delivery(self.engine.num_steps, outs, errs, self.load))
            self._maybe_finish(session)

    def _broadcast_load(self) -> None:
        """The engine went idle: every session learns the final load (the step that freed the
        last blocks produced no output, so no delivery carried it)."""
        if self.engine.spec is not None and self.engine.spec.stats.num_drafts:
            stats = self.engine.spec.stats
            log.info(
                "speculative_decoding",
                mean_acceptance_length=round(stats.mean_acceptance_length, 3),
                num_drafts=stats.num_drafts,
                num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                accepted_per_pos=stats.accepted_per_pos,
            )
        for session in list(self._sessions.values()):
            session.deliver(Delivery(self.engine.num_steps, [], [], self.load))

    def _maybe_finish(self, session: Session) -> None:
        if session.half_closed and not session.live:
            self._sessions.pop(session.session_id, None)
            session.deliver(None)

    def _snapshot(self) -> Load:
        e = self.engine
        s = e.scheduler
        return Load(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(s.swapped),
            num_free_blocks=s.num_free_blocks,
            num_usable_blocks=s.num_usable_blocks,
            num_preemptions=s.num_preemptions,
            num_prompt_tokens=e.num_prompt_tokens,
            num_generation_tokens=e.num_generation_tokens,
            num_cached_prompt_tokens=e.num_cached_prompt_tokens,
            num_steps=e.num_steps,
            num_blockmgr_round_trips=e.link.num_round_trips,
            num_running_tokens=sum(seq.num_tokens for seq in s.running),
            num_waiting_tokens=sum(seq.num_tokens for seq in s.waiting),
            num_steps_ahead=e.num_steps_ahead,
            num_offloaded_blocks=e.num_blocks_moved["offload"],
            num_onboarded_blocks=e.num_blocks_moved["onboard"],
            num_spilled_blocks=e.num_blocks_moved["spill"],
            num_loaded_blocks=e.num_blocks_moved["load"],
            num_stored_blocks=e.num_blocks_moved["store"],
            num_failed_moves=e.num_failed_moves,
            **_spec_load(e),
            **_lora_load(e),
        )


def _lora_load(engine: Engine) -> dict[str, Any]:
    """The adapters of the running and waiting sequences (none without LoRA)."""
    registry = engine.adapters
    if not registry.enabled:
        return {}
    s = engine.scheduler

    def names(seqs: Any) -> tuple[str, ...]:
        ids = {seq.lora_id for seq in seqs if seq.lora_id}
        return tuple(sorted({registry.versions[i].name for i in ids if i in registry.versions}))

    return {
        "running_lora_adapters": names(s.running),
        "waiting_lora_adapters": names([*s.waiting, *s.swapped]),
        "max_loras": registry.max_loras,
    }


def _spec_load(engine: Engine) -> dict[str, Any]:
    """The speculative-decoding counters of the load (none without speculation)."""
    if engine.spec is None:
        return {}
    stats = engine.spec.stats
    return {
        "num_spec_drafts": stats.num_drafts,
        "num_spec_draft_tokens": stats.num_draft_tokens,
        "num_spec_accepted_tokens": stats.num_accepted_tokens,
        "spec_accepted_per_pos": tuple(stats.accepted_per_pos),
    }
