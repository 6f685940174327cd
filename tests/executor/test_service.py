"""The executor as a real process, with the block manager as another, over gRPC on loopback."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.testing.procs import ServiceProcess, wait_until
from pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from services.blockmgr.client import GrpcClient
from services.common.healthcheck import check

INVALID = executor_pb2.REQUEST_ERROR_CODE_INVALID_ARGUMENT

POOL = "exec-test"


class SessionClient:
    """A gateway-side Session stream driven from a queue."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        stub = executor_pb2_grpc.ExecutorStub(channel)
        self.call = stub.Session(iter(self._out.get, None))

    def add(self, request_id: str, prompt: list[int], **params) -> None:
        params.setdefault("n", 1)
        params.setdefault("top_p", 1.0)
        params.setdefault("repetition_penalty", 1.0)
        self._out.put(
            executor_pb2.SessionRequest(
                add=executor_pb2.AddRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling_params=executor_pb2.ExecutorSamplingParams(**params),
                )
            )
        )

    def abort(self, request_id: str) -> None:
        self._out.put(
            executor_pb2.SessionRequest(abort=executor_pb2.AbortRequest(request_id=request_id))
        )

    def half_close(self) -> None:
        self._out.put(None)

    def collect(self, until_done: set[str]):
        tokens: dict[str, list[int]] = {}
        finals: dict[str, executor_pb2.SequenceUpdate] = {}
        errors: dict[str, executor_pb2.RequestError] = {}
        for step in self.call:
            for e in step.errors:
                errors[e.request_id] = e
            for u in step.updates:
                tokens.setdefault(u.request_id, []).extend(u.token_ids)
                if u.finish_reason:
                    finals[u.request_id] = u
            if until_done <= set(finals) | set(errors):
                break
        return tokens, finals, errors


@pytest.fixture(scope="module")
def stack(tiny_checkpoint) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    executor = ServiceProcess(
        [
            "executor",
            "--model",
            str(tiny_checkpoint("llama")),
            "--port",
            "0",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "256",
            "--dtype",
            "float32",
            "--blockmgr-address",
            blockmgr.address,
            "--pool-id",
            POOL,
        ],
        "executor_ready",
    )
    yield blockmgr, executor
    assert executor.stop() == 0
    assert "executor_stopped" in executor.events()
    blockmgr.stop()


@pytest.fixture
def channel(stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack[1].address) as ch:
        yield ch


def _greedy(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens}


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model("llama").generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _blocks_in_use(stack) -> int:
    client = GrpcClient(stack[0].address)
    try:
        return client.stats(POOL).counters.num_in_use_blocks
    finally:
        client.close()


def test_health_is_serving_and_info_describes_the_model(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "pagedserve.v1.Executor"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    info = executor_pb2_grpc.ExecutorStub(channel).Info(
        executor_pb2.ExecutorInfoRequest(), timeout=5
    )
    assert (info.max_model_len, info.block_size, info.num_kv_blocks) == (256, 16, 64)
    assert info.vocab_size == 621 and list(info.eos_token_ids) == [2]
    assert info.kv_capacity_tokens == 63 * 16 and info.hash_algorithm == "sha256-chain-v1"
    assert info.dtype == "float32" and info.model_name == "llama"


def test_session_streams_greedy_tokens_identical_to_transformers(channel, hf_model):
    session = SessionClient(channel)
    prompts = {"a": [1, 40, 41, 42], "b": [1, *range(100, 140)], "c": [1, 7]}
    for rid, p in prompts.items():
        session.add(rid, p, **_greedy(12))
    tokens, finals, errors = session.collect(set(prompts))
    assert not errors
    for rid, p in prompts.items():
        assert tokens[rid] == _hf_greedy(hf_model, p, 12)
        u = finals[rid].usage
        assert (u.prompt_tokens, u.completion_tokens) == (len(p), len(tokens[rid]))
    session.half_close()
    rest = list(session.call)  # the stream ends once its requests are done
    # ... after at most the idle engine's final load, which shows every block free again.
    assert all(not step.updates and not step.errors for step in rest)
    if rest:
        assert rest[-1].load.num_free_blocks == rest[-1].load.num_usable_blocks


def test_refused_requests_get_a_status_naming_the_field(channel):
    session = SessionClient(channel)
    session.add("ok", [1, 5], **_greedy(30))
    session.add("ok", [1, 5], **_greedy(3))
    session.add("long", [1] * 300, **_greedy(3))
    session.add("vocab", [1, 621], **_greedy(3))
    session.add("temp", [1, 5], temperature=-1.0, max_tokens=3)
    session.add("", [1, 5], **_greedy(3))
    _, _, errors = session.collect({"ok", "long", "vocab", "temp", ""})
    assert errors["ok"].code == executor_pb2.REQUEST_ERROR_CODE_ALREADY_EXISTS
    assert errors["long"].code == INVALID and "max_model_len" in errors["long"].message
    assert errors["vocab"].code == INVALID and "vocabulary" in errors["vocab"].message
    assert "temperature" in errors["temp"].message
    assert "request_id" in errors[""].message


def test_abort_mid_stream_ends_with_abort_and_frees_blocks(channel, stack):
    session = SessionClient(channel)
    session.add("long", [1, *range(10, 60)], temperature=0.0, max_tokens=200, ignore_eos=True)
    for step in session.call:
        if any(u.token_ids for u in step.updates):
            break
    session.abort("long")
    session.abort("long")  # idempotent
    _, finals, _ = session.collect({"long"})
    assert finals["long"].finish_reason == common_pb2.FINISH_REASON_ABORT
    # Freed by the executor's step after the abort (just after the final went out).
    wait_until(lambda: _blocks_in_use(stack) == 0, what="the aborted request's blocks freed")


def test_dropped_stream_aborts_its_requests_and_frees_their_blocks(stack):
    channel = grpc.insecure_channel(stack[1].address)
    session = SessionClient(channel)
    for i in range(4):
        session.add(f"r{i}", [1, *range(20, 70)], temperature=0.0, max_tokens=200, ignore_eos=True)
    for step in session.call:
        if step.updates:
            break
    assert _blocks_in_use(stack) > 0
    session.call.cancel()
    channel.close()
    wait_until(lambda: _blocks_in_use(stack) == 0, what="the dropped stream's blocks freed")


def test_block_manager_outage_turns_not_serving_then_recovers_without_losing_tokens(
    tiny_checkpoint, hf_model
):
    blockmgr = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening")
    port = blockmgr.port
    executor = ServiceProcess(
        [
            "executor",
            "--model",
            str(tiny_checkpoint("llama")),
            "--port",
            "0",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "256",
            "--dtype",
            "float32",
            "--blockmgr-address",
            blockmgr.address,
        ],
        "executor_ready",
    )
    try:
        with grpc.insecure_channel(executor.address) as channel:
            session = SessionClient(channel)
            prompt = [1, *range(30, 60)]
            session.add("r", prompt, temperature=0.0, max_tokens=150)
            tokens: list[int] = []
            for step in session.call:
                tokens += [t for u in step.updates for t in u.token_ids]
                if len(tokens) >= 5:
                    break
            blockmgr.stop()
            wait_until(
                lambda: check(executor.address)[1] == "NOT_SERVING", what="the executor NOT_SERVING"
            )
            blockmgr = ServiceProcess(["blockmgr", "--port", str(port)], "blockmgr_listening")
            rest, finals, _ = session.collect({"r"})
            tokens += rest.get("r", [])
            assert finals["r"].finish_reason in (
                common_pb2.FINISH_REASON_LENGTH,
                common_pb2.FINISH_REASON_STOP,
            )
            assert tokens == _hf_greedy(hf_model, prompt, 150)
            assert check(executor.address) == (True, "SERVING")
            assert "blockmgr_restored" in executor.events()
    finally:
        executor.stop()
        blockmgr.stop()


def test_every_sample_of_an_n_request_gets_its_final_update(channel):
    """The samples of one request finish in the same step: each must still be delivered."""
    session = SessionClient(channel)
    session.add(
        "n3", [1, 300, 301, 302], n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True
    )
    finals: dict[int, executor_pb2.SequenceUpdate] = {}
    counts = {0: 0, 1: 0, 2: 0}
    for step in session.call:
        for u in step.updates:
            counts[u.index] += len(u.token_ids)
            if u.finish_reason:
                finals[u.index] = u
        if len(finals) == 3:
            break
    assert counts == {0: 6, 1: 6, 2: 6}
    assert all(f.finish_reason == common_pb2.FINISH_REASON_LENGTH for f in finals.values())
    assert all(f.usage.completion_tokens == 6 for f in finals.values())


def test_refusal_is_delivered_even_when_the_stream_half_closes_at_once(channel):
    session = SessionClient(channel)
    session.add("too-long", [1] * 300, temperature=0.0, max_tokens=3)
    session.half_close()
    steps = list(session.call)  # ends once nothing is running
    errors = [e for step in steps for e in step.errors]
    assert [e.request_id for e in errors] == ["too-long"]
    assert errors[0].code == INVALID
