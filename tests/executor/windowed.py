"""Shared by the sliding-window and hybrid pool tests: a workload several windows long with
transformers' answers, an engine over a tiny checkpoint, a run that checks every sequence's
tables after every step, and a block manager restarted mid-run."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from pagedserve.testing.procs import wait_until
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.client import GrpcClient, InProcessClient
from services.blockmgr.service.config import BlockManagerServiceConfig
from services.common.sampling_params import SamplingParams
from services.executor.core.engine import Engine
from services.executor.core.sequence import RequestKey, Sequence
from services.executor.model.launch import build_runner
from services.executor.service.config import ExecutorConfig
from services.executor.service.startup import build_engine
from tests.blockmgr.helpers import ThreadedServer

from .conftest import CheckpointFactory

Workload = list[tuple[list[int], int, list[int]]]


def windowed_workload(
    model: PreTrainedModel, *, seed: int, num_requests: int, bos: int, max_tokens: tuple[int, int]
) -> Workload:
    """``num_requests`` requests, prompts 20-60 tokens (half sharing a 24-token prefix), new
    tokens drawn from ``range(*max_tokens)``; with transformers' greedy answers."""
    rng = random.Random(seed)
    shared = [bos] + [rng.randrange(3, 600) for _ in range(23)]
    out = []
    for i in range(num_requests):
        tail = [rng.randrange(3, 600) for _ in range(rng.randrange(1, 36))]
        prompt = [*shared, *tail] if i % 2 else [bos, *tail, *shared[1:8]]
        n = rng.randrange(*max_tokens)
        with torch.inference_mode():
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
            )
        out.append((prompt, n, ids[0, len(prompt) :].tolist()))
    return out


def windowed_engine(
    tiny_checkpoint: CheckpointFactory,
    name: str,
    block_size: int,
    client: BlockManagerClient | None = None,
    **kw: Any,
) -> Engine:
    """An engine over the tiny checkpoint ``name`` (``kw``: :class:`ExecutorConfig` fields)."""
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_batched_tokens", 32)
    config = ExecutorConfig(
        model=str(tiny_checkpoint(name)), dtype="float32", device="cpu", block_size=block_size, **kw
    )
    engine, _ = build_engine(
        config, runner=build_runner(config.runner_config()), blockmgr=client or InProcessClient()
    )
    return engine


def run_checked(
    engine: Engine,
    workload: Workload,
    check: Callable[[Sequence, bool], None],
    *,
    n: int = 1,
    per_step: int = 3,
) -> dict[str, list[list[int]]]:
    """Requests arrive ``per_step`` at a time; after every step ``check(seq, decoding)`` runs
    for each running sequence, ``decoding`` when its last two steps computed one token each
    (its last prefill chunk's blocks, held until its next grow, are gone)."""
    got: dict[str, list[list[int]]] = {}
    pending = list(enumerate(workload))
    computed: dict[int, int] = {}
    decoding: set[int] = set()
    while pending or engine.has_work:
        for i, (prompt, max_tokens, _) in pending[:per_step]:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
            engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
        pending = pending[per_step:]
        for o in engine.step():
            outs = got.setdefault(o.req_id.request_id, [[] for _ in range(n)])
            outs[o.index].extend(o.token_ids)
        for seq in engine.scheduler.running:
            step = seq.num_computed_tokens - computed.get(seq.seq_id, -10)
            check(seq, step == 1 and seq.seq_id in decoding)
            (decoding.add if step == 1 else decoding.discard)(seq.seq_id)
            computed[seq.seq_id] = seq.num_computed_tokens
    return got


def assert_matches(got: dict[str, list[list[int]]], workload: Workload) -> None:
    for i, (_, _, expected) in enumerate(workload):
        for sample in got[f"r{i}"]:
            assert sample == expected, f"request r{i}"


def assert_pool_empty(engine: Engine) -> None:
    c = engine.link.client.stats(engine.link.pool_id).counters
    assert c.num_in_use_blocks == 0 and c.num_free_blocks == c.num_usable_blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_across_a_blockmgr_restart(
    make_engine: Callable[[BlockManagerClient], Engine],
    workload: Workload,
    released: Callable[[Engine], bool],
) -> None:
    """Run ``workload`` on an engine over a block-manager service that is stopped once
    ``released(engine)`` holds (after 12 steps at least) and started again once the engine
    has met the outage: the tokens are transformers' and the pool is restored once, empty at
    the end."""
    port = free_port()
    config = BlockManagerServiceConfig(port=port, grace_period_s=0.1)
    server = ThreadedServer(config)
    client = GrpcClient(f"127.0.0.1:{port}", timeout_s=2.0)
    engine = make_engine(client)
    got: dict[str, list[int]] = {}
    for i, (prompt, max_tokens, _) in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.add_request(RequestKey(0, f"r{i}"), prompt, params)
    for step in range(500):  # past the first windows: tables hold released entries
        if step >= 12 and released(engine):
            break
        for o in engine.step():
            got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
    assert released(engine)
    server.stop()
    restarted: list[ThreadedServer] = []

    def restart() -> None:  # once the engine has met the outage (or given up waiting for it)
        try:
            wait_until(lambda: not engine.link.healthy, what="the engine meeting the outage")
        finally:
            restarted.append(ThreadedServer(config))

    t = threading.Thread(target=restart)
    t.start()
    try:
        while engine.has_work:
            for o in engine.step():
                got.setdefault(o.req_id.request_id, []).extend(o.token_ids)
        t.join()
        for i, (_, _, expected) in enumerate(workload):
            assert got[f"r{i}"] == expected, f"request r{i}"
        assert engine.link.num_recoveries == 1
        assert_pool_empty(engine)
    finally:
        client.close()
        for s in restarted:
            s.stop()
