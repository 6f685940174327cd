"""The gateway's admission (services/gateway/core/admission.py): run, queue first come first
served, then refuse; cancelled waiters give up their place and never lose a slot."""

from __future__ import annotations

import asyncio

import pytest

from services.executor.service.config import ExecutorConfig
from services.gateway.core.admission import Admission
from services.gateway.service.config import GatewayConfig


async def _hold(admission: Admission, name: str, order: list[str], release: asyncio.Event) -> None:
    assert admission.try_enter()
    try:
        async with admission.running():
            order.append(name)
            await release.wait()
    finally:
        admission.leave()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_beyond_the_running_limit_queue_in_order_then_are_refused() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=2, max_queued=2)
        order: list[str] = []
        gates = {name: asyncio.Event() for name in "abcd"}
        tasks = {n: asyncio.create_task(_hold(admission, n, order, g)) for n, g in gates.items()}
        await _settle()
        assert order == ["a", "b"] and admission.num_queued == 2 and admission.num_open == 4
        assert not admission.try_enter()  # 2 running + 2 queued: the fifth is refused
        gates["b"].set()
        gates["c"].set()
        await _settle()
        assert order == ["a", "b", "c", "d"]  # c took b's slot first, then d took c's
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*tasks.values())
        assert (admission.num_open, admission.num_running, admission.num_queued) == (0, 0, 0)

    asyncio.run(scenario())


def test_a_cancelled_waiter_gives_up_its_place_and_no_slot_is_lost() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_queued=3)
        order: list[str] = []
        gates = {name: asyncio.Event() for name in "abc"}
        tasks = {n: asyncio.create_task(_hold(admission, n, order, g)) for n, g in gates.items()}
        await _settle()
        tasks["b"].cancel()  # its client left while it waited
        await _settle()
        assert admission.num_queued == 1 and admission.num_open == 2
        gates["a"].set()
        await _settle()
        assert order == ["a", "c"]
        # A slot handed over just as its new owner is cancelled passes on to the next one.
        late = asyncio.create_task(_hold(admission, "d", order, asyncio.Event()))
        last = asyncio.create_task(_hold(admission, "e", order, asyncio.Event()))
        await _settle()
        gates["c"].set()
        await asyncio.sleep(0)  # c ends and hands its slot to d, which has not resumed yet
        assert order == ["a", "c"] and admission.num_queued == 1
        late.cancel()  # d's client leaves right then
        await _settle()
        assert order == ["a", "c", "e"] and admission.num_running == 1
        last.cancel()
        with pytest.raises(asyncio.CancelledError):
            await last
        await asyncio.gather(*tasks.values(), late, return_exceptions=True)
        assert (admission.num_open, admission.num_running, admission.num_queued) == (0, 0, 0)

    asyncio.run(scenario())


def test_the_defaults_send_what_one_executor_accepts_and_queue_the_rest() -> None:
    gateway = GatewayConfig.from_args(["--model", "m"])
    # Never more single-sample requests than one executor holds for a gateway by default...
    assert gateway.max_concurrent_requests <= ExecutorConfig.max_seqs_per_session
    # ...and room for what benchmark tools open at once (guidellm: 512, vLLM's bench: 1000).
    assert gateway.max_concurrent_requests + gateway.max_queued_requests >= 4096


def test_a_negative_queue_bound_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--model", "m", "--max-queued-requests", "-1"])
    assert "--max-queued-requests" in capsys.readouterr().err
