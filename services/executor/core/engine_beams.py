"""Beam search in the engine: the beams of a request are sequences that share their KV
blocks. After each forward, a request whose live beams all have their next-token logits
takes one :class:`~services.executor.core.beam.BeamState` step; the beams it keeps are
re-forked in the block manager (a beam continued twice is forked: the blocks are shared by
reference, the partial last one copied on write when each writes its token; a beam not
continued is freed in the next Step). Nothing is emitted until the request is done; then
its best beams come out whole, best first, as samples ``0 .. n-1``.

A beam preempted (recomputed) while its siblings ran keeps the others waiting: their
log-probabilities are held in ``Request.beam_logprobs`` and they compute nothing until the
preempted one has caught up. Async scheduling does not plan ahead while a beam search runs
(every step re-forks after sampling).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from services.common.blocks import blocks_for_tokens
from services.common.sampling_params import SamplingParams
from services.executor.core.beam import BeamState
from services.executor.core.grammar import GrammarCompiler, Matcher, accept
from services.executor.core.outputs import EngineError, RequestErrorCode, SeqOutput, Usage
from services.executor.core.sequence import FinishReason, Request, RequestKey, SeqStatus
from services.executor.core.sequence import Sequence as Seq

if TYPE_CHECKING:
    from services.executor.core.config import EngineSettings
    from services.executor.core.scheduler import Scheduler


class BeamSearchEngine:
    """The engine's beam-search part (a mixin of ``Engine``)."""

    if TYPE_CHECKING:
        settings: EngineSettings
        scheduler: Scheduler
        requests: dict[RequestKey, Request]
        _seq_ids: itertools.count[int]
        _eos: frozenset[int]
        _num_beam_requests: int
        num_generation_tokens: int
        _forget: Callable[[Request], None]
        grammars: GrammarCompiler | None

    def _check_beams_fit(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse a search whose beams could not all hold their blocks at once (they run
        together): each its own blocks past the shared full prompt blocks (shared only
        through the prefix cache once the search has been preempted), in every KV-cache
        group (a sliding group's at most its window's, a chunk of the prompt beside it)."""
        cfg = self.settings.scheduler
        bs, k = cfg.block_size, params.n
        length = min(prompt_len + params.max_tokens, self.settings.max_model_len)
        if cfg.enable_prefix_caching:
            shared = prompt_len // bs
            full = shared + k * blocks_for_tokens(length - shared * bs, bs)
        else:
            full = k * blocks_for_tokens(length, bs)
        window = blocks_for_tokens(cfg.max_num_batched_tokens + cfg.sliding_window + 2 * bs, bs)
        need = sum(min(full, k * window) if slides else full for slides in cfg.group_slides)
        usable = self.scheduler.num_usable_blocks
        if need > usable:
            raise EngineError(
                RequestErrorCode.INVALID_ARGUMENT,
                f"sampling_params.n: {k} beams of up to {length} tokens need {need} KV blocks "
                f"at once; this executor has {usable}",
            )

    def _take_beams(
        self, logits: Tensor, seqs: list[Seq], rows: list[int] | None
    ) -> tuple[list[SeqOutput], list[Seq], list[int] | None]:
        """Take the beam-search rows out of a step's sampling: step every request whose
        beams are all in; return its outputs, and the other sequences with their rows."""
        row_of = rows if rows is not None else list(range(len(seqs)))
        beams = [i for i, s in enumerate(seqs) if s.params.use_beam_search]
        if not beams:
            return [], seqs, rows
        rows_t = torch.tensor([row_of[i] for i in beams], device=logits.device)
        lp = torch.log_softmax(logits[rows_t].float(), -1).cpu()  # one copy to the host
        touched: dict[RequestKey, Request] = {}
        for k, i in enumerate(beams):
            req = self.requests.get(seqs[i].req_id)
            if req is not None:
                req.beam_logprobs[seqs[i].seq_id] = lp[k]
                touched[req.req_id] = req
        outs: list[SeqOutput] = []
        for req in touched.values():
            if all(s.seq_id in req.beam_logprobs for s in req.seqs):
                outs.extend(self._beam_step(req))
        rest = [i for i, s in enumerate(seqs) if not s.params.use_beam_search]
        return outs, [seqs[i] for i in rest], [row_of[i] for i in rest]

    def _beam_step(self, req: Request) -> list[SeqOutput]:
        state: BeamState = req.beam
        beams = req.seqs
        logprobs = torch.stack([req.beam_logprobs.pop(s.seq_id) for s in beams])
        if self.grammars is not None and beams[0].matcher is not None:
            # Structured outputs: each beam's candidates are the tokens its grammar allows.
            self.grammars.mask_logits(logprobs, {i: s.matcher for i, s in enumerate(beams)})
        p = beams[0].params
        ends = p.ending_token_ids(self._eos)
        if beams[0].matcher is not None:  # a complete output ends on EOS, ignore_eos or not
            ends |= self._eos
        outputs = [s.output_token_ids for s in beams]
        banned = tuple(ends) if len(outputs[0]) < p.min_tokens else ()
        room = self.settings.max_model_len - len(beams[0].token_ids)
        running = state.step(logprobs, outputs, ends, room, banned)
        if state.done:
            return self._beams_done(req)
        length = len(beams[0].token_ids)  # before this step's token
        kept: list[Seq] = []
        chosen: set[int] = set()
        forks: list[tuple[Seq, Seq]] = []
        grammar_before: dict[int, Matcher] = {}  # a kept beam's grammar state before its token
        for c in running:
            parent = beams[c.beam]
            if c.beam not in chosen:
                chosen.add(c.beam)
                if parent.matcher is not None:  # (its children fork the state before)
                    grammar_before[c.beam] = parent.matcher.copy()
                    accept(parent.matcher, c.token)
                parent.token_ids.append(c.token)
                kept.append(parent)
            else:
                child = self._beam_child(parent, length, c.token)
                if parent.matcher is not None:
                    child.matcher = grammar_before[c.beam].copy()
                    accept(child.matcher, c.token)
                forks.append((parent, child))
                kept.append(child)
        slots = iter(sorted(set(range(state.width)) - {beams[b].index for b in chosen}))
        for pos, seq in enumerate(beams):
            if pos not in chosen:  # no continuation: its blocks go back at the next Step
                self.scheduler.finish(seq, FinishReason.ABORT)
        for parent, child in forks:
            child.index = next(slots)
            self.scheduler.fork(parent, child)
        req.seqs = kept
        self.num_generation_tokens += len(kept)
        return []

    def _unsplit_beams(self) -> None:
        """A search whose beams are split between running and waiting (one was preempted,
        or forked while every seat was taken) gives up its running beams too: they would
        wait, holding seats and blocks, for siblings that may need exactly those. The whole
        search is admitted again together (``admission``) and recomputed."""
        for req in self.requests.values():
            if req.beam is None:
                continue
            states = {s.status for s in req.seqs}
            if SeqStatus.WAITING in states and SeqStatus.RUNNING in states:
                for seq in req.seqs:
                    if seq.status is SeqStatus.RUNNING:
                        self.scheduler.preempt(seq)
                req.beam_logprobs.clear()

    def _beam_child(self, parent: Seq, length: int, token: int) -> Seq:
        return Seq(
            seq_id=next(self._seq_ids),
            req_id=parent.req_id,
            index=parent.index,  # (a free slot is given before it is forked)
            token_ids=[*parent.token_ids[:length], token],
            prompt_len=parent.prompt_len,
            params=parent.params,
            priority=parent.priority,
            arrival=parent.arrival,
            cache_salt=parent.cache_salt,
            lora_id=parent.lora_id,
        )

    def _beams_done(self, req: Request) -> list[SeqOutput]:
        """Free the live beams and return the best hypotheses, best first."""
        cached = req.seqs[0].num_cached_tokens if req.seqs else 0
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, FinishReason.LENGTH)
        outs = []
        results = req.beam.results()
        for rank in range(req.beam.width):
            # Fewer hypotheses than beams (a grammar or min_tokens left too few ways to
            # go on): the missing ones end empty, so that every sample gets its end.
            tokens, ended = (
                (results[rank].token_ids, results[rank].ended_by)
                if rank < len(results)
                else ([], None)
            )
            reason = FinishReason.STOP if ended is not None else FinishReason.LENGTH
            usage = Usage(len(req.prompt_token_ids), len(tokens), cached)
            outs.append(SeqOutput(req.req_id, rank, list(tokens), (), reason, ended, usage))
        self._forget(req)
        return outs
