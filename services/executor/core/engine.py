"""The engine: one iteration = plan, one block-manager Step, copy-on-write, one forward,
sample, emit. Single-threaded by contract (the :mod:`.engine_loop` thread drives it).

The block manager is reached through a :class:`~.blockmgr_link.BlockManagerLink`, which
survives outages and restarts; the engine only plans, computes and samples.

With ``async_scheduling``, a step plans the next one before its forward (as if every
sequence had the token it samples now, and the most drafts it may verify) and sends that
Step without waiting, so the block-manager round trip overlaps the forward; the answer is
applied after the forward, before sampling (see :meth:`Scheduler.plan_ahead`). Samples
about to fork, copy-on-write, beams and preemption always plan after sampling.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace

import structlog
import torch
from torch import Tensor

from services.common.sampling_params import SamplingParams
from services.executor.core.beam import BeamState
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.config import EngineSettings
from services.executor.core.engine_ahead import AheadEngine, PreparedBatch
from services.executor.core.engine_beams import BeamSearchEngine
from services.executor.core.grammar import GrammarCompiler, accept, request_matcher
from services.executor.core.lora import NO_ADAPTERS, LoRARegistry
from services.executor.core.outputs import (
    EngineError,
    RequestErrorCode,
    SeqOutput,
    TokenLogprob,
    Usage,
)
from services.executor.core.plan import MOVE_KINDS
from services.executor.core.pooling import PoolingParams, wrong_runner
from services.executor.core.prompt_logprobs import take_prompt_logprobs
from services.executor.core.runner import PreparingRunner, Runner, seq_chunks
from services.executor.core.sampler import Sampler, SampleResult, SeededGenerators, sampling_rows
from services.executor.core.scheduler import (
    BadAnswer,
    ScheduledBatch,
    SchedulePlan,
    Scheduler,
)
from services.executor.core.sequence import FinishReason, Request, RequestKey, Resume, SeqStatus
from services.executor.core.sequence import Sequence as Seq
from services.executor.core.spec.decoding import Speculation

log = structlog.get_logger(__name__)

MAX_BAD_ANSWERS = 2  # a sequence concerned by this many rejected answers fails


class Engine(AheadEngine, BeamSearchEngine):
    def __init__(
        self,
        settings: EngineSettings,
        runner: Runner,
        link: BlockManagerLink,
        grammars: GrammarCompiler | None = None,
        adapters: LoRARegistry | None = None,
    ) -> None:
        self.settings = settings
        self.grammars = grammars  # None: structured outputs are refused (no tokenizer)
        self.adapters = adapters or NO_ADAPTERS  # multi-LoRA serving (core.lora)
        self.runner = runner
        self.link = link
        self.sampler = Sampler(runner.device, settings.seed)
        self.generators = SeededGenerators(runner.device)
        self._eos = frozenset(settings.eos_token_ids)
        self.requests: dict[RequestKey, Request] = {}
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._pending: list[SeqOutput] = []
        # statistics
        self.num_steps = 0
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputation included)
        self.num_generation_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_bad_answers = 0  # block-manager answers rejected
        self.last_step_host_s = 0.0
        self.last_step_forward_s = 0.0
        self.num_steps_ahead = 0  # steps whose Step was sent during the previous forward
        self.num_ahead_failures = 0  # Steps sent ahead that failed or were answered wrongly
        self.num_batches_prepared = 0  # host batches built while the step before ran
        # A runner whose fills run beside the forward: chunks reading their blocks wait.
        self._fills_async: bool = getattr(runner, "fills_async", False)
        self._disk_moves = hasattr(runner, "take_failed_moves")  # moves that may fail
        self.num_failed_moves = 0
        self.num_blocks_moved = dict.fromkeys(MOVE_KINDS, 0)  # the tiers' moves, by kind
        # Speculative decoding: drafts verified by the forward (see core.spec).
        self.spec = Speculation.of(settings, self.sampler, self.generators, grammars, runner)
        scheduler_config = replace(
            settings.scheduler,
            defer_filled_chunks=self._fills_async,
            **(self.spec.scheduler_settings() if self.spec is not None else {}),
        )
        self.scheduler = Scheduler(scheduler_config, link.counters())
        self._batch_ahead: ScheduledBatch | None = None  # the next step's, already granted
        self._num_prompt_logprobs = 0  # live requests asking for prompt log-probabilities
        self._num_beam_requests = 0  # live beam searches (no planning ahead while any runs)
        self._num_structured = 0  # live requests under a grammar (masks are looked for then)
        self._prepared: PreparedBatch | None = None  # and its host batch, when the runner can
        # (checked once: an isinstance costs 15 us; not speculating: drafts come after it)
        preparing = (
            settings.async_scheduling and self.spec is None and isinstance(runner, PreparingRunner)
        )
        self._preparing: PreparingRunner | None = runner if preparing else None  # type: ignore[assignment]
        self._launch_returns_early: bool = getattr(
            runner, "launch_returns_early", runner.device.type == "cuda"
        )

    # ---- requests -------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work

    def add_request(
        self,
        req_id: RequestKey,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: bytes = b"",
        resume: Resume | None = None,
        lora_name: str = "",
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request; raises :class:`EngineError` (nothing queued) if it is refused.
        ``resume``: carry on a sample from its earlier output tokens (see :class:`Resume`);
        ``lora_name``: the adapter it runs with (empty: the base model; core.lora);
        ``pooling``: refused here (a :class:`~.engine_pooling.PoolingEngine` serves it)."""
        if pooling is not None:
            raise wrong_runner("generate", "pooling")
        if req_id in self.requests:
            raise EngineError(
                RequestErrorCode.ALREADY_EXISTS,
                f"request_id {req_id.request_id!r} is already running",
            )
        prompt = list(prompt_token_ids)
        self.settings.check_request(req_id.request_id, prompt, params, resume)
        outputs = list(resume.output_token_ids) if resume is not None else []
        if params.use_beam_search:
            self._check_beams_fit(len(prompt), params)
        matcher = request_matcher(self.grammars, params, outputs)
        lora_id, cache_salt = self.adapters.bind(lora_name, cache_salt)  # (last to refuse)
        arrival = next(self._arrivals)
        seq = Seq(
            seq_id=next(self._seq_ids),
            req_id=req_id,
            index=0,
            token_ids=prompt + outputs,
            prompt_len=len(prompt),
            params=params,
            priority=priority,
            arrival=arrival,
            cache_salt=cache_salt,
            matcher=matcher,
            lora_id=lora_id,
        )
        self.requests[req_id] = Request(
            req_id, prompt, params, priority, arrival, [seq], cache_salt, lora_id=lora_id
        )
        if not params.use_beam_search:  # (beams draw nothing)
            self.generators.create(seq.seq_id, params.seed, resume.sample_index if resume else 0)
        self.scheduler.add(seq)
        self._num_prompt_logprobs += params.prompt_logprobs is not None
        if params.use_beam_search:
            room = self.settings.max_model_len - len(prompt)  # (transformers' max_length)
            self.requests[req_id].beam = BeamState(
                params.n, params.length_penalty, params.early_stopping, min(params.max_tokens, room)
            )
            self._num_beam_requests += 1
        self._num_structured += params.structured_outputs is not None

    def keepalive(self) -> None:
        """Called while idle: keeps the block-manager pool's lease."""
        self.link.keepalive(lambda: self.scheduler.pre_plan_state(None))

    def abort_request(self, req_id: RequestKey, index: int | None = None) -> bool:
        """Abort at this step boundary (idempotent): the whole request, or only sample
        ``index``. Every sample not finished yet gets a final ``ABORT`` output; blocks are
        freed by the next Step. A sample of an n > 1 request that does not exist yet (its
        prompt is still being prefilled) is aborted as soon as it is forked. False if nothing
        was running under that id / index."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        if index is not None and req.params.n > 1 and req.beam is None:  # (a beam: all)
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
            self._pending.append(self._retire(seq, FinishReason.ABORT))
            return True
        live = [s for s in req.seqs if s.status is not SeqStatus.FINISHED]
        for seq in live:
            self._pending.append(self._retire(seq, FinishReason.ABORT))
        # Samples of an n > 1 request that were never forked end here too.
        known = {s.index for s in req.seqs}
        for missing in sorted(set(range(req.params.n)) - known):
            self._pending.append(
                SeqOutput(
                    req_id,
                    missing,
                    finish_reason=FinishReason.ABORT,
                    usage=Usage(len(req.prompt_token_ids), 0, 0),
                )
            )
        if req_id in self.requests:
            self._forget(req)
        return bool(live) or len(known) < req.params.n

    def _retire(
        self,
        seq: Seq,
        reason: FinishReason,
        stop_token: int | None = None,
        out: SeqOutput | None = None,
    ) -> SeqOutput:
        """The one way a sample ends: the scheduler frees it, its generator goes, ``out`` (or a
        new output) carries the end, and a request whose samples all ended is forgotten."""
        self.scheduler.finish(seq, reason, stop_token)
        self.generators.drop(seq.seq_id)
        out = out or SeqOutput(seq.req_id, seq.index)
        out.finish_reason, out.stop_token_id, out.usage = reason, stop_token, Usage.of(seq)
        req = self.requests.get(seq.req_id)
        if req is not None and req.finished:
            self._forget(req)
        return out

    def _forget(self, req: Request) -> None:
        del self.requests[req.req_id]
        self.adapters.release(req.lora_id)
        self._num_prompt_logprobs -= req.params.prompt_logprobs is not None
        self._num_beam_requests -= req.params.use_beam_search
        self._num_structured -= req.params.structured_outputs is not None
        self.num_cached_prompt_tokens += req.seqs[0].num_cached_tokens

    # ---- the iteration --------------------------------------------------------------------

    def step(self) -> list[SeqOutput]:
        """One scheduler iteration; returns the outputs of this step (possibly empty)."""
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_work:
            return outputs
        t0 = time.perf_counter()
        batch, prepared = self._take_batch_ahead()
        if batch is None:
            self._take_failed_moves(wait=True)  # (a Step goes out: it reports them)
            plan = self.scheduler.plan()
            result = self.link.step(plan.ops(), lambda: self.scheduler.pre_plan_state(plan))
            try:
                batch = self.scheduler.apply(plan, result)
            except BadAnswer as exc:
                self._distrust(plan, exc)
                self.num_steps += 1
                return outputs + self._take_pending()
        if self._fills_async:  # the last Step's fills: this batch may read their blocks
            self.runner.wait_fills()  # type: ignore[attr-defined]
        if batch.has_moves:  # offloads read blocks a copy or the forward may overwrite
            self._move_blocks(batch)
        gone = self._take_failed_moves()
        if gone and any(c.seq.seq_id in gone for c in batch.chunks):  # (host batch rebuilt)
            chunks = [c for c in batch.chunks if c.seq.seq_id not in gone]
            batch, prepared = replace(batch, chunks=chunks), None
        if batch.copies:
            self.runner.copy_blocks(batch.copies)
        # Plan and send the next Step while the forward runs: after the launch where it
        # returns before the device is done (CUDA), else before it.
        launch_first = self._launch_returns_early
        ahead = None if launch_first else self._send_ahead(batch)
        t1 = time.perf_counter()
        rows: list[int] | None = None  # logits rows of ``sampled``, when not all rows are
        logits: Tensor | None
        try:
            if prepared is not None:
                logits, rows = self._launch(prepared)
            else:
                logits = self._forward(batch) if batch.chunks else None
        except BaseException:
            if ahead is not None:  # the Step sent ahead may be applied: never trust the pool
                self.scheduler.abandon(ahead[0])
                self.link.invalidate()
            raise
        t2 = time.perf_counter()
        if logits is not None:
            logits = self._take_prompt_rows(batch, logits)  # before after_forward
        if launch_first:
            ahead = self._send_ahead(batch)
        sampled = [c.seq for c in batch.chunks if c.need_logits]
        if self.spec is not None and logits is not None:
            logits = self.spec.verify(batch.chunks, logits)
        self.num_prompt_tokens += self.scheduler.after_forward(batch.chunks)
        if self.spec is not None:
            self.spec.accept()
        rejected = self._receive_ahead(*ahead) if ahead is not None else None
        next_batch = self._batch_ahead
        if self._preparing is not None and next_batch is not None and next_batch.chunks:
            self._prepared = self._prepare(next_batch)  # overlaps the device's forward
        if sampled:
            assert logits is not None
            try:
                outputs.extend(self._sample_and_update(logits, sampled, rows))
            except BaseException:
                self._prepared = None  # its placeholders would never be filled in
                raise
        if self._num_beam_requests:
            self._unsplit_beams()
        if self.spec is not None:
            self.spec.propose(sampled, len(self.scheduler.running))
        if rejected is not None:  # after sampling: it may retire sequences sampled above
            self._distrust(*rejected)
            outputs.extend(self._take_pending())
        self.num_steps += 1
        self.last_step_forward_s = t2 - t1
        self.last_step_host_s = (time.perf_counter() - t0) - self.last_step_forward_s
        return outputs

    def _take_prompt_rows(self, batch: ScheduledBatch, logits: Tensor) -> Tensor:
        """The rows to sample from, once the prompt log-probabilities asked for are taken
        (a batch planned ahead never computes such a prompt: plan_ahead refuses)."""
        return take_prompt_logprobs(batch, logits) if self._num_prompt_logprobs else logits

    def _distrust(self, plan: SchedulePlan, exc: BadAnswer) -> None:
        """The block manager answered something our plan contradicts: nothing of the answer
        is applied, the pool is rebuilt from our state before the next Step, and the step is
        planned again. A sequence concerned a second time fails (INTERNAL at the client);
        the others go on. Never a crash, never a token computed into a wrong block."""
        log.error("blockmgr_answer_rejected", error=str(exc))
        self.scheduler.abandon(plan)
        self.link.invalidate()
        self.num_bad_answers += 1
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.seq_id in exc.seq_ids:
                seq.num_bad_answers += 1
                if seq.num_bad_answers >= MAX_BAD_ANSWERS:
                    self._pending.append(self._retire(seq, FinishReason.ERROR))

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        """Make ``batch``'s tier moves, and count them."""
        self.runner.move_blocks(*batch.moves)
        for kind, moves in zip(MOVE_KINDS, batch.moves, strict=True):
            self.num_blocks_moved[kind] += len(moves)

    def _take_failed_moves(self, *, wait: bool = False) -> set[int]:
        """Take the disk moves that failed so far (``wait``: the fills in flight first):
        reported with the next Step, the sequences listing a block that was not filled
        preempted (recomputed) before anything reads it; returns their ids. Called before
        every forward, and before any Step goes out while fills run: the block manager hears
        of a failed fill before it could free, evict and offload that block's content."""
        if wait and self._fills_async:
            self.runner.wait_fills()  # type: ignore[attr-defined]
        failed = self.runner.take_failed_moves() if self._disk_moves else None  # type: ignore[attr-defined]
        if failed is None:
            return set()
        self.num_failed_moves += len(failed.device_blocks) + len(failed.disk_slots)
        return {s.seq_id for s in self.scheduler.moves_failed(*failed)}

    def _take_pending(self) -> list[SeqOutput]:
        pending, self._pending = self._pending, []
        return pending

    def _forward(self, batch: ScheduledBatch) -> Tensor:
        if self.spec is not None:
            self.spec.draft(batch.chunks)
        chunks, pending = seq_chunks(batch)
        assert not pending  # planned after sampling: every token is known
        return self.runner.execute(chunks)

    def _sample_and_update(
        self, logits: Tensor, seqs: list[Seq], rows: list[int] | None = None
    ) -> list[SeqOutput]:
        """Sample the next token of each of ``seqs`` (and the first token of the other
        samples of an n > 1 request whose prompt just finished), append it, emit it, and
        retire what finished. ``rows``: the logits row of each of ``seqs`` (default: in
        order)."""
        spec = self.spec if self.spec is not None and self.spec.verified else None
        if spec is not None:  # (sampled already: their rows are not in ``logits``)
            seqs = spec.unsampled(seqs)
        beam_outs: list[SeqOutput] = []
        if self._num_beam_requests:
            beam_outs, seqs, rows = self._take_beams(logits, seqs, rows)
            if not seqs and spec is None:
                return beam_outs
        params, states, targets, row_logits = sampling_rows(
            seqs, self._forks_now, self.generators, self.settings.eos_token_ids
        )
        if rows is not None:
            row_logits = rows if row_logits is None else [rows[r] for r in row_logits]
        if row_logits is not None:
            logits = logits[torch.tensor(row_logits, device=logits.device)]
        if self.grammars is not None and self._num_structured:
            masks = {r: seq.matcher for r, (seq, _) in enumerate(targets) if seq.matcher}
            if masks:  # (a fork's rows share its parent's matcher: all at the start)
                self.grammars.mask_logits(logits, masks)
        result = self.sampler(logits, params, states) if targets else SampleResult([], [])
        if spec is not None:
            spec.join(targets, result)
        outs: list[SeqOutput] = []
        emitted: list[Seq] = []  # settled after the loop when samples fork now
        children: dict[int, list[Seq]] = {}
        settle_now = row_logits is None  # nothing forks: settle each sample as it is emitted
        for (seq, child_index), token, lp in zip(
            targets, result.token_ids, result.logprobs, strict=True
        ):
            if child_index:
                parent, seq = seq, self._spawn_child(seq, child_index, token)
                children.setdefault(parent.seq_id, []).append(seq)
            else:
                seq.token_ids.append(token)
                if seq.matcher is not None:
                    accept(seq.matcher, token)
            out = SeqOutput(seq.req_id, seq.index, [token])
            if len(seq.token_ids) - seq.prompt_len == 1:  # the first token also reports
                out.usage = Usage.of(seq)  # the prompt's cache hits
                if seq.index == 0 and seq.prompt_logprobs:
                    out.prompt_logprobs = tuple(seq.prompt_logprobs)
            # (a verified sample's output: its accepted drafts, then ``token``)
            if (spec is None or not spec.fill(out, seq)) and lp is not None:
                out.logprobs = (TokenLogprob(token, lp[0], tuple(lp[1])),)
            outs.append(out)
            if settle_now:
                self._settle(seq, out)
            else:
                emitted.append(seq)
        self.num_generation_tokens += sum(len(o.token_ids) for o in outs)
        if children:
            self._join_children(seqs, children)
        if not settle_now:
            for seq, out in zip(emitted, outs, strict=True):
                self._settle(seq, out)
        return beam_outs + outs

    def _settle(self, seq: Seq, out: SeqOutput) -> None:
        """After ``seq``'s new token is in ``out``: retire it if it was aborted before it was
        forked, or if that token ends it."""
        if seq.params.n > 1:
            req = self.requests.get(seq.req_id)
            if req is not None and seq.index in req.pending_aborts:
                req.pending_aborts.discard(seq.index)  # aborted before it existed
                self._retire(seq, FinishReason.ABORT, out=out)
                return
        p, tokens = seq.params, seq.token_ids
        token, num_output = tokens[-1], len(tokens) - seq.prompt_len
        if (
            (token in self._eos and not p.ignore_eos) or token in p.stop_token_ids
        ) and num_output >= p.min_tokens:
            self._retire(seq, FinishReason.STOP, token, out)
        elif seq.matcher is not None and seq.matcher.done:  # the output is complete
            self._retire(seq, FinishReason.STOP, token if token in self._eos else None, out)
        elif num_output >= p.max_tokens or len(tokens) >= self.settings.max_model_len:
            self._retire(seq, FinishReason.LENGTH, out=out)

    def _forks_now(self, seq: Seq) -> bool:
        """Whether ``seq`` is the parent of an n > 1 request whose other samples do not exist
        yet: they draw their first token from its logits in this step."""
        req = self.requests.get(seq.req_id)
        return req is not None and len(req.seqs) == 1

    def _join_children(self, seqs: list[Seq], children: dict[int, list[Seq]]) -> None:
        for seq in seqs:  # children join after their parent's first token is in place
            for child in children.get(seq.seq_id, ()):
                self.scheduler.fork(seq, child)
                self.requests[seq.req_id].seqs.append(child)

    def _spawn_child(self, parent: Seq, index: int, token: int) -> Seq:
        child = Seq(
            seq_id=next(self._seq_ids),
            req_id=parent.req_id,
            index=index,
            token_ids=[*parent.token_ids[: parent.prompt_len], token],
            prompt_len=parent.prompt_len,
            params=parent.params,
            priority=parent.priority,
            arrival=parent.arrival,
            cache_salt=parent.cache_salt,
            lora_id=parent.lora_id,
            num_draft_computed=parent.num_draft_computed,  # (their blocks are shared)
        )
        if parent.matcher is not None:
            child.matcher = parent.matcher.fresh()
            accept(child.matcher, token)
        self.generators.rename((parent.seq_id, index), child.seq_id)
        return child
