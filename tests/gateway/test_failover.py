"""A stream outlives the executor serving it: after a ``kill -9`` of the executor, the gateway
carries each unfinished sample on from the tokens it already sent, once the executor is back.
Real processes on loopback: a block manager, an executor on a fixed port (killed and started
again there) and gateways in front of it.

- greedy and seeded (n = 2, temperature 0.8) streams come out identical to fault-free runs,
  with the original usage, and the resume is counted and logged;
- a gateway with ``--max-resumes 0`` fails its stream UNAVAILABLE instead;
- while no executor serves, a client deadline still ends its stream (DEADLINE_EXCEEDED), and
  a gateway whose ``--executor-wait-s`` passes fails it UNAVAILABLE; nothing is left open.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest

from pagedserve.testing.procs import (
    ServiceProcess,
    gateway_args,
    wait_serving,
    wait_until,
)
from pagedserve.v1 import generation_pb2 as G
from pagedserve.v1 import generation_pb2_grpc
from tests.gateway.conftest import stack_executor_args

# A restarted executor takes its block-manager pool back at once with the owner token derived
# from the internal token (without one it waits for the dead one's lease to expire).
ENV = {"PAGEDSERVE_INTERNAL_TOKEN": "failover-test-token"}
PROMPT = "Paged attention keeps the cache in blocks, and the gateway keeps the stream"
MAX_TOKENS = 300  # long enough to be mid-stream when the executor is killed
# The client deadline of the stream that meets the outage: it must be streaming (first token
# in) before the kill, on a loaded machine too; the deadline then passes while it waits.
DEADLINE_S = 10.0


def _metrics(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("pagedserve_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _settled(port: int) -> dict[str, float] | None:
    """The gateway's metrics once it has no stream open; None while it has."""
    metrics = _metrics(port)
    return metrics if metrics["pagedserve_gateway_requests_inflight"] == 0 else None


class Executor:
    """The executor on a fixed port, killed and started again there. (The port is the one it
    bound first: a port found free beforehand may be taken by then on a busy machine.)"""

    def __init__(self, model: Path, blockmgr: str) -> None:
        self.args = stack_executor_args(model, "--blockmgr-address", blockmgr, "--pool-id", "fo")
        self.proc = self.start()
        assert self.proc.port is not None
        self.port = self.proc.port
        self.args[self.args.index("--port") + 1] = str(self.port)

    def start(self) -> ServiceProcess:
        self.proc = ServiceProcess(self.args, "executor_ready", env=ENV)
        return self.proc

    def kill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)
        self.proc.proc.wait(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _gateway(model: Path, executor: str, *extra: str) -> tuple[ServiceProcess, int]:
    """A gateway (metrics on a free port, HTTP off unless ``extra`` says) and its metrics
    port."""
    # (flags given twice: the last wins)
    args = gateway_args(model, executor, "--metrics-port", "0", "--http-port", "-1", *extra)
    gw = ServiceProcess([*args, "--max-n", "4"], "gateway_listening", env=ENV)
    return gw, int(gw.wait_for_event("metrics_listening")["metrics_port"])


@dataclass
class Stream:
    """One Generate stream read on its own thread: tokens per sample, the final message per
    sample, and how it ended (``ended_at``: ``time.monotonic()``). ``first`` is set once its
    first token is in, or once it has ended."""

    request: G.GenerateRequest
    timeout: float = 60.0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finals: dict[int, G.GenerateResponse] = field(default_factory=dict)
    code: grpc.StatusCode | None = None
    details: str = ""
    ended_after_s: float = 0.0
    ended_at: float = 0.0
    first: threading.Event = field(default_factory=threading.Event)

    def run(self, address: str) -> threading.Thread:
        def read() -> None:
            t0 = time.monotonic()
            stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
            try:
                for r in stub.Generate(self.request, timeout=self.timeout):
                    self.tokens.setdefault(r.index, []).extend(r.token_ids)
                    self.text[r.index] = self.text.get(r.index, "") + r.text
                    if r.finish_reason:
                        self.finals[r.index] = r
                    self.first.set()
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code, self.details = exc.code(), exc.details() or ""
            self.ended_at = time.monotonic()
            self.ended_after_s = self.ended_at - t0
            self.first.set()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        return t


@dataclass
class HttpStream:
    """One streamed OpenAI completion (greedy) read on its own thread."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    first: threading.Event = field(default_factory=threading.Event)

    def run(self, port: int, model: str) -> threading.Thread:
        def read() -> None:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            try:
                for chunk in client.completions.create(
                    model=model,
                    prompt=PROMPT + " over HTTP",
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    self.text += chunk.choices[0].text
                    self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
                    self.first.set()
            except openai.OpenAIError as exc:
                self.error = repr(exc)
            self.first.set()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        return t


def _greedy(seed_prompt: str = PROMPT) -> G.GenerateRequest:
    return G.GenerateRequest(
        prompt=seed_prompt,
        sampling_params=G.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )


def _seeded() -> G.GenerateRequest:
    return G.GenerateRequest(
        prompt=PROMPT + " for every sample",
        sampling_params=G.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.8, seed=1234, n=2, ignore_eos=True
        ),
    )


@dataclass
class KillRun:
    reference: dict[str, Stream]
    faulted: dict[str, Stream]
    http: tuple[HttpStream, HttpStream]  # fault-free, faulted
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    gateway: ServiceProcess


@pytest.fixture(scope="module")
def blockmgr() -> Iterator[ServiceProcess]:
    bm = ServiceProcess(["blockmgr", "--port", "0"], "blockmgr_listening", env=ENV)
    yield bm
    bm.stop()


@pytest.fixture(scope="module")
def kill_run(tiny_model_dir: Path, blockmgr: ServiceProcess) -> Iterator[KillRun]:
    """Greedy and seeded streams, fault-free, then again with the executor killed once their
    first tokens are out and started again at once; a second gateway (``--max-resumes 0``)
    streams through the same executor at the same time."""
    executor = Executor(tiny_model_dir, blockmgr.address)
    gw, metrics_port = _gateway(
        tiny_model_dir, executor.address, "--executor-wait-s", "60", "--http-port", "0"
    )
    http_port = int(gw.wait_for_event("http_listening")["http_port"])
    model = tiny_model_dir.name
    strict, _ = _gateway(tiny_model_dir, executor.address, "--max-resumes", "0")
    try:
        wait_serving(gw.address)
        wait_serving(strict.address)
        reference = {"greedy": Stream(_greedy()), "seeded": Stream(_seeded())}
        for s in reference.values():
            s.run(gw.address).join(60)
        http = (HttpStream(), HttpStream())
        http[0].run(http_port, model).join(60)
        before = _metrics(metrics_port)
        faulted = {
            "greedy": Stream(_greedy()),
            "seeded": Stream(_seeded()),
            "strict": Stream(_greedy()),
        }
        threads = [faulted["greedy"].run(gw.address), faulted["seeded"].run(gw.address)]
        threads.append(faulted["strict"].run(strict.address))
        threads.append(http[1].run(http_port, model))
        for s in (*faulted.values(), http[1]):
            assert s.first.wait(30)
        executor.kill()
        executor.start()
        for t in threads:
            t.join(90)
        yield KillRun(reference, faulted, http, before, _metrics(metrics_port), gw)
    finally:
        strict.stop()
        gw.stop()
        executor.proc.stop()


def test_greedy_stream_survives_an_executor_kill_token_for_token(kill_run: KillRun):
    ref, got = kill_run.reference["greedy"], kill_run.faulted["greedy"]
    assert ref.code == got.code == grpc.StatusCode.OK, got.details
    assert len(ref.tokens[0]) == MAX_TOKENS
    # The kill landed mid-stream: the stream was resumed, not finished before it.
    resumed = [r for r in kill_run.gateway.lines if r.get("event") == "request_resumed"]
    assert resumed and all(sum(r["tokens_sent"]) > 0 for r in resumed)
    assert got.tokens == ref.tokens
    assert got.text == ref.text


def test_seeded_samples_survive_an_executor_kill_draw_for_draw(kill_run: KillRun):
    ref, got = kill_run.reference["seeded"], kill_run.faulted["seeded"]
    assert ref.code == got.code == grpc.StatusCode.OK, got.details
    assert ref.tokens[0] != ref.tokens[1]
    assert got.tokens == ref.tokens
    assert got.text == ref.text


def test_resumed_usage_counts_the_original_prompt_and_every_token(kill_run: KillRun):
    for name in ("greedy", "seeded"):
        ref, got = kill_run.reference[name], kill_run.faulted[name]
        for index, final in got.finals.items():
            assert final.usage.prompt_tokens == ref.finals[index].usage.prompt_tokens
            assert final.usage.completion_tokens == MAX_TOKENS
            assert final.usage.cached_prompt_tokens <= final.usage.prompt_tokens


def test_resumes_are_counted_and_the_stream_is_not_failed(kill_run: KillRun):
    before, after = kill_run.metrics_before, kill_run.metrics_after
    key = 'pagedserve_requests_resumed_total{reason="executor_lost"}'
    assert after.get(key, 0) - before.get(key, 0) == 3  # greedy, seeded and HTTP streams
    ok = 'pagedserve_requests_total{outcome="length"}'
    assert after[ok] - before.get(ok, 0) == 3
    assert after["pagedserve_gateway_requests_inflight"] == 0


def test_an_http_stream_survives_an_executor_kill_as_well(kill_run: KillRun):
    ref, got = kill_run.http
    assert ref.error is None and got.error is None, got.error
    assert got.finish_reason == ref.finish_reason == "length"
    assert got.text == ref.text and ref.text


def test_a_gateway_with_max_resumes_0_fails_the_stream_unavailable(kill_run: KillRun):
    strict = kill_run.faulted["strict"]
    assert strict.code == grpc.StatusCode.UNAVAILABLE, strict.details
    assert 0 < len(strict.tokens.get(0, [])) < MAX_TOKENS


def test_while_no_executor_serves_deadlines_hold_and_the_wait_ends_unavailable(
    tiny_model_dir: Path, blockmgr: ServiceProcess
):
    executor = Executor(tiny_model_dir, blockmgr.address)
    patient, patient_metrics = _gateway(tiny_model_dir, executor.address)
    brief, brief_metrics = _gateway(tiny_model_dir, executor.address, "--executor-wait-s", "1")
    try:
        wait_serving(patient.address)
        wait_serving(brief.address)
        deadline = Stream(_greedy(), timeout=DEADLINE_S)
        waits = Stream(_greedy())
        threads = [deadline.run(patient.address), waits.run(brief.address)]
        assert deadline.first.wait(DEADLINE_S) and waits.first.wait(60)
        killed_at = time.monotonic()
        executor.kill()
        # Both were streaming when the executor went: the outage, not the kill, ended them.
        assert deadline.tokens and waits.tokens, (deadline.details, waits.details)
        for t in threads:
            t.join(60)
        assert deadline.code == grpc.StatusCode.DEADLINE_EXCEEDED, deadline.details
        assert 0 < len(deadline.tokens[0]) < MAX_TOKENS
        assert waits.code == grpc.StatusCode.UNAVAILABLE, waits.details
        assert "--executor-wait-s" in waits.details  # its wait ran out, not its client's 60 s
        assert waits.ended_at - killed_at >= 1.0
        # Nothing left open. The patient gateway frees its stream when gRPC cancels the
        # handler, which it learns of only after the client's own deadline timer gave the
        # client its status: wait for it (tests/gateway/test_cancel_while_waiting.py).
        for port, outcome in ((patient_metrics, "cancelled"), (brief_metrics, "unavailable")):
            settled = wait_until(
                functools.partial(_settled, port), what=f"no stream open on gateway :{port}"
            )
            assert settled[f'pagedserve_requests_total{{outcome="{outcome}"}}'] == 1
        # Back again: both gateways serve, and the block manager holds no block of theirs.
        executor.start()
        for gw in (patient, brief):
            wait_serving(gw.address, timeout=60)
            again = Stream(_greedy(), timeout=60)
            again.run(gw.address).join(60)
            assert again.code == grpc.StatusCode.OK and len(again.tokens[0]) == MAX_TOKENS
    finally:
        brief.stop()
        patient.stop()
        executor.proc.stop()
