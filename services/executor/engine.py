"""The engine: one iteration = plan, one block-manager Step, copy-on-write, one forward,
sample, emit. Single-threaded by contract (the :mod:`.engine_loop` thread drives it).

Block-manager failures are survived here: an unreachable block manager is retried with
backoff while the engine reports itself unhealthy (nothing is admitted meanwhile); a block
manager that lost our pool (restart) or disagrees with us gets a fresh registration and the
pre-step state of every live sequence restored, then the same step is sent again. No token
is lost either way.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import torch
from torch import Tensor

from services.blockmgr.client import BlockManagerClient
from services.blockmgr.errors import BlockManagerError, ErrorCode
from services.blockmgr.types import PoolCounters, PoolInfo, StepResult
from services.executor.forward_batch import SeqChunk
from services.executor.sampler import Sampler, SamplingRow
from services.executor.sampling_params import SamplingParams
from services.executor.scheduler import SchedulePlan, Scheduler, SchedulerConfig
from services.executor.sequence import FinishReason, Request, SeqStatus
from services.executor.sequence import Sequence as Seq

log = structlog.get_logger(__name__)

MAX_REQUEST_KEY_LEN = 512  # the engine's request keys ("<session>:<request_id>")
MAX_CONSECUTIVE_RESYNCS = 8
_GOLDEN = 0x9E3779B97F4A7C15


class Runner(Protocol):
    """What the engine needs from a model runner (``ModelRunner``, or a fake in tests)."""

    device: torch.device
    num_blocks: int

    def execute(self, chunks: Sequence[SeqChunk]) -> Tensor: ...
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...


class EngineError(Exception):
    """A request refused at the executor's edge; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
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


@dataclass(slots=True)
class SeqOutput:
    """New tokens of one sample of one request in one step (and its end, if it ended)."""

    req_id: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class EngineSettings:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    scheduler: SchedulerConfig
    pool_id: str
    eviction_policy: str = "lru"
    seed: int = 0
    blockmgr_retry_s: float = 0.05
    blockmgr_max_backoff_s: float = 2.0


class Engine:
    def __init__(
        self,
        settings: EngineSettings,
        runner: Runner,
        blockmgr: BlockManagerClient,
        *,
        on_health: Callable[[bool], None] | None = None,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.blockmgr = blockmgr
        self.on_health = on_health or (lambda healthy: None)
        self.healthy = True
        self.sampler = Sampler(runner.device, settings.seed)
        self._eos = frozenset(settings.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._child_generators: dict[tuple[int, int], torch.Generator] = {}
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._pending: list[SeqOutput] = []
        # statistics
        self.num_steps = 0
        self.num_blockmgr_round_trips = 0
        self.num_blockmgr_recoveries = 0
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputation included)
        self.num_generation_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.last_step_host_s = 0.0
        self.last_step_forward_s = 0.0
        cfg = settings.scheduler
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < settings.max_model_len:
            # A preempted sequence comes back with prompt + output tokens, up to max_model_len,
            # and without chunking it must fit one step's budget.
            raise ValueError(
                "with chunked prefill disabled, max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) must be >= max_model_len "
                f"({settings.max_model_len})"
            )
        self.pool = self._register_with_retry()
        self.scheduler = Scheduler(settings.scheduler, self._initial_counters())

    # ---- requests -------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: bytes = b"",
    ) -> None:
        """Queue a request; raises :class:`EngineError` (nothing queued) if it is invalid."""
        s = self.settings
        if not req_id or len(req_id) > MAX_REQUEST_KEY_LEN:
            raise EngineError("INVALID_ARGUMENT", f"request_id must be 1..{MAX_REQUEST_KEY_LEN} "
                              "characters")  # fmt: skip
        if req_id in self.requests:
            raise EngineError("ALREADY_EXISTS", f"request_id {req_id!r} is already running")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise EngineError("INVALID_ARGUMENT", "prompt_token_ids must not be empty")
        if len(prompt) >= s.max_model_len:
            raise EngineError(
                "INVALID_ARGUMENT",
                f"prompt_token_ids: {len(prompt)} tokens leave no room to generate within "
                f"max_model_len={s.max_model_len}",
            )
        bad = next((t for t in prompt if not 0 <= t < s.vocab_size), None)
        if bad is not None:
            raise EngineError(
                "INVALID_ARGUMENT",
                f"prompt_token_ids: {bad} is outside the vocabulary [0, {s.vocab_size})",
            )
        cfg = s.scheduler
        if not cfg.enable_chunked_prefill and len(prompt) > cfg.max_num_batched_tokens:
            raise EngineError(
                "INVALID_ARGUMENT",
                f"prompt_token_ids: {len(prompt)} tokens exceed max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} with chunked prefill disabled",
            )
        try:
            params.validate(s.vocab_size)
        except ValueError as exc:
            raise EngineError("INVALID_ARGUMENT", f"sampling_params.{exc}") from None
        arrival = next(self._arrivals)
        seq = Seq(
            seq_id=next(self._seq_ids), req_id=req_id, index=0, token_ids=prompt,
            prompt_len=len(prompt), params=params, priority=priority, arrival=arrival,
            cache_salt=cache_salt,
        )  # fmt: skip
        self.requests[req_id] = Request(req_id, prompt, params, priority, arrival, [seq],
                                        cache_salt)  # fmt: skip
        self._make_generator(seq)
        self.scheduler.add(seq)

    def abort_request(self, req_id: str, index: int | None = None) -> bool:
        """Abort at this step boundary (idempotent): the whole request, or only sample
        ``index``. Every sample not finished yet gets a final ``ABORT`` output; blocks are
        freed by the next Step. A sample of an n > 1 request that does not exist yet (its
        prompt is still being prefilled) is aborted as soon as it is forked. False if nothing
        was running under that id / index."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        if index is not None and req.params.n == 1:
            index = None
        if index is not None:
            seq = next((s for s in req.seqs if s.index == index), None)
            if seq is None or len(req.seqs) < req.params.n:
                # Not forked yet (the parent, index 0, still prefills for every sample):
                # applied when the samples are created.
                if not 0 <= index < req.params.n or index in req.pending_aborts:
                    return False
                req.pending_aborts.add(index)
                return True
            if seq.status is SeqStatus.FINISHED:
                return False
            self._abort_seq(seq)
            if req.finished:
                del self.requests[req_id]
            return True
        live = [s for s in req.seqs if s.status is not SeqStatus.FINISHED]
        for seq in live:
            self._abort_seq(seq)
        # Samples of an n > 1 request that were never forked end here too.
        known = {s.index for s in req.seqs}
        for missing in sorted(set(range(req.params.n)) - known):
            self._pending.append(SeqOutput(
                req_id, missing, finish_reason=FinishReason.ABORT,
                usage=Usage(len(req.prompt_token_ids), 0, 0),
            ))  # fmt: skip
        del self.requests[req_id]
        return bool(live) or len(known) < req.params.n

    def _abort_seq(self, seq: Seq) -> None:
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._generators.pop(seq.seq_id, None)
        self._pending.append(SeqOutput(seq.req_id, seq.index, finish_reason=FinishReason.ABORT,
                                       usage=self._usage(seq)))  # fmt: skip

    # ---- the iteration --------------------------------------------------------------------

    def step(self) -> list[SeqOutput]:
        """One scheduler iteration; returns the outputs of this step (possibly empty)."""
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_work:
            return outputs
        t0 = time.perf_counter()
        plan = self.scheduler.plan()
        result = self._send(plan)
        step = self.scheduler.apply(plan, result)
        if step.copies:
            self.runner.copy_blocks(step.copies)
        chunks = step.chunks
        need = [c.completes_known_tokens for c in chunks]
        t1 = time.perf_counter()
        logits = None
        if chunks:
            seq_chunks = []
            for c, n in zip(chunks, need, strict=True):
                seq, start = c.seq, c.seq.num_computed_tokens
                end = start + c.num_new_tokens
                seq_chunks.append(SeqChunk(seq.token_ids[start:end], start, seq.block_table, n))
                if start < seq.prompt_len:
                    self.num_prompt_tokens += min(end, seq.prompt_len) - start
            logits = self.runner.execute(seq_chunks)
        t2 = time.perf_counter()
        self.scheduler.after_forward(chunks)
        sampled = [c.seq for c, n in zip(chunks, need, strict=True) if n]
        if sampled:
            assert logits is not None
            outputs.extend(self._sample_and_update(logits, sampled))
        self.num_steps += 1
        self.last_step_forward_s = t2 - t1
        self.last_step_host_s = (time.perf_counter() - t0) - self.last_step_forward_s
        return outputs

    def _sample_and_update(self, logits: Tensor, seqs: list[Seq]) -> list[SeqOutput]:
        rows: list[SamplingRow] = []
        row_logits: list[int] = []
        targets: list[tuple[Seq, int | None]] = []  # (seq, child index to create or None)
        for i, seq in enumerate(seqs):
            req = self.requests.get(seq.req_id)
            fork = req is not None and req.params.n > 1 and len(req.seqs) == 1
            for child in range(1, req.params.n) if fork and req is not None else ():
                rows.append(self._row(seq, self._child_generator(seq, child)))
                row_logits.append(i)
                targets.append((seq, child))
            rows.append(self._row(seq, self._generators.get(seq.seq_id)))
            row_logits.append(i)
            targets.append((seq, None))
        if len(row_logits) != len(seqs):
            logits = logits[torch.tensor(row_logits, device=logits.device)]
        result = self.sampler(logits, rows)

        emitted: list[tuple[Seq, SeqOutput]] = []
        children: dict[int, list[Seq]] = {}
        for (seq, child_index), token, lp in zip(targets, result.token_ids, result.logprobs,
                                                  strict=True):  # fmt: skip
            if child_index is not None:
                target = self._spawn_child(seq, child_index, token)
                children.setdefault(seq.seq_id, []).append(target)
            else:
                target = seq
                seq.token_ids.append(token)
            emitted.append((target, self._emit(target, token, lp)))
        for seq in seqs:  # children join after their parent's first token is in place
            for child in children.get(seq.seq_id, ()):
                self.scheduler.fork(seq, child)
                self.requests[seq.req_id].seqs.append(child)
        for target, out in emitted:
            req = self.requests.get(target.req_id)
            if req is not None and target.index in req.pending_aborts:
                req.pending_aborts.discard(target.index)  # aborted before it existed
                self.scheduler.finish(target, FinishReason.ABORT)
                self._generators.pop(target.seq_id, None)
                out.finish_reason, out.usage = FinishReason.ABORT, self._usage(target)
                if req.finished:
                    del self.requests[target.req_id]
                continue
            self._check_finish(target, out)
        return [out for _, out in emitted]

    def _spawn_child(self, parent: Seq, index: int, token: int) -> Seq:
        child = Seq(
            seq_id=next(self._seq_ids), req_id=parent.req_id, index=index,
            token_ids=[*parent.token_ids[: parent.prompt_len], token],
            prompt_len=parent.prompt_len, params=parent.params, priority=parent.priority,
            arrival=parent.arrival, cache_salt=parent.cache_salt,
        )  # fmt: skip
        gen = self._child_generators.pop((parent.seq_id, index), None)
        if gen is not None:
            self._generators[child.seq_id] = gen
        return child

    def _emit(self, seq: Seq, token: int, lp: tuple | None) -> SeqOutput:
        self.num_generation_tokens += 1
        out = SeqOutput(seq.req_id, seq.index, [token])
        if seq.num_output_tokens == 1:  # the first token also reports the prompt's cache hits
            out.usage = self._usage(seq)
        if lp is not None:
            chosen, top = lp
            out.logprobs.append(TokenLogprob(token, chosen, tuple(top)))
        return out

    def _check_finish(self, seq: Seq, out: SeqOutput) -> None:
        p = seq.params
        token = seq.token_ids[-1]
        reason: FinishReason | None = None
        stop_token: int | None = None
        if seq.num_output_tokens >= p.min_tokens and (
            (not p.ignore_eos and token in self._eos) or token in p.stop_token_ids
        ):
            reason, stop_token = FinishReason.STOP, token
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.settings.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return
        self.scheduler.finish(seq, reason, stop_token)
        self._generators.pop(seq.seq_id, None)
        out.finish_reason, out.stop_token_id, out.usage = reason, stop_token, self._usage(seq)
        req = self.requests.get(seq.req_id)
        if req is not None and req.finished:
            del self.requests[seq.req_id]
            self.num_cached_prompt_tokens += req.seqs[0].num_cached_tokens

    def _row(self, seq: Seq, generator: torch.Generator | None) -> SamplingRow:
        p = seq.params
        penalties = (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)
        n_out = seq.num_output_tokens
        banned: tuple[int, ...] = ()
        if n_out < p.min_tokens:
            banned = (*(() if p.ignore_eos else self.settings.eos_token_ids), *p.stop_token_ids)
        return SamplingRow(
            params=p,
            prompt_token_ids=seq.token_ids[: seq.prompt_len] if penalties else [],
            output_token_ids=seq.token_ids[seq.prompt_len :] if penalties else [],
            generator=generator,
            banned_token_ids=banned,
        )

    # ---- randomness -----------------------------------------------------------------------

    def _make_generator(self, seq: Seq) -> None:
        if seq.params.seed is not None:
            self._generators[seq.seq_id] = self._seeded(seq.params.seed, seq.index)

    def _seeded(self, seed: int, index: int) -> torch.Generator:
        g = torch.Generator(device=self.runner.device)
        g.manual_seed((seed + index * _GOLDEN) % 2**63)
        return g

    def _child_generator(self, parent: Seq, index: int) -> torch.Generator | None:
        """The generator of sample ``index``, made when its first token is drawn."""
        if parent.params.seed is None:
            return None
        g = self._seeded(parent.params.seed, index)
        self._child_generators[(parent.seq_id, index)] = g
        return g

    # ---- block manager --------------------------------------------------------------------

    def _send(self, plan: SchedulePlan) -> StepResult:
        """One Step round trip, surviving block-manager outages and restarts.

        After a failed call the outcome is unknown (the Step may have been applied and only
        the answer lost), so it is never simply resent: once the block manager answers again
        the pool is re-registered and restored to its state before ``plan``, then ``plan`` is
        sent. The cached free blocks may be lost that way, never a live sequence."""
        backoff = self.settings.blockmgr_retry_s
        needs_resync = False
        resyncs = 0
        while True:
            try:
                if needs_resync:
                    self._resync(plan)
                    needs_resync = False
                self.num_blockmgr_round_trips += 1
                result = self.blockmgr.step(self.settings.pool_id, self.pool.epoch, plan.ops)
            except BlockManagerError as exc:
                if exc.code is ErrorCode.UNAVAILABLE:
                    self._set_health(False)
                    log.warning("blockmgr_unavailable", error=exc.message, retry_in_s=backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, self.settings.blockmgr_max_backoff_s)
                    needs_resync = True
                    continue
                if exc.code in (ErrorCode.NOT_FOUND, ErrorCode.FAILED_PRECONDITION) and (
                    resyncs < MAX_CONSECUTIVE_RESYNCS
                ):
                    log.warning("blockmgr_diverged", error=exc.message)
                    resyncs += 1
                    needs_resync = True
                    continue
                raise
            self._set_health(True)
            return result

    def _resync(self, plan: SchedulePlan) -> None:
        """Register again and restore every live sequence as it was before ``plan``."""
        self.pool = self._register_with_retry()
        state = self.scheduler.pre_plan_state(plan)
        self.blockmgr.restore(self.settings.pool_id, self.pool.epoch, state)
        self.num_blockmgr_recoveries += 1
        log.info("blockmgr_restored", epoch=self.pool.epoch, num_sequences=len(state))

    def _register_with_retry(self) -> PoolInfo:
        s = self.settings
        backoff = s.blockmgr_retry_s
        while True:
            try:
                info = self.blockmgr.register(
                    s.pool_id,
                    self.runner.num_blocks,
                    s.scheduler.block_size,
                    enable_prefix_caching=s.scheduler.enable_prefix_caching,
                    eviction_policy=s.eviction_policy,
                )
                self._set_health(True)
                return info
            except BlockManagerError as exc:
                if exc.code is not ErrorCode.UNAVAILABLE:
                    raise
                self._set_health(False)
                log.warning("blockmgr_unavailable", error=exc.message, retry_in_s=backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, s.blockmgr_max_backoff_s)

    def _initial_counters(self) -> PoolCounters:
        return self.blockmgr.stats(self.settings.pool_id).counters

    def _set_health(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.on_health(healthy)

    # ---- helpers --------------------------------------------------------------------------

    @staticmethod
    def _usage(seq: Seq) -> Usage:
        return Usage(seq.prompt_len, seq.num_output_tokens, seq.num_cached_tokens)
