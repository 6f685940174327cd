"""The executor registers its pool only once the slow parts of its start-up are built: nothing
renews the pool's lease before the engine loop runs, and a lease that ran out meanwhile
killed the executor with NOT_FOUND on its first Step (seen with a 4 s lease on a loaded
2-core machine, where loading the tokenizer and compiling its grammar tables took 7 s)."""

from __future__ import annotations

from typing import Any

import pytest

from services.blockmgr.api.types import PoolInfo, PoolSpec
from services.blockmgr.client import InProcessClient
from services.executor.model.launch import build_runner
from services.executor.service import startup
from services.executor.service.config import ExecutorConfig


class _RecordingClient(InProcessClient):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def register(self, pool_id: str, spec: PoolSpec, *, owner_token: str | None = None) -> PoolInfo:
        self.events.append("register")
        return super().register(pool_id, spec, owner_token=owner_token)


def test_the_pool_is_registered_after_the_tokenizer_and_grammar_compiler_are_built(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real = startup.grammar_compiler

    def recording_compiler(*args: Any) -> Any:
        compiler = real(*args)
        events.append("grammar")
        return compiler

    monkeypatch.setattr(startup, "grammar_compiler", recording_compiler)
    config = ExecutorConfig(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",
        device="cpu",
        num_kv_blocks=32,
        max_model_len=128,
    )
    engine, _ = startup.build_engine(
        config, runner=build_runner(config.runner_config()), blockmgr=_RecordingClient(events)
    )
    assert engine.grammars is not None  # (the checkpoint has a tokenizer: it was built)
    assert events == ["grammar", "register"]
