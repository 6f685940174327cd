"""A disk tier that fails: a load or a spill that raises an I/O error loses nothing. The
engine reports it to the block manager (``UncacheOp``), which forgets the block or slot, and
recomputes the sequences whose blocks were not filled, before anything reads them: the
answers stay transformers'. The failures are injected into the store's reads and writes
(the one part faked: a disk cannot be made to fail here); everything else is real."""

from __future__ import annotations

import errno
import random

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.executor.core.sequence import RequestKey
from services.executor.model.disk_kv import DiskKVStore
from services.executor.model.host_kv import HostKVCache, MoveFailures

from .greedy import hf_greedy
from .test_host_tier import _assert_pool_empty, _block_bytes, _config, _engine


def _converse_many(engine, hf) -> None:
    """5 conversations taking 3 turns each, one request at a time: each turn's history
    comes back from the tiers (mostly the disk); every answer is transformers'."""
    rng = random.Random(9)
    histories = [[1] + [rng.randrange(3, 600) for _ in range(20)] for _ in range(5)]
    for turn in range(3):
        for c, history in enumerate(histories):
            history.extend(rng.randrange(3, 600) for _ in range(4))
            params = SamplingParams(temperature=0.0, max_tokens=3)
            engine.add_request(RequestKey(0, f"c{c}t{turn}"), list(history), params)
            got: list[int] = []
            while engine.has_work:
                for o in engine.step():
                    got.extend(o.token_ids)
            assert got == hf_greedy(hf, history, 3)[0], (c, turn)
            history.extend(got)


def _failing(method, every: int):
    """``method``, failing with EIO on every ``every``-th call."""
    calls = [0]

    def call(slot, data):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] % every == 0:
            raise OSError(errno.EIO, f"injected I/O error on disk slot {slot}")
        method(slot, data)

    call.calls = calls  # type: ignore[attr-defined]
    return call


@pytest.mark.parametrize(
    ("async_scheduling", "fills_async"),
    [(False, False), (True, False), (False, True), (True, True)],
)
def test_failed_loads_and_spills_are_recomputed_with_transformers_tokens(
    tiny_checkpoint, hf_model, tmp_path, async_scheduling, fills_async
) -> None:
    per_block = _block_bytes(tiny_checkpoint)
    config = _config(
        tiny_checkpoint,
        async_scheduling=async_scheduling,
        num_kv_blocks=16,
        kv_offloading_size=2 * per_block / 2**30,  # most offloads go straight to disk
        kv_offloading_disk_path=str(tmp_path / "tier"),
        kv_offloading_disk_size=256 * per_block / 2**30,
    )
    engine = _engine(config, fills_async)
    disk = engine.runner.host.disk  # type: ignore[attr-defined]
    disk.read_into = reads = _failing(disk.read_into, every=2)
    disk.write = writes = _failing(disk.write, every=3)
    try:
        _converse_many(engine, hf_model("llama"))
    finally:
        engine.runner.close()
    stats = engine.link.client.stats(engine.link.pool_id)
    assert reads.calls[0] >= 2 and writes.calls[0] >= 3  # both kinds failed
    assert engine.num_failed_moves >= 2
    assert stats.num_loaded_blocks > 0 and stats.disk_hits_tokens > 0  # the rest still hit
    assert engine.scheduler.num_preemptions > 0  # the sequences whose loads failed
    _assert_pool_empty(engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_disk_store_round_trips_slots_and_names_a_short_read(tmp_path, dtype) -> None:
    like = torch.zeros(4, 2, 2, 8, 3, dtype=dtype)
    store = DiskKVStore(tmp_path, like, num_slots=4)
    assert not list(tmp_path.iterdir())  # unlinked at once
    data = torch.randn(2, 2, 8, 3).to(dtype)
    store.write(2, data)
    out = torch.empty_like(data)
    store.read_into(2, out)
    assert torch.equal(out, data)
    with pytest.raises(OSError, match="slot 4"):  # past the end of the file
        store.read_into(4, out)
    store.close()
    with pytest.raises(OSError, match="closed"):
        store.read_into(0, out)


def test_a_load_from_a_slot_whose_spill_failed_fails_until_a_spill_succeeds(tmp_path) -> None:
    """The block manager may order a load from a disk slot before it hears that the spill
    into it failed: the host tier reports that load failed without reading the slot."""
    kv = torch.zeros(2, 2, 6, 4, 1, 2)  # [S, 2, NB, BS, Hkv, D]
    host = HostKVCache(kv, num_slots=2)
    host.disk = DiskKVStore(tmp_path, host.slots, num_slots=2)
    host.slots[0].fill_(7.0)
    real_write = host.disk.write
    host.disk.write = _failing(real_write, every=1)
    host.move(kv, [], [], spills=[(0, 1)])
    assert host.take_failures() == MoveFailures([], [1])
    host.move(kv, [], [], loads=[(1, 3)])
    assert host.take_failures() == MoveFailures([3], [])
    assert not kv[:, :, 3].any()  # not read
    host.disk.write = real_write
    host.move(kv, [], [], spills=[(0, 1)], loads=[(1, 4)])  # (spills run before loads)
    assert host.take_failures() == MoveFailures([], [])
    assert (kv[:, :, 4] == 7.0).all()
    host.close()


@pytest.mark.parametrize(
    ("async_scheduling", "fills_async"), [(False, True), (True, True), (True, False)]
)
def test_a_failed_load_freed_before_it_is_reported_is_never_offloaded_as_its_history(
    tiny_checkpoint, hf_model, tmp_path, async_scheduling, fills_async
) -> None:
    """The request whose history fails to load is aborted before its chunk runs, and a long
    prompt then evicts every block. No Step goes out before the failure is taken (fills
    beside the forward are waited for first; a batch granted ahead and emptied has its
    failures taken before the next plan): the unfilled blocks are forgotten before they are
    freed, never offloaded under the history's hashes, and the history's next turn is
    transformers'."""
    per_block = _block_bytes(tiny_checkpoint)
    config = _config(
        tiny_checkpoint,
        num_kv_blocks=13,
        max_model_len=96,
        max_num_batched_tokens=96,
        async_scheduling=async_scheduling,
        kv_offloading_size=12 * per_block / 2**30,
        kv_offloading_disk_path=str(tmp_path / "tier"),
        kv_offloading_disk_size=64 * per_block / 2**30,
    )
    engine, hf, rng = _engine(config, fills_async), hf_model("llama"), random.Random(5)
    history = [1] + [rng.randrange(3, 600) for _ in range(40)]
    try:
        _answer(engine, "first", history, 1)
        for i in range(4):  # push the history down to the disk tier
            _answer(engine, f"other{i}", [1] + [rng.randrange(3, 600) for _ in range(80)], 1)
        disk = engine.runner.host.disk  # type: ignore[attr-defined]
        read = disk.read_into
        disk.read_into = _failing(read, every=1)
        beside = [1, 5, 6, 7]
        engine.add_request(RequestKey(0, "beside"), beside, SamplingParams(max_tokens=20))
        engine.step()
        engine.step()
        back = SamplingParams(temperature=0.0, max_tokens=2)
        engine.add_request(RequestKey(0, "back"), [*history, 7], back)
        engine.step()  # its loads ordered (failing), its chunk held back or granted ahead
        assert engine.abort_request(RequestKey(0, "back"))
        assert engine.abort_request(RequestKey(0, "beside"))
        _answer(engine, "long", [1] + [rng.randrange(3, 600) for _ in range(94)], 1)
        disk.read_into = read
        again = [*history, 9]
        assert _answer(engine, "again", again, 4) == hf_greedy(hf, again, 4)[0]
        assert engine.num_failed_moves > 0
    finally:
        engine.runner.close()


def _answer(engine, key: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.add_request(RequestKey(0, key), prompt, params)
    got: list[int] = []
    while engine.has_work:
        for o in engine.step():
            got.extend(o.token_ids)
    return got
