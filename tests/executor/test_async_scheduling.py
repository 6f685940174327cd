"""Async scheduling (``--async-scheduling``): the next step is planned before this step's
forward and its Step sent without waiting, so the round trip overlaps the forward. Outputs,
forward batches and the pool must be exactly those of the synchronous engine, whatever
finishes, aborts, forks, preempts or fails in between."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from services.blockmgr.api.errors import BlockManagerError, ErrorCode
from services.blockmgr.api.protocol import StepCall
from services.blockmgr.api.types import GrowResult, OpStatus, StepResult
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.outputs import SeqOutput
from services.executor.core.sequence import FinishReason, RequestKey

from .fake_runner import reference_tokens
from .test_scheduler import assert_no_leak, greedy, make_engine, prompt, run, tokens

# Each async test runs with a runner that only executes, one in two halves (batches built
# ahead), and one whose launch returns early (the next step planned after the launch).
RUNNERS = pytest.mark.parametrize(
    "preparing", [False, True, "launch-first"], ids=["execute", "prepared", "launch-first"]
)


def _collect(outs: dict, early: list[SeqOutput]) -> dict:
    for o in reversed(early):
        outs.setdefault((o.req_id.request_id, o.index), []).insert(0, o)
    return outs


def _decode_workload(engine: Engine, num: int = 6, max_tokens: int = 14) -> dict[str, list[int]]:
    prompts = {f"r{i}": prompt(3 + 2 * i, i) for i in range(num)}
    for req_id, p in prompts.items():
        engine.add_request(RequestKey(0, req_id), p, greedy(max_tokens))
    return prompts


@RUNNERS
def test_steady_decode_runs_the_same_forwards_as_sync_with_every_step_sent_ahead(preparing):
    sync, sync_runner, _ = make_engine(budget=64)
    fast, fast_runner, client = make_engine(budget=64, async_scheduling=True, preparing=preparing)
    prompts = _decode_workload(sync)
    _decode_workload(fast)
    want, got = run(sync), run(fast)
    for req_id, p in prompts.items():
        assert tokens(got[(req_id, 0)]) == tokens(want[(req_id, 0)]) == reference_tokens(p, 14)
    assert fast_runner.calls == sync_runner.calls  # the same batches, step for step
    # Every step after the prefill was granted during the step before it.
    assert fast.num_steps_ahead == len(fast_runner.calls) - 1
    assert fast.num_bad_answers == 0 and fast.link.num_recoveries == 0
    assert_no_leak(fast, client)


@RUNNERS
def test_a_sequence_ending_by_length_leaves_its_seat_to_an_admission_planned_ahead(preparing):
    """At ``max_num_seqs``, a sequence whose token sampled now is its last (``max_tokens``)
    frees its seat in the step planned ahead: the next request is admitted in the same step
    as without async scheduling, not one later."""
    sync, sync_runner, _ = make_engine(budget=64, max_num_seqs=2)
    fast, fast_runner, client = make_engine(
        budget=64, max_num_seqs=2, async_scheduling=True, preparing=preparing
    )
    for engine in (sync, fast):
        for i, n in enumerate((4, 9, 6, 3)):
            engine.add_request(RequestKey(0, f"r{i}"), prompt(5, i), greedy(n))
    want, got = run(sync), run(fast)
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in want.items()}
    assert fast_runner.calls == sync_runner.calls  # the same batches, step for step
    assert fast.num_steps_ahead >= len(fast_runner.calls) - 2
    assert_no_leak(fast, client)


@pytest.mark.parametrize("seed", [7, 8, 9])
@RUNNERS
def test_random_workload_with_aborts_and_samples_matches_the_reference(seed, preparing):
    """Arrivals, priorities, n > 1, stop tokens, aborts and a pool small enough to preempt:
    every sample is the reference's continuation (cut at its abort), with one final each."""
    rng = random.Random(seed)
    engine, _runner, client = make_engine(
        num_blocks=18, budget=24, max_num_seqs=6, async_scheduling=True, preparing=preparing
    )
    expected: dict[tuple[str, int], list[int]] = {}
    got: dict[tuple[str, int], list[int]] = {}
    finals: dict[tuple[str, int], list[FinishReason]] = {}
    aborted: set[str] = set()
    for step in range(2000):
        if step < 150 and rng.random() < 0.3:
            req_id, p, n = f"r{step}", prompt(rng.randrange(1, 30), step), rng.randrange(1, 14)
            samples = 2 if rng.random() < 0.2 else 1
            ref = reference_tokens(p, n)
            stop = (ref[n // 2],) if rng.random() < 0.2 else ()
            params = SamplingParams(
                n=samples, temperature=0.0, max_tokens=n, ignore_eos=True, stop_token_ids=stop
            )
            engine.add_request(RequestKey(0, req_id), p, params, priority=rng.randrange(3))
            if stop:
                ref = ref[: ref.index(stop[0]) + 1]
            for i in range(samples):
                expected[(req_id, i)] = ref
        if engine.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(engine.requests))
            assert engine.abort_request(victim)
            aborted.add(victim.request_id)
        for o in engine.step():
            key = (o.req_id.request_id, o.index)
            got.setdefault(key, []).extend(o.token_ids)
            if o.finish_reason is not None:
                finals.setdefault(key, []).append(o.finish_reason)
        if step >= 150 and not engine.has_work:
            break
    assert engine.num_steps_ahead > 0 and engine.scheduler.num_preemptions > 0
    assert engine.num_bad_answers == 0 and engine.link.num_recoveries == 0
    assert all(len(f) == 1 for f in finals.values()) and finals.keys() == expected.keys()
    for key, ref in expected.items():
        if key[0] in aborted:
            assert ref[: len(got.get(key, []))] == got.get(key, []), key
        else:
            assert got[key] == ref, key
    assert_no_leak(engine, client)


@RUNNERS
def test_samples_forking_after_a_one_token_prompt_chunk_are_planned_after_sampling(preparing):
    """A prefix hit can leave a prompt with one token to compute: that chunk looks like a
    decode, but its samples fork when it is sampled, so the next step is not planned ahead."""
    engine, runner, client = make_engine(async_scheduling=True, preparing=preparing)
    p = prompt(2 * 4 + 1, 5)  # two full blocks cached, then one token
    engine.add_request(RequestKey(0, "warm"), p, greedy(1))
    run(engine)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=7, ignore_eos=True)
    engine.add_request(RequestKey(0, "n3"), p, params)
    outs = run(engine)
    assert [(8, 1)] in runner.calls  # the one-token chunk of the prompt
    for i in range(3):
        assert tokens(outs[("n3", i)]) == reference_tokens(p, 7), i
    assert engine.num_steps_ahead > 0
    assert engine.num_bad_answers == 0 and engine.link.num_recoveries == 0
    assert_no_leak(engine, client)


@RUNNERS
def test_abort_between_steps_gives_back_the_slot_granted_ahead(preparing):
    engine, _runner, client = make_engine(async_scheduling=True, preparing=preparing)
    prompts = _decode_workload(engine, num=3, max_tokens=20)
    early: list[SeqOutput] = []
    while engine.num_steps_ahead < 3:
        early += engine.step()
    assert engine.abort_request(RequestKey(0, "r1"))
    outs = _collect(run(engine), early)
    assert outs[("r1", 0)][-1].finish_reason is FinishReason.ABORT
    for req_id in ("r0", "r2"):
        assert tokens(outs[(req_id, 0)]) == reference_tokens(prompts[req_id], 20)
    assert_no_leak(engine, client)


class FaultAhead:
    """A block-manager client that spoils its ``at``-th Step sent ahead (``step_async``) in
    the way ``fault`` names; every other call goes through."""

    def __init__(self, fault: str, at: int) -> None:
        self.inner, self.fault, self.at, self.ahead = InProcessClient(), fault, at, 0

    def step_async(self, pool_id: str, epoch: int, ops: list) -> StepCall:
        self.ahead += 1
        if self.ahead != self.at:
            return self.inner.step_async(pool_id, epoch, ops)
        return _Answered(lambda: self._spoiled(pool_id, epoch, ops))

    def _spoiled(self, pool_id: str, epoch: int, ops: list) -> StepResult:
        if self.fault == "unreachable":  # never got there
            raise BlockManagerError(ErrorCode.UNAVAILABLE, "connection refused")
        result = self.inner.step(pool_id, epoch, ops)
        if self.fault == "answer_lost":  # applied, then the answer lost
            raise BlockManagerError(ErrorCode.UNAVAILABLE, "answer lost")
        grow = next(r for r in result.results if isinstance(r, GrowResult))
        if self.fault == "refused":  # the pool says full where our mirror says it fits
            statuses = (OpStatus.RESOURCE_EXHAUSTED, *grow.statuses[1:])
            bad = replace(grow, statuses=statuses, new_block_ids=((), *grow.new_block_ids[1:]))
        else:  # "contradicting": a block nobody asked for, one the sequence already holds
            bad = replace(grow, new_block_ids=((1,), *grow.new_block_ids[1:]))
        results = tuple(bad if r is grow else r for r in result.results)
        return replace(result, results=results)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Answered:
    def __init__(self, answer: Callable[[], StepResult]) -> None:
        self.result = answer


def _run_with_fault(
    fault: str, at: int, preparing: bool | str
) -> tuple[Engine, FaultAhead, dict, dict]:
    """The decode workload with its ``at``-th Step sent ahead spoiled by ``fault``; every
    sample checked against the reference."""
    client = FaultAhead(fault, at)
    engine, _runner, _ = make_engine(
        budget=64, async_scheduling=True, preparing=preparing, client=client
    )
    prompts = _decode_workload(engine)
    outs = run(engine)
    for req_id, p in prompts.items():
        assert tokens(outs[(req_id, 0)]) == reference_tokens(p, 14), req_id
    return engine, client, prompts, outs


@pytest.mark.parametrize("fault", ["unreachable", "answer_lost", "contradicting"])
@pytest.mark.parametrize("at", [1, 4])
@RUNNERS
def test_a_failed_step_sent_ahead_rebuilds_the_pool_without_losing_a_token(fault, at, preparing):
    engine, client, prompts, outs = _run_with_fault(fault, at, preparing)
    for req_id in prompts:
        assert [o.finish_reason for o in outs[(req_id, 0)] if o.finish_reason] == [
            FinishReason.LENGTH
        ]
    assert engine.link.num_recoveries == 1 and engine.num_ahead_failures == 1
    assert engine.num_bad_answers == (fault == "contradicting")
    assert client.ahead > at  # sending ahead resumed after the rebuild
    assert_no_leak(engine, client.inner)


@pytest.mark.parametrize("at", [1, 4])
@RUNNERS
def test_a_grow_refused_ahead_preempts_that_sequence_as_a_sync_step_would(at, preparing):
    engine, client, _prompts, _outs = _run_with_fault("refused", at, preparing)
    assert engine.scheduler.num_preemptions == 1
    assert engine.link.num_recoveries == 0 and engine.num_bad_answers == 0
    assert_no_leak(engine, client.inner)


def test_an_error_that_is_not_an_outage_is_raised_not_retried():
    class Refuses(FaultAhead):
        def _spoiled(self, pool_id: str, epoch: int, ops: list) -> StepResult:
            raise BlockManagerError(ErrorCode.INVALID_ARGUMENT, "ops[0].grow: malformed")

    engine, _runner, _ = make_engine(budget=64, async_scheduling=True, client=Refuses("", 2))
    _decode_workload(engine)
    with pytest.raises(BlockManagerError, match="malformed"):
        run(engine)


@RUNNERS
def test_arrivals_are_admitted_in_steps_planned_ahead(preparing):
    """Requests arriving every step while others decode: admissions ride in the Steps sent
    ahead, so nearly every step overlaps its round trip, and every output is exact."""
    engine, runner, client = make_engine(
        num_blocks=128, budget=48, async_scheduling=True, preparing=preparing
    )
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    for step in range(400):
        if step < 40:
            p = prompt(5 + step % 11, step)
            engine.add_request(RequestKey(0, f"r{step}"), p, greedy(6 + step % 9))
            expected[f"r{step}"] = reference_tokens(p, 6 + step % 9)
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
        if not engine.has_work:
            break
    assert got == expected
    assert engine.num_steps_ahead >= 0.9 * (len(runner.calls) - 1)
    assert engine.num_bad_answers == 0 and engine.link.num_recoveries == 0
    assert_no_leak(engine, client)


@RUNNERS
def test_aborting_a_request_admitted_ahead_frees_what_it_was_granted(preparing):
    engine, _runner, client = make_engine(async_scheduling=True, preparing=preparing)
    engine.add_request(RequestKey(0, "a"), prompt(6, 0), greedy(10))
    early = engine.step()
    engine.add_request(RequestKey(0, "b"), prompt(9, 1), greedy(10))
    early += engine.step()  # plans the next step ahead: "b" is admitted in it
    (b,) = engine.requests[RequestKey(0, "b")].seqs
    assert b.block_table and b.num_ahead_slots == 9 and b.num_computed_tokens == 0
    assert engine.abort_request(RequestKey(0, "b"))
    outs = _collect(run(engine), early)
    assert [(o.token_ids, o.finish_reason) for o in outs[("b", 0)]] == [([], FinishReason.ABORT)]
    assert tokens(outs[("a", 0)]) == reference_tokens(prompt(6, 0), 10)
    assert_no_leak(engine, client)


@RUNNERS
def test_chunked_prefills_are_planned_ahead_with_the_same_chunks_as_sync(preparing):
    """Prompts longer than the token budget: every chunk after the first step is planned
    ahead, and the chunks are exactly those the synchronous engine computes."""
    sync, sync_runner, _ = make_engine(budget=8)
    fast, fast_runner, client = make_engine(budget=8, async_scheduling=True, preparing=preparing)
    prompts = {"long": prompt(30, 1), "mid": prompt(20, 2), "short": prompt(3, 3)}
    for engine in (sync, fast):
        for req_id, p in prompts.items():
            engine.add_request(RequestKey(0, req_id), p, greedy(9))
    want, got = run(sync), run(fast)
    for req_id, p in prompts.items():
        assert tokens(got[(req_id, 0)]) == tokens(want[(req_id, 0)]) == reference_tokens(p, 9)
    assert fast_runner.calls == sync_runner.calls
    assert any(n > 1 and c > 0 for call in fast_runner.calls for c, n in call)  # mid-prompt
    assert fast.num_steps_ahead == len(fast_runner.calls) - 1
    assert fast.num_bad_answers == 0 and fast.link.num_recoveries == 0
    assert_no_leak(fast, client)


@RUNNERS
def test_a_forward_that_raises_with_a_step_ahead_marks_the_pool_for_a_rebuild(preparing):
    """A failed forward ends the engine loop (the executor exits); the Step sent ahead may
    have been applied though its answer is never taken, so the link is left needing a
    rebuild: nothing would trust the pool again without restoring it first. A runner whose
    launch returns early gets its next Step planned after the launch: none was sent."""
    engine, runner, _client = make_engine(budget=64, async_scheduling=True, preparing=preparing)
    _decode_workload(engine)
    while engine.num_steps_ahead < 3:
        engine.step()
    assert engine.link.can_send_ahead

    def fails(chunks):
        raise RuntimeError("device error")

    runner.execute = runner.launch = fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device error"):
        engine.step()
    assert engine.link.can_send_ahead == (preparing == "launch-first")


def test_a_built_batch_whose_sampled_rows_all_ended_runs_its_prefill_chunk_alone():
    """The batch built ahead holds a decode and a chunk of a long prompt; the decoding
    request is aborted before it runs: its row writes nothing, no logits row is left to
    sample, and the prompt goes on (a crash once, indexing logits with an empty index)."""
    engine, _runner, client = make_engine(budget=8, async_scheduling=True, preparing=True)
    engine.add_request(RequestKey(0, "a"), prompt(5, 0), greedy(30))
    early = engine.step() + engine.step() + engine.step()
    engine.add_request(RequestKey(0, "b"), prompt(40, 1), greedy(3))
    while not (
        engine._batch_ahead is not None
        and [c.need_logits for c in engine._batch_ahead.chunks] == [True, False]
    ):
        early += engine.step()
    assert engine.abort_request(RequestKey(0, "a"))
    outs = _collect(run(engine), early)
    assert outs[("a", 0)][-1].finish_reason is FinishReason.ABORT
    assert tokens(outs[("b", 0)]) == reference_tokens(prompt(40, 1), 3)
    assert engine.num_batches_prepared > 0
    assert_no_leak(engine, client)
