"""The in-process engine: the executor's engine built the way the service builds it, driven
by plain calls instead of a gRPC session.

Built by :func:`services.executor.service.startup.build_engine` from an
:class:`~services.executor.service.config.ExecutorConfig` (the executor's flags, vLLM's
names), over the in-process block manager unless a client is given. Single-threaded, like
the engine it wraps: one thread drives it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, cast

from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import PoolStats
from services.common.blocks import NULL_BLOCK
from services.common.sampling_params import SamplingParams
from services.executor.api.hooks import HookedRunner
from services.executor.api.types import (
    CompletionOutput,
    EngineStats,
    KVUsage,
    RequestOutput,
    RunnerHook,
    StepOutput,
)
from services.executor.core.outputs import SeqOutput, TokenLogprob
from services.executor.core.sequence import RequestKey
from services.executor.model.launch import build_runner
from services.executor.model.loader import load_tokenizer
from services.executor.model.runner import ModelRunner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["InProcessEngine", "LoadedModel"]

SESSION_ID = 0  # every request of the facade is in one session
_pool_ids = itertools.count(1)

Prompt = str | Sequence[int]


class LoadedModel:
    """A model loaded on its device with its KV cache, to build engines on one after the
    other (each with a fresh pool, so none sees another's prefix cache) without loading it
    again. One engine at a time: it must be closed before the next is built."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self._runner = build_runner(config.runner_config())
        self._user: InProcessEngine | None = None

    @property
    def num_kv_blocks(self) -> int:
        """KV-cache blocks, the reserved null block included."""
        return self._runner.num_blocks

    @property
    def vocab_size(self) -> int:
        return self._runner.config.vocab_size

    def close(self) -> None:
        """Free the model (and stop its tensor-parallel ranks, if any)."""
        self._runner.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessEngine:
    """The executor's engine in this process.

    ``config``: the executor's flags (``ExecutorConfig``; or :meth:`from_cli` from command-line
    flags). ``model``: a :class:`LoadedModel` of the same model-side flags to build on (default:
    load one, freed by :meth:`close`). ``blockmgr``: the block-manager client to register the
    pool with (default: as ``config.blockmgr`` says, the in-process block manager unless
    ``--blockmgr grpc``); a client given stays the caller's to close. ``runner_hook``: called
    around every forward of the model (:data:`~.types.RunnerHook`).

    Requests: :meth:`generate` runs prompts to their end; :meth:`submit` queues one and
    :meth:`step` runs one iteration of the scheduler. :meth:`close` aborts what is left,
    frees every block and gives the pool back; the engine is also a context manager.
    """

    _closed: bool

    def __init__(
        self,
        config: ExecutorConfig,
        *,
        model: LoadedModel | None = None,
        blockmgr: BlockManagerClient | None = None,
        runner_hook: RunnerHook | None = None,
    ) -> None:
        if config.pool_id is None:  # unique, so engines can share a block manager
            config = replace(config, pool_id=f"engine-{os.getpid()}-{next(_pool_ids)}")
        if model is not None:
            if model.config.runner_config() != config.runner_config():
                raise ValueError("the loaded model was built with other model-side flags")
            if model._user is not None and not model._user._closed:
                raise RuntimeError("the loaded model's last engine is not closed")
            runner = model._runner
        else:
            runner = build_runner(config.runner_config())
        self.config = config
        self._model = model
        self._owns_client = blockmgr is None
        forwards: ModelRunner = runner
        if runner_hook is not None:
            forwards = cast(ModelRunner, HookedRunner(runner, runner_hook))
        try:
            self._engine, self.served = build_engine(config, runner=forwards, blockmgr=blockmgr)
        except BaseException:
            if model is None:
                runner.close()
            raise
        if model is not None:
            model._user = self
        self._runner = runner
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._ids = itertools.count()
        self._carried: list[StepOutput] = []  # outputs generate() took for step() to return
        self._dropped: set[str] = set()  # requests whose outputs nobody will read
        self._closed = False
        self._final_kv: PoolStats | None = None

    @classmethod
    def from_cli(
        cls,
        model: str | Path,
        flags: Sequence[str] = (),
        *,
        loaded: LoadedModel | None = None,
        blockmgr: BlockManagerClient | None = None,
        runner_hook: RunnerHook | None = None,
    ) -> InProcessEngine:
        """The engine of ``pagedserve executor --model MODEL FLAGS...``: the same flags and
        defaults (``--device auto``: CUDA when there is one). A bad flag is a ``ValueError``
        (argparse has printed why)."""
        try:
            config = ExecutorConfig.from_args(["--model", str(model), *flags])
        except SystemExit:
            raise ValueError(f"invalid executor flags: {list(flags)}") from None
        return cls(config, model=loaded, blockmgr=blockmgr, runner_hook=runner_hook)

    # ---- requests -------------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_name: str = "",
    ) -> str:
        """Queue a request (token ids, or text for the checkpoint's tokenizer) and return its
        id (``request_id``, else a new one); ``lora_name``: the LoRA adapter it runs with
        (``--enable-lora``; empty: the base model). Its outputs come from :meth:`step`.
        Raises ``EngineError`` (nothing queued) for a request the engine refuses."""
        self._check_open()
        rid = request_id if request_id is not None else f"request-{next(self._ids)}"
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        self._engine.add_request(
            RequestKey(SESSION_ID, rid),
            tokens,
            params or SamplingParams(),
            priority=priority,
            lora_name=lora_name,
        )
        return rid

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Abort a request (or only its sample ``index``) at this step boundary; its end comes
        from the next :meth:`step`. False if nothing ran under that id."""
        self._check_open()
        return self._engine.abort_request(RequestKey(SESSION_ID, request_id), index)

    @property
    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do or to return."""
        return bool(self._carried) or self._engine.has_work

    def step(self) -> list[StepOutput]:
        """One scheduler iteration (plan, block-manager Step, one forward, sampling): the new
        tokens of every sample that got one, and the ends of those that ended."""
        self._check_open()
        raw = self._engine.step()
        if self._dropped:
            raw = self._drop(raw)
        outs = [_step_output(o) for o in raw]
        if self._carried:
            outs, self._carried = self._carried + outs, []
        return outs

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (each token ids, or text for the checkpoint's tokenizer) to their
        end with ``params`` (one for all, or one per prompt; default ``SamplingParams()``):
        their outputs, in the prompts' order. Requests :meth:`submit` queued run alongside;
        their outputs meanwhile are kept for the next :meth:`step`. Raises ``EngineError``
        (nothing left queued) if the engine refuses one of them."""
        self._check_open()
        if isinstance(prompts, str):
            raise TypeError("prompts: a sequence of prompts, not one string")
        per = _params_for(params, len(prompts))
        tokens = [self.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]
        ids: list[str] = []
        try:
            for toks, sp in zip(tokens, per, strict=True):
                ids.append(self.submit(toks, sp))
            return self._run_to_end(ids, tokens, per, [isinstance(p, str) for p in prompts])
        except BaseException:
            if not self._closed:  # nobody will read what is left of them
                for rid in ids:
                    if self._engine.abort_request(RequestKey(SESSION_ID, rid)):
                        self._dropped.add(rid)
            raise

    def _run_to_end(
        self,
        ids: list[str],
        prompts: list[list[int]],
        params: list[SamplingParams],
        texts: list[bool],
    ) -> list[RequestOutput]:
        want = {rid: sp.n for rid, sp in zip(ids, params, strict=True)}
        tokens: dict[tuple[str, int], list[int]] = {}
        logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}
        ends: dict[tuple[str, int], SeqOutput] = {}
        prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        left = sum(want.values())
        while left:
            if not self._engine.has_work:
                raise RuntimeError("the engine stopped before the requests ended")
            raw = self._engine.step()
            if self._dropped:
                raw = self._drop(raw)
            for o in raw:
                rid = o.req_id.request_id
                if rid not in want:
                    self._carried.append(_step_output(o))
                    continue
                key = (rid, o.index)
                tokens.setdefault(key, []).extend(o.token_ids)
                if o.logprobs:
                    logprobs.setdefault(key, []).extend(o.logprobs)
                if o.prompt_logprobs:
                    prompt_logprobs[rid] = o.prompt_logprobs
                if o.finish_reason is not None:
                    ends[key] = o
                    left -= 1
        results = []
        for rid, prompt, sp, text in zip(ids, prompts, params, texts, strict=True):
            samples = []
            for i in range(sp.n):
                toks, end = tokens.get((rid, i), []), ends[(rid, i)]
                assert end.finish_reason is not None
                samples.append(
                    CompletionOutput(
                        i,
                        tuple(toks),
                        end.finish_reason,
                        end.stop_token_id,
                        tuple(logprobs.get((rid, i), ())),
                        self._decode(toks) if text else None,
                    )
                )
            usage = ends[(rid, 0)].usage
            results.append(
                RequestOutput(
                    rid,
                    tuple(prompt),
                    tuple(samples),
                    usage.cached_prompt_tokens if usage is not None else 0,
                    prompt_logprobs.get(rid, ()),
                )
            )
        return results

    def _drop(self, outs: list[SeqOutput]) -> list[SeqOutput]:
        """``outs`` less those of the requests nobody reads; a request is forgotten once the
        engine has (its aborted samples' ends all come out of the step after the abort)."""
        dropped = self._dropped
        kept = [o for o in outs if o.req_id.request_id not in dropped]
        live = self._engine.requests
        self._dropped = {r for r in dropped if RequestKey(SESSION_ID, r) in live}
        return kept

    # ---- text -----------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids by the checkpoint's tokenizer (with its BOS, as it adds one)."""
        return list(self._tokenizer_or_load()(text).input_ids)

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer_or_load().decode(list(tokens), skip_special_tokens=True))

    def _tokenizer_or_load(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model)
        return self._tokenizer

    # ---- statistics -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's counters now (also after :meth:`close`)."""
        e = self._engine
        sched = e.scheduler
        spec = e.spec.stats if e.spec is not None else None
        return EngineStats(
            num_steps=e.num_steps,
            num_preemptions=sched.num_preemptions,
            num_prompt_tokens=e.num_prompt_tokens,
            num_generation_tokens=e.num_generation_tokens,
            num_cached_prompt_tokens=e.num_cached_prompt_tokens,
            num_round_trips=e.link.num_round_trips,
            num_steps_ahead=e.num_steps_ahead,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.swapped),
            last_step_host_s=e.last_step_host_s,
            last_step_forward_s=e.last_step_forward_s,
            num_spec_drafts=spec.num_drafts if spec else 0,
            num_spec_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_spec_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos) if spec else (),
        )

    def kv_usage(self) -> KVUsage:
        """The running sequences' block tables now (costs a pass over them)."""
        bs = self.served.block_size
        blocks = slots = unused = most = 0
        seen: set[int] = set()
        running = self._engine.scheduler.running
        for seq in running:
            table = seq.block_table
            held = [b for b in table if b != NULL_BLOCK]
            blocks += len(held)
            seen.update(held)
            waste = len(table) * bs - seq.num_computed_tokens - seq.num_ahead_slots
            slots += len(table) * bs
            unused += waste
            most = max(most, waste)
        return KVUsage(len(running), blocks, len(seen), slots, unused, most)

    def kv_stats(self) -> PoolStats:
        """The block manager's statistics of this engine's pool: blocks in use and free,
        prefix-cache queries and hits, evictions, the tiers' traffic. After :meth:`close`,
        as they were once every block was freed."""
        if self._final_kv is not None:
            return self._final_kv
        link = self._engine.link
        return link.client.stats(link.pool_id)

    # ---- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Abort every request left, free their blocks (a last Step), give the pool back,
        and free the model unless it was given (a :class:`LoadedModel`). Idempotent. Like
        every Step, the last one waits for a block manager that does not answer (gRPC)."""
        if self._closed:
            return
        self._closed = True
        engine = self._engine
        try:
            for key in list(engine.requests):
                engine.abort_request(key)
            while engine.has_work:  # the frees go out with the next Step
                engine.step()
            self._final_kv = engine.link.client.stats(engine.link.pool_id)
            engine.link.unregister()
        finally:
            self._carried.clear()
            try:
                if self._owns_client:
                    engine.link.close()
            finally:
                if self._model is None:
                    self._runner.close()

    def __enter__(self) -> InProcessEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")


def _step_output(o: SeqOutput) -> StepOutput:
    return StepOutput(
        o.req_id.request_id,
        o.index,
        o.token_ids,
        o.finish_reason,
        o.stop_token_id,
        o.usage,
        o.logprobs,
        o.prompt_logprobs,
    )


def _params_for(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
