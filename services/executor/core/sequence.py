"""Requests and their sequences: the executor's per-request state (pure data, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from services.blockmgr.api.hashing import ROOT_HASH, hash_block
from services.common.sampling_params import SamplingParams


class RequestKey(NamedTuple):
    """A request's identity in the engine: ids are unique per gateway session, not across
    sessions, so the session is part of the key."""

    session_id: int
    request_id: str


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swapping: its blocks in the host tier, computed kept
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the client or the gateway
    ERROR = "error"  # cannot be served (e.g. does not fit the KV cache)


@dataclass(frozen=True, slots=True)
class Resume:
    """A sample carried on from tokens generated before (the gateway resumes a stream whose
    executor was lost). The request has ``n = 1`` and stands for sample ``sample_index`` of
    the original one (its seeded draws are that sample's). ``output_token_ids`` are output,
    not prompt: they are recomputed like a preempted sequence's, count toward ``max_tokens``,
    ``min_tokens`` and the penalties, and are not emitted again."""

    sample_index: int
    output_token_ids: tuple[int, ...]


@dataclass(eq=False)
class Sequence:
    """One sample of a request. ``token_ids`` is prompt + output; the first
    ``num_computed_tokens`` of them have their K/V in the cache."""

    seq_id: int  # unique per executor, the block manager's key
    req_id: RequestKey
    index: int  # which of the request's n samples
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    priority: int
    arrival: int  # admission order tie-break (monotonic counter)
    cache_salt: bytes = b""
    lora_id: int = 0  # the LoRA adapter version it runs with (0: the base model; core.lora)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    # One block table per KV-cache group of the pool, all of one length. Each is only ever
    # appended to in place; any other change assigns a new list (runners mirror tables by
    # identity: see forward_batch.SeqChunk).
    tables: list[list[int]] = field(default_factory=lambda: [[]])
    # In the sliding groups of the pool, entries before this index are the null block:
    # released, out of the window of every query still to come.
    first_live_block: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chain over full blocks
    num_committed_blocks: int = 0
    # Swapped out: the host-tier slots its table went to, in order (services.blockmgr.pool.swap).
    host_slots: tuple[int, ...] = ()
    num_swap_slots: int = 0  # the slots counted for it when it was swapped out
    # Slots the pool granted beyond ``num_computed_tokens`` for a step that has not run yet
    # (async scheduling grants the next step's slot while this step's forward runs).
    num_ahead_slots: int = 0
    # Speculative decoding (core.spec): the drafts proposed for its next step (a draft model
    # makes them once the step is scheduled); how many of them the scheduled chunk computes;
    # verified tokens (accepted drafts) the pool has not counted yet (the next grow reports
    # them); slots the pool holds beyond its tokens.
    draft_token_ids: list[int] = field(default_factory=list)
    num_planned_drafts: int = 0  # drafts its next step may verify (ngram: the drafts made)
    num_scheduled_drafts: int = 0
    # With a draft model: its positions whose KV the draft model has computed, from 0 (None:
    # as far as the target's, prefix hits included; after a recompute, no further than it
    # went before). Tokens it has not seen yet are computed with its next drafts (core.spec).
    num_draft_computed: int | None = None
    # With an EAGLE head: its output at the sequence's last computed position, which its next
    # drafts are made from (a Tensor; core.spec.eagle), until they are.
    draft_state: Any = None
    # A pooling request's (--runner pooling): its core.pooling.PoolState.
    pooled: Any = None
    num_unreported: int = 0
    num_surplus_slots: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # With params.prompt_logprobs: entry i is prompt token i + 1's (an outputs.TokenLogprob),
    # kept across preemptions (a recomputation does not add them again).
    prompt_logprobs: list[Any] = field(default_factory=list)
    # With params.structured_outputs: its grammar matcher (core.grammar.Matcher), which has
    # accepted exactly the output tokens.
    matcher: Any = None
    num_preemptions: int = 0
    num_bad_answers: int = 0  # block-manager answers about it that were rejected
    finish_reason: FinishReason | None = None
    stop_token: int | None = None
    admitted_once: bool = False

    @property
    def num_pool_tokens(self) -> int:
        """The tokens the block manager counts for it: its computed ones but the accepted
        drafts its next grow reports (slots granted ahead not included)."""
        return self.num_computed_tokens - self.num_unreported

    def forget_speculation(self) -> None:
        """Preempted to be recomputed: no slot, draft or unreported token is left (a draft
        model's KV is kept as far as it went: its prefix hits are read up to there)."""
        self.num_unreported = self.num_surplus_slots = self.num_scheduled_drafts = 0
        self.num_planned_drafts, self.draft_state = 0, None

    def wants_prompt_logprobs(self) -> bool:
        """Its prompt chunks return every token's logits: sample 0 of a request that asked for
        prompt log-probabilities, until it has them all (a recomputation after a preemption
        asks again only for what it lacks)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.prompt_len - 1
        )

    @property
    def block_table(self) -> list[int]:
        """The first KV-cache group's table (a one-group pool's only one)."""
        return self.tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:  # (one-group pools: tests)
        self.tables = [table]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: lower priority value first, then arrival, then sample index."""
        return (self.priority, self.arrival, self.index)

    def full_block_hashes(self, block_size: int) -> list[bytes]:
        """Chained hashes of every full block of the known tokens (extends the cache)."""
        hashes = self.block_hashes
        num_full = len(self.token_ids) // block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full):
            chunk = self.token_ids[i * block_size : (i + 1) * block_size]
            parent = hash_block(parent, chunk, self.cache_salt if i == 0 else b"")
            hashes.append(parent)
        return hashes


@dataclass(eq=False)
class Request:
    req_id: RequestKey
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    seqs: list[Sequence]
    cache_salt: bytes = b""
    lora_id: int = 0
    pending_aborts: set[int] = field(default_factory=set)  # samples aborted before their fork
    # Beam search: its core.beam.BeamState; ``seqs`` are then the live beams, in the state's
    # order, and ``beam_logprobs`` the next-token log-probabilities of those computed ahead
    # of the others (a sibling was preempted), by sequence id.
    beam: Any = None
    beam_logprobs: dict[int, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return bool(self.beam.done)
        return len(self.seqs) == self.params.n and all(
            s.status is SeqStatus.FINISHED for s in self.seqs
        )
