"""Carrying a request on when its executor is lost mid-stream.

The gateway holds all a resumption needs: the prompt, every token each sample has sent, the
sampling parameters, and the detokenizer and stop-string state (in each
:class:`SampleStream`, which simply goes on). A request on an executor is an
:class:`Placement`: the executor-side requests sent there, each standing for some samples of
the client's request. When the executor is lost, :func:`resume_adds` builds the next
placement's requests:

- nothing sent yet: the original request again (all its samples, its prompt log-probs);
- otherwise one ``n = 1`` request per unfinished sample, carrying the tokens it already sent
  as ``resume.output_token_ids``: the executor recomputes them like a preempted sequence's
  (max_tokens, min_tokens and the penalties count them; its seeded draws are addressed by
  (seed, sample index, output position), so they come out as they would have), and streams
  only what follows. Finished samples stay finished.

Usage stays the client's: the original prompt, the tokens sent; cached prompt tokens as the
first executor reported them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.v1 import executor_pb2
from services.gateway.core.sample_stream import SampleStream
from services.gateway.fleet.executor_client import (
    ExecutorConnection,
    ExecutorPool,
    ExecutorUnavailable,
    Tagged,
)
from services.gateway.fleet.routing import Decision

Accept = Callable[[ExecutorConnection], bool]


@dataclass
class Placement:
    """Where a request runs now: ``conn``, and per executor-side request id the original
    sample index of each of its update indexes."""

    conn: ExecutorConnection
    decision: Decision  # why the router chose it
    samples: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def route(
        cls,
        pool: ExecutorPool,
        adds: list[tuple[executor_pb2.AddRequest, list[int]]],
        queue: asyncio.Queue[Tagged],
        accept: Accept | None,
    ) -> tuple[Placement, int]:
        """Send ``adds`` (one request's executor-side requests) to the executor the pool
        picks (of those ``accept`` takes) for the longest token sequence among them; the
        placement, and that length. Raises :class:`ExecutorUnavailable`."""
        first = max(
            (add for add, _ in adds),
            key=lambda add: len(add.prompt_token_ids) + len(add.resume.output_token_ids),
        )
        tokens = [*first.prompt_token_ids, *first.resume.output_token_ids]
        conn, decision = pool.pick(tokens, first.cache_salt, accept, first.lora_name)
        placement = cls(conn, decision)
        for add, indexes in adds:
            conn.submit(add, queue)
            placement.samples[add.request_id] = indexes
        return placement, len(tokens)

    def sample_of(self, request_id: str, index: int) -> int | None:
        """The original sample an update is for; None for a request of an earlier placement
        (its executor was given up) or an index it does not have."""
        indexes = self.samples.get(request_id)
        return indexes[index] if indexes is not None and index < len(indexes) else None

    def stop_sample(self, sample: int) -> None:
        """Stop one sample there (a stop string ended it); the others go on."""
        for request_id, indexes in self.samples.items():
            if sample in indexes:
                if len(indexes) > 1:
                    self.conn.abort_sample(request_id, indexes.index(sample))
                else:
                    self.conn.release(request_id, abort=True)
                return

    def sample_done(
        self, request_id: str, sample: int, samples: Sequence[SampleStream], *, abort: bool
    ) -> None:
        """Sample ``sample`` (of ``request_id``) has its final message (``abort``: a stop
        string ended it, the executor may still run it): once every sample of that
        executor-side request has, it is forgotten at once, not with the whole request (its
        load would count on)."""
        indexes = self.samples.get(request_id)
        if indexes is not None and all(samples[i].done for i in indexes):
            del self.samples[request_id]
            self.conn.release(request_id, abort=abort)

    def release(self, *, abort: bool) -> None:
        """Forget every request of this placement (``abort``: stop them there too)."""
        for request_id in self.samples:
            self.conn.release(request_id, abort=abort)


def resume_adds(
    original: executor_pb2.AddRequest, samples: Sequence[SampleStream]
) -> list[tuple[executor_pb2.AddRequest, list[int]]]:
    """The requests that carry ``original`` on from where its samples stand, each with the
    original sample index of its update indexes (new executor-side ids; see the module)."""
    if not any(s.token_ids or s.done for s in samples):
        again = executor_pb2.AddRequest()
        again.CopyFrom(original)
        again.request_id = uuid.uuid4().hex
        return [(again, [s.index for s in samples])]
    adds = []
    for s in samples:
        if s.done:
            continue
        add = executor_pb2.AddRequest()
        add.CopyFrom(original)
        add.request_id = uuid.uuid4().hex
        add.sampling_params.n = 1
        if s.token_ids or s.index:  # sent with sample 0's first token, or not this sample's
            add.sampling_params.ClearField("prompt_logprobs")
        add.resume.SetInParent()
        add.resume.sample_index = s.index
        add.resume.output_token_ids[:] = s.token_ids
        adds.append((add, [s.index]))
    return adds


def resumes_samples(conn: ExecutorConnection) -> bool:
    """An executor that carries a sample on from its output tokens (``ResumeSample``): one
    that predates it would start the sample over."""
    return conn.info is not None and conn.info.resumes_samples


def executors_for(adds: list[tuple[executor_pb2.AddRequest, list[int]]]) -> Accept | None:
    """The executors that can take ``adds``: any for the original request sent again, only
    those that resume samples otherwise."""
    return resumes_samples if any(add.HasField("resume") for add, _ in adds) else None


async def place_again(
    pool: ExecutorPool,
    lost: ExecutorUnavailable,
    wait_s: float,
    accept: Accept | None,
    place: Callable[[], Placement],
) -> Placement | None:
    """``place()`` on a ready executor ``accept`` takes, waiting for one until ``wait_s``
    after the loss; None when the wait runs out."""
    while await pool.wait_ready(wait_s - (time.monotonic() - lost.since), accept):
        try:
            return place()
        except ExecutorUnavailable:
            continue  # it went away again between the wait and the pick
    return None


def unavailable_message(lost: ExecutorUnavailable, wait_s: float) -> str:
    if lost.reason == "executor_not_serving":
        return f"{lost}, and no other executor serves; retry later"
    return f"{lost}; no executor served again within {wait_s:g} s (--executor-wait-s); retry later"
