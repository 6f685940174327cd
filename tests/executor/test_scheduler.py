"""Scheduler behaviour through the real engine loop with a model-free paged runner."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import pytest

from services.blockmgr.api.errors import BlockManagerError, ErrorCode
from services.blockmgr.api.types import PoolSpec, StepResult
from services.blockmgr.client import InProcessClient
from services.common.sampling_params import SamplingParams
from services.executor.core.blockmgr_link import BlockManagerLink
from services.executor.core.config import EngineSettings
from services.executor.core.engine import Engine
from services.executor.core.outputs import EngineError, SeqOutput
from services.executor.core.scheduler import SchedulerConfig
from services.executor.core.sequence import FinishReason, RequestKey

from .fake_runner import VOCAB, FakePagedRunner, PreparingFakeRunner, reference_tokens

BS = 4


def make_engine(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 16,
    budget: int = 32,
    chunked: bool = True,
    prefix: bool = True,
    max_model_len: int = 128,
    watermark: int = 0,
    async_scheduling: bool = False,
    client: Any = None,
    preparing: bool | str = False,
) -> tuple[Engine, FakePagedRunner, InProcessClient]:
    """``preparing``: False, a runner with ``execute`` only; True, one in two halves
    (``prepare``/``launch``); ``"launch-first"``, that one claiming its launch returns before
    the device is done (as on CUDA), so async scheduling plans ahead after the launch."""
    if preparing:
        early = preparing == "launch-first"
        runner: FakePagedRunner = PreparingFakeRunner(num_blocks, BS, launch_returns_early=early)
    else:
        runner = FakePagedRunner(num_blocks, BS)
    client = client or InProcessClient()
    settings = EngineSettings(
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        eos_token_ids=(2,),
        scheduler=SchedulerConfig(
            block_size=BS,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=prefix,
            watermark_blocks=watermark,
        ),
        async_scheduling=async_scheduling,
    )
    return Engine(settings, runner, link(client, runner, prefix)), runner, client


def link(client: Any, runner: FakePagedRunner, prefix: bool = True) -> BlockManagerLink:
    spec = PoolSpec(runner.num_blocks, BS, prefix)
    return BlockManagerLink(client, "test", spec, retry_s=0.001)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: Engine, max_steps: int = 10_000) -> dict[tuple[str, int], list[SeqOutput]]:
    outs: dict[tuple[str, int], list[SeqOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return outs
        for o in engine.step():
            outs.setdefault((o.req_id.request_id, o.index), []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outs: Iterable[SeqOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def assert_no_leak(engine: Engine, client: InProcessClient) -> None:
    c = client.stats("test").counters
    assert c.num_in_use_blocks == 0 and c.num_sequences == 0
    assert c.num_free_blocks == c.num_usable_blocks
    assert not engine.scheduler.mirror.refs and not engine.requests


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def test_long_prompt_is_split_by_the_token_budget_and_decodes_go_first():
    engine, runner, client = make_engine(budget=16)
    engine.add_request(RequestKey(0, "short"), prompt(3, 0), greedy(8))
    engine.step()  # "short" prefilled (3 tokens) and sampled
    engine.add_request(RequestKey(0, "long"), prompt(40, 1), greedy(2))
    run(engine)
    # First step with "long": 1 decode token of "short", then 15 prefill tokens of "long".
    assert runner.calls[1] == [(3, 1), (0, 15)]
    assert runner.calls[2] == [(4, 1), (15, 15)]
    assert runner.calls[3] == [(5, 1), (30, 10)]
    assert all(sum(n for _, n in call) <= 16 for call in runner.calls)
    assert_no_leak(engine, client)


def test_chunked_prefill_off_admits_whole_prompts_only():
    engine, runner, client = make_engine(budget=16, chunked=False, max_model_len=16)
    engine.add_request(RequestKey(0, "a"), prompt(10, 0), greedy(3))
    engine.add_request(RequestKey(0, "b"), prompt(10, 1), greedy(3))
    outs = run(engine)
    assert runner.calls[0] == [(0, 10)]  # b does not fit the rest of the budget
    assert runner.calls[1] == [(10, 1), (0, 10)]
    with pytest.raises(EngineError, match="max_model_len"):
        engine.add_request(RequestKey(0, "c"), prompt(17, 2), greedy(3))
    assert tokens(outs[("a", 0)]) == reference_tokens(prompt(10, 0), 3)
    assert_no_leak(engine, client)


def test_fcfs_admission_order_with_one_slot():
    engine, _runner, client = make_engine(max_num_seqs=1)
    for i in range(4):
        engine.add_request(RequestKey(0, f"r{i}"), prompt(5, i), greedy(2))
    order = []
    while engine.has_work:
        for o in engine.step():
            if o.finish_reason is not None:
                order.append(o.req_id.request_id)
    assert order == ["r0", "r1", "r2", "r3"]
    assert_no_leak(engine, client)


def test_priority_admission_order_lower_value_first_ties_by_arrival():
    engine, _runner, _client = make_engine(max_num_seqs=1)
    for i, prio in enumerate([5, 1, 5, 0, 1]):
        engine.add_request(RequestKey(0, f"r{i}"), prompt(5, i), greedy(2), priority=prio)
    order = []
    while engine.has_work:
        order += [o.req_id.request_id for o in engine.step() if o.finish_reason is not None]
    assert order == ["r3", "r1", "r4", "r0", "r2"]


def test_preemption_by_recompute_resumes_with_identical_tokens():
    engine, _runner, client = make_engine(num_blocks=13, budget=64)  # 12 usable = 48 slots
    prompts = {f"r{i}": prompt(6 + i, i) for i in range(5)}
    for req_id, p in prompts.items():
        engine.add_request(RequestKey(0, req_id), p, greedy(20))
    outs = run(engine)
    assert engine.scheduler.num_preemptions > 0
    for req_id, p in prompts.items():
        assert tokens(outs[(req_id, 0)]) == reference_tokens(p, 20), req_id
    assert_no_leak(engine, client)


def test_newest_sequence_is_the_one_preempted():
    engine, _runner, _client = make_engine(num_blocks=9, budget=64)  # 8 usable = 32 slots
    engine.add_request(RequestKey(0, "old"), prompt(8, 0), greedy(20))
    engine.add_request(RequestKey(0, "new"), prompt(8, 1), greedy(20))
    preempted = []
    while engine.has_work:
        engine.step()
        for seq in engine.scheduler.waiting:
            if seq.num_preemptions and seq.req_id.request_id not in preempted:
                preempted.append(seq.req_id.request_id)
    assert preempted == ["new"]


def test_no_preemption_while_free_blocks_remain():
    # 16 sequences x (8 prompt + 8 output) = 16 x 4 blocks = 64 blocks: exactly the pool.
    engine, _runner, client = make_engine(num_blocks=65, budget=256)
    for i in range(16):
        engine.add_request(RequestKey(0, f"r{i}"), prompt(8, i), greedy(8))
    run(engine)
    assert engine.scheduler.num_preemptions == 0
    assert_no_leak(engine, client)


def test_oldest_request_keeps_progressing_under_constant_pressure():
    engine, _runner, client = make_engine(num_blocks=11, budget=64)  # 10 usable = 40 slots
    engine.add_request(RequestKey(0, "oldest"), prompt(10, 0), greedy(24))
    done_at = None
    for step in range(400):
        if step % 2 == 0:
            engine.add_request(RequestKey(0, f"n{step}"), prompt(10, step + 1), greedy(8))
        for o in engine.step():
            if o.req_id.request_id == "oldest" and o.finish_reason is not None:
                done_at = step
        if done_at is not None:
            break
    assert done_at is not None and done_at < 60
    for seq in engine.scheduler.waiting + engine.scheduler.running:
        engine.abort_request(seq.req_id)
    run(engine)
    assert_no_leak(engine, client)


@pytest.mark.parametrize("when", ["waiting", "running", "final_step", "after_finish"])
def test_abort_frees_blocks_and_is_idempotent(when):
    """Abort while queued, mid-generation, one step before the last token, or after the end:
    exactly one final message per index, and every block back in the pool."""
    engine, _runner, client = make_engine(max_num_seqs=1)
    engine.add_request(RequestKey(0, "keep"), prompt(6, 0), greedy(4))
    engine.add_request(RequestKey(0, "x"), prompt(9, 1), greedy(3))
    early: list[SeqOutput] = []

    def x_tokens() -> int:
        return sum(len(o.token_ids) for o in early if o.req_id.request_id == "x")

    target = {"waiting": -1, "running": 1, "final_step": 2, "after_finish": 3}[when]
    early += engine.step()
    while x_tokens() < target:
        early += engine.step()
    finished_before = any(o.req_id.request_id == "x" and o.finish_reason for o in early)
    assert engine.abort_request(RequestKey(0, "x")) is (not finished_before)
    assert engine.abort_request(RequestKey(0, "x")) is False  # idempotent: nothing more happens
    outs = run(engine)
    for o in reversed(early):
        outs.setdefault((o.req_id.request_id, o.index), []).insert(0, o)
    finals = [o for o in outs[("x", 0)] if o.finish_reason is not None]
    assert len(finals) == 1
    expected = FinishReason.LENGTH if finished_before else FinishReason.ABORT
    assert finals[0].finish_reason is expected
    assert tokens(outs[("keep", 0)]) == reference_tokens(prompt(6, 0), 4)
    assert_no_leak(engine, client)


def test_prefix_cache_hit_skips_prefill_of_cached_blocks():
    engine, runner, _client = make_engine()
    shared = prompt(12, 0)
    engine.add_request(RequestKey(0, "a"), [*shared, 50], greedy(2))
    run(engine)
    engine.add_request(RequestKey(0, "b"), [*shared, 60, 61], greedy(2))
    outs = run(engine)
    assert runner.calls[-2][0] == (12, 2)  # 12 cached tokens, only the 2 new ones computed
    assert tokens(outs[("b", 0)]) == reference_tokens([*shared, 60, 61], 2)
    final = outs[("b", 0)][-1]
    assert final.usage is not None and final.usage.cached_prompt_tokens == 12


def test_prefix_caching_off_recomputes_everything():
    engine, runner, _client = make_engine(prefix=False)
    shared = prompt(12, 0)
    engine.add_request(RequestKey(0, "a"), [*shared, 50], greedy(2))
    run(engine)
    engine.add_request(RequestKey(0, "b"), [*shared, 60], greedy(2))
    run(engine)
    assert runner.calls[-2][0] == (0, 13)


def test_parallel_samples_share_the_prompt_and_copy_on_write():
    engine, runner, client = make_engine()
    p = prompt(10, 3)  # 10 tokens: the last prompt block is partial, so samples COW it
    engine.add_request(
        RequestKey(0, "n4"), p, SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    early = engine.step()  # prefill once, then four first tokens from the same logits
    assert runner.calls[0] == [(0, 10)]
    early += engine.step()  # fork + first decode of all four
    stats = client.stats("test")
    # 3 prompt blocks shared by 4 samples; 3 samples got a private copy of the partial block.
    assert stats.counters.num_in_use_blocks == 3 + 3
    assert stats.num_cow_copies == 3 and runner.num_copies == 3
    outs = run(engine)
    for o in reversed(early):
        outs.setdefault((o.req_id.request_id, o.index), []).insert(0, o)
    for i in range(4):
        assert tokens(outs[("n4", i)]) == reference_tokens(p, 6)
        assert sum(o.finish_reason is not None for o in outs[("n4", i)]) == 1
    assert_no_leak(engine, client)


def test_validation_errors_are_refused_before_queueing():
    engine, _, _ = make_engine(max_model_len=32)
    engine.add_request(RequestKey(0, "dup"), [5, 6], greedy(2))
    cases = [
        ("dup", [5], greedy(2), "ALREADY_EXISTS"),
        ("", [5], greedy(2), "INVALID_ARGUMENT"),
        ("e", [], greedy(2), "INVALID_ARGUMENT"),
        ("long", [5] * 32, greedy(2), "INVALID_ARGUMENT"),
        ("vocab", [5, VOCAB], greedy(2), "INVALID_ARGUMENT"),
        ("neg", [5, -1], greedy(2), "INVALID_ARGUMENT"),
        ("temp", [5], SamplingParams(temperature=-1), "INVALID_ARGUMENT"),
    ]
    for req_id, p, params, code in cases:
        with pytest.raises(EngineError) as info:
            engine.add_request(RequestKey(0, req_id), p, params)
        assert info.value.code.value == code, (req_id, info.value)
    assert len(engine.requests) == 1


def test_generation_stops_at_max_model_len_with_length():
    engine, _, client = make_engine(max_model_len=20)
    engine.add_request(RequestKey(0, "r"), prompt(15, 0), greedy(100))
    outs = run(engine)
    assert len(tokens(outs[("r", 0)])) == 5
    assert outs[("r", 0)][-1].finish_reason is FinishReason.LENGTH
    assert_no_leak(engine, client)


def test_random_workload_matches_reference_and_leaks_nothing():
    rng = random.Random(7)
    engine, _runner, client = make_engine(num_blocks=20, budget=24, max_num_seqs=6)
    expected = {}
    got: dict[str, list[int]] = {}
    finals: dict[str, int] = {}
    for step in range(1000):
        if step < 120 and rng.random() < 0.4:
            req_id = f"r{step}"
            p = prompt(rng.randrange(1, 30), step)
            n = rng.randrange(1, 12)
            engine.add_request(RequestKey(0, req_id), p, greedy(n), priority=rng.randrange(3))
            expected[req_id] = reference_tokens(p, n)
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
            finals[o.req_id.request_id] = finals.get(o.req_id.request_id, 0) + (
                o.finish_reason is not None
            )
        if step >= 120 and not engine.has_work:
            break
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert set(finals.values()) == {1}
    assert_no_leak(engine, client)


def test_stop_token_finishes_with_stop_and_reports_the_token():
    engine, _, client = make_engine()
    p = prompt(7, 11)
    ref = reference_tokens(p, 10)
    engine.add_request(
        RequestKey(0, "s"),
        p,
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(ref[3],)),
    )
    outs = run(engine)[("s", 0)]
    assert tokens(outs) == ref[: ref.index(ref[3]) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_token_id == ref[3]
    assert_no_leak(engine, client)


def test_min_tokens_bans_stop_tokens_until_reached():
    engine, _, client = make_engine()
    p = prompt(7, 11)
    ref = reference_tokens(p, 10)
    engine.add_request(
        RequestKey(0, "s"),
        p,
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5, stop_token_ids=(ref[0],)),
    )
    outs = run(engine)[("s", 0)]
    assert tokens(outs)[0] != ref[0]  # banned at the first position
    assert len(tokens(outs)) >= 5
    assert_no_leak(engine, client)


def test_aborting_one_sample_of_n_keeps_the_others_running():
    engine, _, client = make_engine()
    p = prompt(10, 4)
    engine.add_request(
        RequestKey(0, "n3"), p, SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    early = engine.step() + engine.step()
    assert engine.abort_request(RequestKey(0, "n3"), index=1) is True
    assert engine.abort_request(RequestKey(0, "n3"), index=1) is False
    outs = run(engine)
    for o in reversed(early):
        outs.setdefault((o.req_id.request_id, o.index), []).insert(0, o)
    assert outs[("n3", 1)][-1].finish_reason is FinishReason.ABORT
    for i in (0, 2):
        assert tokens(outs[("n3", i)]) == reference_tokens(p, 8)
        assert outs[("n3", i)][-1].finish_reason is FinishReason.LENGTH
    assert_no_leak(engine, client)


def test_chunked_prefill_off_needs_a_budget_of_max_model_len():
    """A preempted sequence returns with prompt + output tokens and must fit one step."""
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(budget=16, chunked=False, max_model_len=128)


@pytest.mark.parametrize("index", [0, 1])
def test_aborting_a_sample_before_its_fork_ends_it_at_the_fork(index):
    engine, _, client = make_engine(budget=4)
    p = prompt(10, 4)  # three chunks of prefill before the fork
    engine.add_request(
        RequestKey(0, "n3"), p, SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    early = engine.step()
    assert engine.abort_request(RequestKey(0, "n3"), index=index) is True
    assert engine.abort_request(RequestKey(0, "n3"), index=index) is False
    outs = run(engine)
    for o in reversed(early):
        outs.setdefault((o.req_id.request_id, o.index), []).insert(0, o)
    finals = {i: [o for o in outs[("n3", i)] if o.finish_reason] for i in range(3)}
    assert all(len(f) == 1 for f in finals.values())
    assert finals[index][0].finish_reason is FinishReason.ABORT
    for i in {0, 1, 2} - {index}:
        assert tokens(outs[("n3", i)]) == reference_tokens(p, 6)
    assert_no_leak(engine, client)


class LosesOneAnswer:
    """A block-manager client whose n-th Step is applied but its answer lost."""

    def __init__(self, inner: InProcessClient, lose_at: int) -> None:
        self.inner, self.lose_at, self.calls = inner, lose_at, 0

    def step(self, pool_id: str, epoch: int, ops: list) -> StepResult:
        self.calls += 1
        result = self.inner.step(pool_id, epoch, ops)
        if self.calls == self.lose_at:
            raise BlockManagerError(ErrorCode.UNAVAILABLE, "answer lost")
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("lose_at", [2, 5, 9, 12])
def test_a_lost_step_answer_is_never_applied_twice(lose_at):
    runner = FakePagedRunner(24, BS)
    client = LosesOneAnswer(InProcessClient(), lose_at)
    settings = EngineSettings(
        max_model_len=128,
        vocab_size=VOCAB,
        eos_token_ids=(2,),
        scheduler=SchedulerConfig(block_size=BS, max_num_batched_tokens=32, watermark_blocks=0),
    )
    engine = Engine(settings, runner, link(client, runner))
    prompts = {f"r{i}": prompt(5 + 3 * i, i) for i in range(4)}
    for req_id, p in prompts.items():
        engine.add_request(RequestKey(0, req_id), p, greedy(12))
    outs = run(engine)
    for req_id, p in prompts.items():
        assert tokens(outs[(req_id, 0)]) == reference_tokens(p, 12)
    assert engine.link.num_recoveries == 1
    assert_no_leak(engine, client.inner)


# ---- distrust of the block manager's answers ---------------------------------------------------


class CorruptsAnswers:
    """A block-manager client whose answers are corrupted by ``corrupt(step_no, result)``
    (after the real block manager applied the Step): a buggy or hostile implementation."""

    def __init__(self, inner: InProcessClient, corrupt) -> None:
        self.inner, self.corrupt, self.calls = inner, corrupt, 0

    def step(self, pool_id: str, epoch: int, ops: list) -> StepResult:
        self.calls += 1
        return self.corrupt(self.calls, self.inner.step(pool_id, epoch, ops))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _steal_a_held_block(result: StepResult) -> StepResult:
    """Hand some admission a block some running sequence already holds."""
    from dataclasses import replace

    from services.blockmgr.api.types import AdmitResult, OpStatus

    results = list(result.results)
    for i, r in enumerate(results):
        if isinstance(r, AdmitResult) and r.status is OpStatus.OK and len(r.block_ids) > 1:
            results[i] = replace(r, block_ids=(r.block_ids[0], r.block_ids[0], *r.block_ids[2:]))
            return replace(result, results=tuple(results))
    return result


def _engine_over(client: Any) -> Engine:
    runner = FakePagedRunner(64, BS)
    settings = EngineSettings(
        max_model_len=128,
        vocab_size=VOCAB,
        eos_token_ids=(2,),
        scheduler=SchedulerConfig(block_size=BS, max_num_batched_tokens=32, watermark_blocks=0),
    )
    return Engine(settings, runner, link(client, runner))


def test_a_contradicting_answer_is_rejected_and_the_pool_rebuilt_without_losing_a_token():
    def corrupt(call: int, result: StepResult) -> StepResult:
        return _steal_a_held_block(result) if call == 3 else result

    client = CorruptsAnswers(InProcessClient(), corrupt)
    engine = _engine_over(client)
    prompts = {f"r{i}": prompt(5 + 3 * i, i) for i in range(6)}
    early: list[SeqOutput] = []
    for i, (req_id, p) in enumerate(prompts.items()):
        engine.add_request(RequestKey(0, req_id), p, greedy(10))
        if i % 2:
            early += engine.step()  # admissions spread over the first steps
    outs = run(engine)
    for o in reversed(early):
        outs.setdefault((o.req_id.request_id, o.index), []).insert(0, o)
    for req_id, p in prompts.items():
        assert tokens(outs[(req_id, 0)]) == reference_tokens(p, 10), req_id
    assert engine.num_bad_answers == 1 and engine.link.num_recoveries == 1
    assert_no_leak(engine, client.inner)


def test_a_request_the_block_manager_keeps_answering_wrongly_fails_alone():
    from dataclasses import replace

    from services.blockmgr.api.types import AdmitResult, OpStatus

    def corrupt(call: int, result: StepResult) -> StepResult:
        # Every admission of seq 1 ("victim") gets an id outside the pool.
        results = tuple(
            replace(r, block_ids=(10_000, *r.block_ids[1:]))
            if isinstance(r, AdmitResult) and r.status is OpStatus.OK and r.num_tokens == 9
            else r
            for r in result.results
        )
        return replace(result, results=results)

    client = CorruptsAnswers(InProcessClient(), corrupt)
    engine = _engine_over(client)
    engine.add_request(RequestKey(0, "victim"), prompt(9, 0), greedy(6))
    others = {f"r{i}": prompt(5 + i, i + 1) for i in range(3)}
    for req_id, p in others.items():
        engine.add_request(RequestKey(0, req_id), p, greedy(6))
    outs = run(engine)
    (final,) = outs[("victim", 0)]
    assert final.finish_reason is FinishReason.ERROR and not final.token_ids
    for req_id, p in others.items():
        assert tokens(outs[(req_id, 0)]) == reference_tokens(p, 6), req_id
    assert engine.num_bad_answers == 2
    assert_no_leak(engine, client.inner)


def test_an_answer_of_the_wrong_shape_is_rejected_not_a_crash():
    from dataclasses import replace

    def corrupt(call: int, result: StepResult) -> StepResult:
        return replace(result, results=result.results[:-1]) if call == 2 else result

    client = CorruptsAnswers(InProcessClient(), corrupt)
    engine = _engine_over(client)
    prompts = {f"r{i}": prompt(6 + i, i) for i in range(3)}
    for req_id, p in prompts.items():
        engine.add_request(RequestKey(0, req_id), p, greedy(5))
    outs = run(engine)
    for req_id, p in prompts.items():
        assert tokens(outs[(req_id, 0)]) == reference_tokens(p, 5), req_id
    assert engine.num_bad_answers == 1
    assert_no_leak(engine, client.inner)


def test_parallel_samples_never_run_more_than_max_num_seqs_at_once():
    """n=4 with max_num_seqs=2: the fork makes as many samples run as fit; the others wait
    and are admitted as slots free up, each still the exact continuation of its first token."""
    engine, runner, client = make_engine(max_num_seqs=2)
    p = prompt(9, 3)
    engine.add_request(
        RequestKey(0, "n4"), p, SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    outs = run(engine)
    assert max(len(call) for call in runner.calls) <= 2  # sequences per forward
    for i in range(4):
        assert tokens(outs[("n4", i)]) == reference_tokens(p, 6), i
        assert sum(o.finish_reason is not None for o in outs[("n4", i)]) == 1
    assert_no_leak(engine, client)


def _burst(hold_back: bool) -> tuple[Engine, dict[tuple[str, int], list[SeqOutput]], dict]:
    """16 requests sharing a 40-token prefix, all arriving in the same step."""
    from dataclasses import replace

    engine, _, client = make_engine(num_blocks=256, max_num_seqs=32, budget=1024)
    engine.scheduler.config = replace(engine.scheduler.config, hold_back_shared_prefixes=hold_back)
    shared = prompt(40, 99)
    prompts = {f"r{i}": [*shared, *prompt(3, i)] for i in range(16)}
    for req_id, p in prompts.items():
        engine.add_request(RequestKey(0, req_id), p, greedy(4))
    outs = run(engine)
    assert_no_leak(engine, client)
    return engine, outs, prompts


def test_a_prefix_shared_within_one_step_is_computed_once():
    held, held_outs, prompts = _burst(hold_back=True)
    eager, eager_outs, _ = _burst(hold_back=False)
    for req_id, p in prompts.items():
        assert (
            tokens(held_outs[(req_id, 0)])
            == reference_tokens(p, 4)
            == tokens(eager_outs[(req_id, 0)])
        )
    # Without holding back, every request computes the 40 shared tokens itself.
    assert eager.num_prompt_tokens == 16 * 43
    assert held.num_prompt_tokens == 43 + 15 * 3  # the prefix once, then only the tails
    assert held.num_cached_prompt_tokens == 15 * 40
