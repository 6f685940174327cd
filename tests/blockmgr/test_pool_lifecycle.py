"""Pool lifecycle in the core: leases that reclaim a dead owner's pool, renewal by any owner
call, and the bounds on pool count and size (a clock the test moves, no sleeping)."""

from __future__ import annotations

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.types import Admit, Free, KVEventKind, PoolSpec
from services.blockmgr.service.core import BlockManagerCore
from tests.blockmgr.helpers import hashes, raises_code

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _core(clock: Clock, **kw) -> BlockManagerCore:
    return BlockManagerCore(pool_lease_s=10.0, clock=clock, **kw)


def test_a_pool_whose_owner_went_silent_is_reclaimed_and_its_id_freed() -> None:
    clock = Clock()
    core = _core(clock)
    dead = core.register("exec-1", PoolSpec(16, BS))
    core.step("exec-1", dead.epoch, [Admit(1, 8, 8, hashes(list(range(8)), BS))], dead.owner_token)
    events: list = []
    core.subscribe("exec-1", lambda pool_id, evs: events.extend(evs))
    clock.now += 9.0
    with raises_code(ErrorCode.FAILED_PRECONDITION, "another owner"):
        core.register("exec-1", PoolSpec(16, BS))  # still within its lease
    clock.now += 1.5
    successor = core.register("exec-1", PoolSpec(16, BS))  # the dead owner's lease ran out
    assert successor.owner_token != dead.owner_token
    assert core.stats("exec-1").counters.num_in_use_blocks == 0
    assert any(e.kind is KVEventKind.CLEARED for e in events)
    with raises_code(ErrorCode.FAILED_PRECONDITION, "owner_token"):
        core.step("exec-1", successor.epoch, [Free((1,))], dead.owner_token)


def test_any_owner_call_renews_the_lease_and_an_expired_pool_disappears() -> None:
    clock = Clock()
    core = _core(clock)
    info = core.register("p", PoolSpec(8, BS))
    for _ in range(5):  # 40 s of empty Steps, 8 s apart: never expires
        clock.now += 8.0
        core.step("p", info.epoch, [], info.owner_token)
    assert core.stats("p").pool.epoch == info.epoch
    clock.now += 10.5
    with raises_code(ErrorCode.NOT_FOUND):
        core.stats("p")  # swept: its blocks are reclaimed without any new registration
    assert core.info().pools == ()


def test_register_reports_the_lease_and_info_never_shows_the_owner_token() -> None:
    core = _core(Clock())
    info = core.register("p", PoolSpec(8, BS))
    assert info.lease_s == 10.0 and len(info.owner_token) == 32
    (listed,) = core.info("p").pools
    assert listed.owner_token == "" and core.stats("p").pool.owner_token == ""


def test_pool_count_and_size_are_bounded() -> None:
    core = _core(Clock(), max_pools=2, max_pool_blocks=1000)
    with raises_code(ErrorCode.INVALID_ARGUMENT, "--max-pool-blocks"):
        core.register("big", PoolSpec(10**7, BS))
    a = core.register("a", PoolSpec(8, BS))
    core.register("b", PoolSpec(8, BS))
    with raises_code(ErrorCode.RESOURCE_EXHAUSTED, "--max-pools"):
        core.register("c", PoolSpec(8, BS))
    core.register(
        "a", PoolSpec(8, BS), owner_token=a.owner_token
    )  # replacing one's own is no new pool
    core.unregister("a", core.info("a").pools[0].epoch, a.owner_token)
    core.register("c", PoolSpec(8, BS))


def test_without_a_lease_pools_never_expire() -> None:
    clock = Clock()
    core = BlockManagerCore(clock=clock)
    info = core.register("p", PoolSpec(8, BS))
    clock.now += 10**9
    assert core.stats("p").pool.epoch == info.epoch
