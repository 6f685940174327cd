"""The prefix index (KV events -> which pool holds which hashes) and the routing policies,
as pure code: events in, decisions out; then the KV-event follower against a real block
manager."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.testing.procs import async_wait_until
from services.blockmgr.api.hashing import block_hashes
from services.blockmgr.api.types import Admit, Commit, Free, KVEvent, KVEventKind, PoolSpec
from services.blockmgr.client import GrpcClient
from services.gateway.fleet.kv_events import KVEventFollower
from services.gateway.fleet.prefix_index import MAX_PROVISIONAL_PER_POOL, PrefixIndex
from services.gateway.fleet.routing import Candidate, Router, RoutingPolicy
from services.gateway.service.config import GatewayConfig
from tests.blockmgr.helpers import ThreadedServer

BS = 4
STORED, REMOVED, CLEARED = KVEventKind.STORED, KVEventKind.REMOVED, KVEventKind.CLEARED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hashes(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return block_hashes(tokens, BS, salt)


PROMPT_A = list(range(1, 18))  # 4 full blocks + 1 token
PROMPT_B = list(range(100, 117))


def synced_index(**kw: float) -> PrefixIndex:
    index = PrefixIndex(**kw)  # type: ignore[arg-type]
    for pool in ("p0", "p1", "p2"):
        index.set_synced(pool, True)
    return index


def test_stored_hashes_match_as_a_leading_run_and_removed_ones_cut_it() -> None:
    index = synced_index()
    h = hashes(PROMPT_A)
    index.apply("p0", [KVEvent(10, 1, CLEARED), KVEvent(11, 1, STORED, tuple(h))])
    assert index.match("p0", h) == 4
    assert index.match("p1", h) == 0
    index.apply("p0", [KVEvent(12, 1, REMOVED, (h[2],))])
    assert index.match("p0", h) == 2  # chained: block 3 is useless without block 2
    assert index.num_blocks("p0") == 3


def test_a_hybrid_pools_hash_is_held_while_any_group_holds_it() -> None:
    """KV events of a hybrid pool name the group: a sliding group evicting its copy of a block
    leaves the full group's, which still serves the prefix."""
    index = PrefixIndex()
    h = hashes(PROMPT_A)
    stored = [KVEvent(2, 1, STORED, tuple(h), 0), KVEvent(3, 1, STORED, tuple(h), 1)]
    index.apply("p0", [KVEvent(1, 1, CLEARED), *stored])
    index.set_synced("p0", True)
    index.apply("p0", [KVEvent(4, 1, REMOVED, h[:2], 0)])  # out of the window, evicted
    assert index.match("p0", h) == len(h)
    index.apply("p0", [KVEvent(5, 1, REMOVED, h[1:2], 1)])
    assert index.match("p0", h) == 1


def test_replayed_events_are_applied_once() -> None:
    index = synced_index()
    h = hashes(PROMPT_A)
    batch = [KVEvent(5, 1, CLEARED), KVEvent(6, 1, STORED, tuple(h)), KVEvent(7, 1, REMOVED, h[:1])]
    index.apply("p0", batch)
    index.apply("p0", batch)  # a resumed stream replays what was already seen
    assert index.match("p0", h) == 0
    assert index.last_seq("p0") == 7
    assert index.num_gaps == 0


def test_cleared_on_a_new_epoch_empties_the_pool() -> None:
    index = synced_index()
    h = hashes(PROMPT_A)
    index.apply("p0", [KVEvent(1, 1, CLEARED), KVEvent(2, 1, STORED, tuple(h))])
    # A block-manager restart: numbering jumps (it starts from the clock), epoch changes,
    # and the new epoch opens with CLEARED.
    index.apply("p0", [KVEvent(9_000_000, 7, CLEARED), KVEvent(9_000_001, 7, STORED, h[:1])])
    assert index.match("p0", h) == 1
    assert index.num_gaps == 0


def test_a_gap_in_sequence_numbers_rebuilds_the_pool_from_the_events_that_follow() -> None:
    index = synced_index()
    a, b = hashes(PROMPT_A), hashes(PROMPT_B)
    index.apply("p0", [KVEvent(1, 1, CLEARED), KVEvent(2, 1, STORED, tuple(a))])
    # Events 3..9 were lost (the block manager's buffer overflowed): a REMOVED of `a` may be
    # among them, so `a` can no longer be trusted.
    index.apply("p0", [KVEvent(10, 1, STORED, tuple(b))])
    assert index.num_gaps == 1
    assert index.match("p0", a) == 0
    assert index.match("p0", b) == 4


def test_an_epoch_change_without_cleared_counts_as_a_gap() -> None:
    index = synced_index()
    a = hashes(PROMPT_A)
    index.apply("p0", [KVEvent(1, 1, CLEARED), KVEvent(2, 1, STORED, tuple(a))])
    index.apply("p0", [KVEvent(3, 2, STORED, a[:1])])
    assert index.num_gaps == 1
    assert index.match("p0", a) == 1


def test_an_unsynced_pool_counts_only_provisional_hashes_until_its_stream_is_back() -> None:
    index = synced_index()
    a = hashes(PROMPT_A)
    index.apply("p0", [KVEvent(1, 1, CLEARED), KVEvent(2, 1, STORED, tuple(a))])
    index.set_synced("p0", False)
    assert index.match("p0", a) == 0
    assert index.last_seq("p0") == 2  # the stream resumes from here
    index.set_synced("p0", True)
    assert index.match("p0", a) == 4


def test_provisional_hashes_expire_unless_confirmed() -> None:
    clock = Clock()
    index = synced_index(provisional_ttl_s=10.0, clock=clock)
    a, b = hashes(PROMPT_A), hashes(PROMPT_B)
    index.note_routed("p0", a)
    index.note_routed("p0", b)
    assert index.match("p0", a) == 4
    index.apply("p0", [KVEvent(1, 1, STORED, tuple(a[:2]))])  # its prefill committed 2 blocks
    clock.now += 11
    assert index.match("p0", a) == 2  # confirmed ones stay, unconfirmed ones expired
    assert index.match("p0", b) == 0


def test_removed_drops_a_provisional_hash_too() -> None:
    index = synced_index()
    a = hashes(PROMPT_A)
    index.note_routed("p0", a)
    index.apply("p0", [KVEvent(1, 1, REMOVED, (a[0],))])
    assert index.match("p0", a) == 0


def test_provisional_entries_are_bounded_per_pool() -> None:
    index = synced_index()
    many = [i.to_bytes(32, "little") for i in range(MAX_PROVISIONAL_PER_POOL + 10)]
    index.note_routed("p0", many)
    assert len(index._pools["p0"].provisional) <= MAX_PROVISIONAL_PER_POOL


# ---- the router --------------------------------------------------------------------------


def cands(*loads: int, caching: bool = True) -> list[Candidate]:
    return [
        Candidate(
            key=f"e{i}", pool_id=f"p{i}", block_size=BS, prefix_caching=caching, load_tokens=x
        )
        for i, x in enumerate(loads)
    ]


def test_prefix_aware_sends_a_prompt_where_its_prefix_is_cached() -> None:
    index = synced_index()
    index.apply("p1", [KVEvent(1, 1, STORED, tuple(hashes(PROMPT_A)))])
    router = Router(RoutingPolicy.PREFIX_AWARE, index, load_weight=0.1)
    d = router.choose(cands(0, 50, 0), PROMPT_A)
    assert (d.index, d.policy, d.predicted_cached_tokens) == (1, RoutingPolicy.PREFIX_AWARE, 16)
    assert d.scores == (0.0, 16 - 5.0, 0.0)


def test_prefix_aware_never_predicts_the_block_holding_the_last_prompt_token() -> None:
    index = synced_index()
    prompt = PROMPT_A[:16]  # exactly 4 blocks: the 4th holds the last token, always computed
    index.apply("p0", [KVEvent(1, 1, STORED, tuple(hashes(prompt)))])
    d = Router(RoutingPolicy.PREFIX_AWARE, index).choose(cands(0, 0), prompt)
    assert d.predicted_cached_tokens == 12


def test_the_load_term_overrides_a_cache_hit_on_a_busy_executor() -> None:
    def route(*loads: int) -> int:
        index = synced_index()
        index.apply("p0", [KVEvent(1, 1, STORED, tuple(hashes(PROMPT_A)))])
        return (
            Router(RoutingPolicy.PREFIX_AWARE, index, load_weight=1.0)
            .choose(cands(*loads), PROMPT_A)
            .index
        )

    assert route(100, 20) == 1  # 16 - 100 < 0 - 20
    assert route(30, 20) == 0  # 16 - 30 > 0 - 20


def test_cache_salt_isolates_prefixes() -> None:
    index = synced_index()
    index.apply("p1", [KVEvent(1, 1, STORED, tuple(hashes(PROMPT_A, b"tenant-a")))])
    router = Router(RoutingPolicy.PREFIX_AWARE, index)
    assert router.choose(cands(0, 0), PROMPT_A, b"tenant-a").predicted_cached_tokens == 16
    assert router.choose(cands(0, 0), PROMPT_A, b"tenant-b").predicted_cached_tokens == 0


def test_a_burst_sharing_a_new_prefix_follows_the_first_request() -> None:
    """No STORED event yet (the prefill has not run): the gateway's own routing decisions are
    what keeps the burst together."""
    index = synced_index()
    router = Router(RoutingPolicy.PREFIX_AWARE, index, load_weight=0.1)
    loads = [0, 0, 0]
    chosen = []
    for _ in range(6):
        d = router.choose(cands(*loads), PROMPT_A)
        chosen.append(d.index)
        loads[d.index] += len(PROMPT_A)
    assert len(set(chosen)) == 1
    # A different prefix goes to a less loaded executor.
    assert router.choose(cands(*loads), PROMPT_B).index != chosen[0]


def test_prefix_aware_falls_back_to_least_loaded_without_a_live_index() -> None:
    index = PrefixIndex()  # no stream synced
    router = Router(RoutingPolicy.PREFIX_AWARE, index)
    d = router.choose(cands(30, 10, 20), PROMPT_A)
    assert (d.index, d.policy) == (1, RoutingPolicy.LEAST_LOADED)


def test_executors_without_prefix_caching_score_no_hits() -> None:
    index = synced_index()
    index.apply("p0", [KVEvent(1, 1, STORED, tuple(hashes(PROMPT_A)))])
    d = Router(RoutingPolicy.PREFIX_AWARE, index).choose(cands(0, 0, caching=False), PROMPT_A)
    assert d.predicted_cached_tokens == 0


def test_least_loaded_picks_the_fewest_tokens_and_rotates_ties() -> None:
    router = Router(RoutingPolicy.LEAST_LOADED)
    assert router.choose(cands(5, 1, 3), PROMPT_A).index == 1
    assert {router.choose(cands(0, 0, 0), PROMPT_A).index for _ in range(3)} == {0, 1, 2}


def test_round_robin_takes_each_executor_in_turn() -> None:
    router = Router(RoutingPolicy.ROUND_ROBIN)
    picks = [router.choose(cands(0, 9, 9), PROMPT_A).index for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_router_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="prefix index"):
        Router(RoutingPolicy.PREFIX_AWARE)
    with pytest.raises(ValueError, match="load_weight"):
        Router(RoutingPolicy.LEAST_LOADED, load_weight=-1)


# ---- the KV-event follower against a real block-manager server ----------------------------


def test_the_follower_waits_for_a_pool_then_mirrors_its_events() -> None:
    server = ThreadedServer()
    client = GrpcClient(server.address)

    async def scenario() -> None:
        index = PrefixIndex()
        follower = KVEventFollower(server.address, index, retry_s=0.05)
        follower.track({"late"})  # not registered yet: NOT_FOUND, retried
        await asyncio.sleep(0.2)
        assert not index.is_synced("late")
        epoch = await asyncio.to_thread(lambda: client.register("late", PoolSpec(32, BS)).epoch)
        await async_wait_until(lambda: index.is_synced("late"))
        h = tuple(hashes(PROMPT_A))

        def compute_prompt_a() -> None:
            client.step("late", epoch, [Admit(1, len(PROMPT_A), 10**6, h, 0)])
            client.step("late", epoch, [Commit(1, 0, h), Free((1,))])

        await asyncio.to_thread(compute_prompt_a)
        await async_wait_until(lambda: index.match("late", h) == 4)
        # Re-registration (an executor restart): a new epoch opens with CLEARED.
        await asyncio.to_thread(lambda: client.register("late", PoolSpec(32, BS)))
        await async_wait_until(lambda: index.match("late", h) == 0)
        follower.track(set())  # the executor left the gateway: forgotten
        assert index.last_seq("late") == 0
        await follower.close()

    try:
        asyncio.run(scenario())
    finally:
        client.close()
        server.stop()


# ---- flags -------------------------------------------------------------------------------


def test_routing_defaults_to_prefix_aware_only_with_a_block_manager() -> None:
    base = ["--model", "m", "--executor", "127.0.0.1:1"]
    assert GatewayConfig.from_args(base).routing == RoutingPolicy.LEAST_LOADED
    with_bm = GatewayConfig.from_args([*base, "--blockmgr-address", "127.0.0.1:2"])
    assert with_bm.routing == RoutingPolicy.PREFIX_AWARE
    assert with_bm.routing_load_weight == 0.3
    rr = GatewayConfig.from_args([*base, "--blockmgr-address", "b:2", "--routing", "round-robin"])
    assert rr.routing == RoutingPolicy.ROUND_ROBIN


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--routing", "prefix-aware"], "needs --blockmgr-address"),
        (["--routing-load-weight", "-1"], "--routing-load-weight"),
    ],
)
def test_bad_routing_flags_are_refused_naming_the_flag(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--model", "m", *extra])
    assert message in capsys.readouterr().err
