"""The engine's and the scheduler's settings, fixed for their life, and the request rules
that depend on them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.common.limits import FieldError, check_prompt, check_request_id, check_token_ids
from services.common.sampling_params import SamplingParams
from services.executor.core.outputs import EngineError, RequestErrorCode
from services.executor.core.sequence import Resume


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    watermark_blocks: int = 1  # admissions must leave this many blocks free
    # Hold back an admission whose prompt blocks are being computed by another sequence in
    # this step (or a running prefill): it hits them, committed, a step later instead of
    # computing them again.
    hold_back_shared_prefixes: bool = True
    # The window of the pool's sliding KV-cache groups: at each grow, their blocks out of
    # every future query's window are released (0: full attention, every block kept).
    sliding_window: int = 0
    # The pool's KV-cache groups (a hybrid model: one table per group and sequence), each
    # True where it slides over ``sliding_window``; empty: one group, sliding iff the window
    # is set.
    kv_group_slides: tuple[bool, ...] = ()
    # The highest retention priority the block manager serves (its Info): a request's
    # kv_retention_priority is capped to it (0: priorities are not sent).
    max_retention_priority: int = 3
    # Preemption by swapping (> 0): the host tier's slots, which swapped-out sequences share
    # with the blocks cached there; a sequence preempted while its table fits in the slots no
    # other swapped-out sequence holds is swapped out instead of recomputed (0: recompute).
    swap_slots: int = 0
    # The runner fills blocks from the tiers beside the forward (its ``fills_async``): a
    # chunk whose tables hold a block its Step fills waits for the next step, granted.
    defer_filled_chunks: bool = False
    # Speculative decoding is on (core.spec): running sequences may compute drafts, up to
    # this many each (a step planned ahead holds room for that many).
    speculative: bool = False
    num_speculative_tokens: int = 0
    spec_disable_by_batch_size: int = 0  # (its speculative config's: no drafts from so many)
    # Multi-LoRA serving: the distinct adapters running sequences may use at once (the
    # runner's device slots); a sequence whose adapter would be one more waits (0: no LoRA).
    max_loras: int = 0

    @property
    def group_slides(self) -> tuple[bool, ...]:
        """Per KV-cache group of the pool: whether it slides."""
        return self.kv_group_slides or (bool(self.sliding_window),)

    @property
    def num_kv_groups(self) -> int:
        return len(self.group_slides)


@dataclass(frozen=True)
class EngineSettings:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    scheduler: SchedulerConfig
    seed: int = 0
    # Plan the next step before this step's forward and send its Step without waiting.
    async_scheduling: bool = False
    # Speculative decoding (core.spec.config.SpeculativeConfig), or None.
    speculative_config: Any = None

    def __post_init__(self) -> None:
        cfg = self.scheduler
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            # A preempted sequence comes back with prompt + output tokens, up to max_model_len,
            # and without chunking it must fit one step's budget.
            raise ValueError(
                "with chunked prefill disabled, max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len})"
            )

    def check_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        resume: Resume | None = None,
    ) -> None:
        """Raise :class:`EngineError` (INVALID_ARGUMENT, naming the field) for a request this
        engine cannot serve."""
        cfg = self.scheduler
        try:
            check_request_id(request_id)
            check_prompt(prompt, self.vocab_size, self.max_model_len, "prompt_token_ids")
            if not cfg.enable_chunked_prefill and len(prompt) > cfg.max_num_batched_tokens:
                raise FieldError(
                    "prompt_token_ids",
                    f"{len(prompt)} tokens exceed max_num_batched_tokens="
                    f"{cfg.max_num_batched_tokens} with chunked prefill disabled",
                )
            try:
                params.validate(self.vocab_size)
            except FieldError as exc:
                raise exc.under("sampling_params") from None
            if resume is not None:
                self._check_resume(len(prompt), params, resume)
            if params.use_beam_search and params.n > cfg.max_num_seqs:
                raise FieldError(
                    "sampling_params.n",
                    f"{params.n} beams exceed max_num_seqs={cfg.max_num_seqs} (they run together)",
                )
        except FieldError as exc:
            raise EngineError(RequestErrorCode.INVALID_ARGUMENT, str(exc)) from None

    def _check_resume(self, prompt_len: int, params: SamplingParams, resume: Resume) -> None:
        outputs = resume.output_token_ids
        if params.n != 1:
            raise FieldError("sampling_params.n", "must be 1 when resume is set")
        check_token_ids(outputs, self.vocab_size, "resume.output_token_ids")
        if len(outputs) >= params.max_tokens:
            raise FieldError(
                "resume.output_token_ids",
                f"{len(outputs)} tokens leave none to generate within "
                f"max_tokens={params.max_tokens}",
            )
        if prompt_len + len(outputs) >= self.max_model_len:
            raise FieldError(
                "resume.output_token_ids",
                f"prompt + {len(outputs)} output tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}",
            )
        if outputs and params.prompt_logprobs is not None:
            raise FieldError(
                "sampling_params.prompt_logprobs",
                "must be unset when resuming after output tokens (they were sent already)",
            )
