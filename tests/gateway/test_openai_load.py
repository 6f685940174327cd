"""The HTTP front of the real gateway under the load of benchmark tools, driven by ``httpx``:
clients that leave (before their first token, mid-stream, or while waiting for a whole
completion) free their request at once, on the gateway and on the executor; hundreds of
concurrent streams are queued, not refused, with the default flags.

The shared stack's executor runs at most 64 sequences (``--max-num-seqs``) in 256 KV blocks,
so most of 512 streams wait on the executor for their first token."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx

from pagedserve.testing.procs import wait_serving
from tests.gateway.conftest import Stack

NUM_STREAMS = 512  # guidellm's throughput profile
PROMPT = "go on"
# About a second of decoding on an idle executor: far longer than noticing a hang-up takes.
LONG = {"prompt": PROMPT, "max_tokens": 500, "n": 4, "temperature": 0, "ignore_eos": True}


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    """A metric of the gateway's Prometheus ``/metrics``, its labelled samples summed (0 for
    a labelled metric with no sample yet)."""
    text = (await client.get("/metrics")).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    )


async def _inflight(client: httpx.AsyncClient) -> float:
    return await _metric(client, "pagedserve_gateway_requests_inflight")


def _cancelled(port: int) -> float:
    """Requests counted as cancelled by the gateway on ``port``."""
    text = httpx.get(f"{_url(port)}/metrics").text
    for line in text.splitlines():
        if line.startswith('pagedserve_requests_total{outcome="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


async def _until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll ``check`` until it holds; seconds it took. Fails after ``timeout``."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not within {timeout} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def _wait_blocks_free(stack: Stack, deadline: float) -> int:
    """KV blocks still in use on the block manager at ``deadline`` (monotonic) at the latest."""
    while (n := stack.blocks_in_use()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def _model(stack: Stack) -> str:
    return stack.model_dir.name


def _stream_body(stack: Stack) -> dict[str, object]:
    return {
        "model": _model(stack),
        "prompt": PROMPT,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def _hang_up_a_whole_completion(stack: Stack, port: int, api_key: str | None = None) -> None:
    """Send a long non-streaming completion to the gateway on ``port``, hang up once it runs,
    and check it is released, aborted (not run to its end) and its KV blocks freed within a
    second."""
    body = {"model": _model(stack), **LONG}
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def scenario() -> float:
        async with (
            httpx.AsyncClient(base_url=_url(port), timeout=60) as metrics,
            httpx.AsyncClient(base_url=_url(port), timeout=60, headers=headers) as caller,
        ):
            assert await _inflight(metrics) == 0
            request = asyncio.create_task(caller.post("/v1/completions", json=body))

            async def running() -> bool:
                return await _inflight(metrics) == 1

            await _until(running, 10, "the request in flight")
            request.cancel()  # hang up: httpx closes the connection
            await asyncio.gather(request, return_exceptions=True)
            left = time.monotonic()

            async def released() -> bool:
                return await _inflight(metrics) == 0

            await _until(released, 1.0, "the request released after its client left")
            return left

    before = _cancelled(port)
    left = asyncio.run(scenario())
    assert _wait_blocks_free(stack, left + 1.0) == 0
    assert _cancelled(port) == before + 1  # aborted, not run to its end


def test_a_non_streaming_client_that_disconnects_aborts_its_request_within_a_second(
    stack: Stack,
) -> None:
    _hang_up_a_whole_completion(stack, stack.http_port)


def test_behind_the_api_key_check_a_disconnect_still_aborts_the_request(stack: Stack) -> None:
    gw = stack.start_gateway("--api-key", "sesame")
    try:
        wait_serving(gw.address)
        port = int(gw.wait_for_event("http_listening")["http_port"])
        assert httpx.post(f"{_url(port)}/v1/completions", json={}).status_code == 401
        _hang_up_a_whole_completion(stack, port, api_key="sesame")
    finally:
        assert gw.stop() == 0


def test_512_streams_that_leave_before_or_after_their_first_token_free_everything_within_1s(
    stack: Stack,
) -> None:
    body = {**_stream_body(stack), "max_tokens": 400}
    first_token = [False] * NUM_STREAMS
    statuses: list[int] = []

    async def hold_stream(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    first_token[i] = True
                    await asyncio.Event().wait()  # read no more; the test hangs up

    async def scenario() -> float:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(base_url=_url(stack.http_port), timeout=120) as metrics,
            httpx.AsyncClient(
                base_url=_url(stack.http_port), timeout=120, limits=limits
            ) as streams,
        ):
            routed = await _metric(metrics, "pagedserve_routed_requests_total")
            tasks = [asyncio.create_task(hold_stream(streams, i)) for i in range(NUM_STREAMS)]

            async def all_on_the_executor() -> bool:
                now = await _metric(metrics, "pagedserve_routed_requests_total")
                return now - routed == NUM_STREAMS and any(first_token)

            await _until(all_on_the_executor, 60, f"{NUM_STREAMS} streams sent to the executor")
            started = sum(first_token)
            assert 0 < started < NUM_STREAMS  # both kinds: mid-stream and not started
            for t in tasks:
                t.cancel()  # every client hangs up at once
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results), results[:3]
            left = time.monotonic()

            async def released() -> bool:
                return await _inflight(metrics) == 0

            await _until(released, 1.0, "every slot released after its client left")
            return left

    left = asyncio.run(scenario())
    assert _wait_blocks_free(stack, left + 1.0) == 0
    assert set(statuses) <= {200}


def test_512_concurrent_streams_all_succeed_with_the_default_flags(stack: Stack) -> None:
    body = {**_stream_body(stack), "max_tokens": 4}

    async def one_stream(client: httpx.AsyncClient) -> tuple[int, list[bytes]]:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line]

    async def scenario() -> list[tuple[int, list[bytes]]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=_url(stack.http_port), timeout=120, limits=limits
        ) as client:
            return await asyncio.gather(*(one_stream(client) for _ in range(NUM_STREAMS)))

    results = asyncio.run(scenario())
    assert [status for status, _ in results] == [200] * NUM_STREAMS
    for _, lines in results:
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "error" not in chunks[-1]
    assert stack.wait_blocks_free() == 0
