"""The engine's own thread: it owns the :class:`Engine` and is the only code that touches it.

gRPC handlers talk to it through a command inbox (add, abort, close a session); commands are
applied at step boundaries, so an abort takes effect at the next step. After each step the
outputs are grouped per session (gateway stream): one delivery per step per session.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from services.executor.engine import Engine, EngineError, SeqOutput
from services.executor.sampling_params import SamplingParams

log = structlog.get_logger(__name__)

_session_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Load:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_usable_blocks: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_prompt_tokens: int
    num_steps: int
    num_blockmgr_round_trips: int


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one session receives after one step (or right away, for refused requests)."""

    step: int
    outputs: list[SeqOutput]
    errors: list[tuple[str, str, str]]  # (request_id, status name, message)
    load: Load


@dataclass(eq=False)
class Session:
    """One gateway stream. ``deliver`` is called from the engine thread and must only
    enqueue; ``None`` means the stream is done (half-closed and nothing left running)."""

    deliver: Callable[[Delivery | None], None]
    session_id: int = field(default_factory=lambda: next(_session_ids))
    live: set[str] = field(default_factory=set)  # request ids (the session's own)
    half_closed: bool = False

    def key(self, request_id: str) -> str:
        return f"{self.session_id}:{request_id}"


@dataclass(frozen=True, slots=True)
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: bytes = b""


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._sessions: dict[int, Session] = {}
        self._owner: dict[str, Session] = {}  # engine request key -> session
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    # ---- called from any thread ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def open(self, session: Session) -> None:
        self._inbox.put(("open", session))

    def add(self, session: Session, command: AddCommand) -> None:
        self._inbox.put(("add", session, command))

    def abort(self, session: Session, request_id: str, index: int | None = None) -> None:
        self._inbox.put(("abort", session, request_id, index))

    def half_close(self, session: Session) -> None:
        self._inbox.put(("half_close", session))

    def close(self, session: Session) -> None:
        """The stream is gone: abort everything it added."""
        self._inbox.put(("close", session))

    # ---- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                block = not self.engine.has_work
                self._drain(block)
                if self._stopping.is_set():
                    break
                if self.engine.has_work:
                    self._dispatch(self.engine.step())
        except BaseException as exc:  # the engine is broken: say so loudly, end every stream
            self.error = exc
            log.exception("engine_loop_crashed")
            for session in list(self._sessions.values()):
                session.deliver(None)

    def _drain(self, block: bool) -> None:
        errors: dict[int, list[tuple[str, str, str]]] = {}
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(item, errors)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        # Refusals go out before a half-closed session is ended, never after.
        for session_id, errs in errors.items():
            session = self._sessions.get(session_id)
            if session is not None:
                session.deliver(Delivery(self.engine.num_steps, [], errs, self.load()))
        for session in list(self._sessions.values()):
            self._maybe_finish(session)

    def _apply(self, item: tuple, errors: dict[int, list[tuple[str, str, str]]]) -> None:
        kind = item[0]
        if kind == "open":
            session = item[1]
            self._sessions[session.session_id] = session
        elif kind == "add":
            session, cmd = item[1], item[2]
            key = session.key(cmd.request_id)
            if cmd.request_id in session.live:
                message = f"request_id {cmd.request_id!r} is already running"
                errors.setdefault(session.session_id, []).append(
                    (cmd.request_id, "ALREADY_EXISTS", message)
                )
                return
            try:
                self.engine.add_request(
                    key, cmd.prompt_token_ids, cmd.params,
                    priority=cmd.priority, cache_salt=cmd.cache_salt,
                )
            except EngineError as exc:
                errors.setdefault(session.session_id, []).append(
                    (cmd.request_id, exc.code, exc.message)
                )
                return
            session.live.add(cmd.request_id)
            self._owner[key] = session
        elif kind == "abort":
            session, request_id, index = item[1], item[2], item[3]
            self.engine.abort_request(session.key(request_id), index)
        elif kind == "half_close":
            item[1].half_closed = True
        elif kind == "close":
            session = item[1]
            for request_id in list(session.live):
                self.engine.abort_request(session.key(request_id))
                self._owner.pop(session.key(request_id), None)
            session.live.clear()
            self._sessions.pop(session.session_id, None)
            log.info("session_closed", session_id=session.session_id)

    def _dispatch(self, outputs: list[SeqOutput]) -> None:
        by_session: dict[int, list[SeqOutput]] = {}
        ended: list[tuple[Session, str]] = []
        for out in outputs:
            session = self._owner.get(out.req_id)
            if session is None:
                continue  # its session was closed: the request is being aborted
            key = out.req_id
            out.req_id = key.split(":", 1)[1]
            by_session.setdefault(session.session_id, []).append(out)
            if out.finish_reason is not None and key not in self.engine.requests:
                ended.append((session, key))
        # Forget finished requests only after routing every output of this step: the samples
        # of an n > 1 request often finish together.
        for session, key in ended:
            session.live.discard(key.split(":", 1)[1])
            self._owner.pop(key, None)
        if not by_session:
            return
        load = self.load()
        for session_id, outs in by_session.items():
            session = self._sessions.get(session_id)
            if session is not None:
                session.deliver(Delivery(self.engine.num_steps, outs, [], load))
                self._maybe_finish(session)

    def _maybe_finish(self, session: Session) -> None:
        if session.half_closed and not session.live:
            self._sessions.pop(session.session_id, None)
            session.deliver(None)

    def load(self) -> Load:
        e = self.engine
        s = e.scheduler
        return Load(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_free_blocks=s.num_free_blocks,
            num_usable_blocks=s.num_usable_blocks,
            num_preemptions=s.num_preemptions,
            num_prompt_tokens=e.num_prompt_tokens,
            num_generation_tokens=e.num_generation_tokens,
            num_cached_prompt_tokens=e.num_cached_prompt_tokens,
            num_steps=e.num_steps,
            num_blockmgr_round_trips=e.num_blockmgr_round_trips,
        )
