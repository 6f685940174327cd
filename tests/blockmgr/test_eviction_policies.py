"""What each eviction policy keeps under pressure: a prefix reused by several requests against a
stream of one-off prompts (LRU loses it; LFU, ARC and S3-FIFO keep it), ARC's adaptation to the
keys of blocks it evicted, and S3-FIFO's ghosts."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import BlockManagerError
from services.blockmgr.api.types import Admit, Commit, Free, PoolSpec
from services.blockmgr.eviction.adaptive import ARCPolicy, S3FIFOPolicy
from services.blockmgr.eviction.policies import make_policy
from services.blockmgr.eviction.reuse import ReusePolicy
from services.blockmgr.pool.manager import KVBlockManager
from tests.blockmgr.helpers import hashes

BS = 4


def _turn(m: KVBlockManager, seq_id: int, tokens: list[int]) -> int:
    """Admit, commit and free one request; returns its cached prompt tokens."""
    h = hashes(tokens, BS)
    (r,) = m.step([Admit(seq_id, len(tokens), len(tokens), h)])
    m.step([Commit(seq_id, 0, h), Free((seq_id,))])
    return r.num_cached_tokens


@pytest.mark.parametrize(
    ("policy", "keeps_the_shared_prefix"),
    [("lru", False), ("lfu", True), ("arc", True), ("s3fifo", True)],
)
def test_a_reused_prefix_outlives_a_stream_of_one_off_prompts(policy, keeps_the_shared_prefix):
    m = KVBlockManager(PoolSpec(17, BS, eviction_policy=policy))  # 16 usable blocks
    system = list(range(1000, 1016))  # 4 blocks, asked for by 3 requests
    for i in range(3):
        _turn(m, i, [*system, 1, 2, 3, 4 + i])
    for j in range(10):  # one-off prompts of 3 blocks each: the pool turns over twice
        _turn(m, 100 + j, list(range(2000 + 100 * j, 2000 + 100 * j + 12)))
    assert m.pool.num_evicted > 16
    cached = _turn(m, 999, [*system, 9, 9, 9, 9])
    assert (cached == len(system)) is keeps_the_shared_prefix, cached


def test_arc_raises_the_target_of_its_recency_list_when_an_evicted_key_is_asked_again():
    keys = {b: bytes([b]) * 32 for b in range(1, 5)}
    arc = ARCPolicy(4, keys.get)
    for b in (1, 2, 3):
        arc.push(b)
    victim = arc.pop()
    assert victim == 1  # least recently freed, seen once
    arc.forget(victim, keys[victim])
    assert arc.p == 0
    arc.missed(keys[victim])  # asked for again soon after: recency deserved more room
    assert arc.p == 1
    arc.missed(keys[victim])  # a ghost counts once
    assert arc.p == 1


def test_arc_evicts_blocks_seen_once_before_blocks_hit_again():
    arc = ARCPolicy(8, lambda b: None)
    arc.push(1)
    arc.remove(1)  # a prefix hit takes it back...
    arc.push(1)  # ...and it is freed again: frequent now
    for b in (2, 3):
        arc.push(b)
    assert [arc.pop(), arc.pop(), arc.pop()] == [2, 3, 1]


def test_s3fifo_sends_a_ghost_key_straight_to_its_main_queue():
    keys: dict[int, bytes] = {1: b"a" * 32, 2: b"b" * 32, 3: b"a" * 32}
    s3 = S3FIFOPolicy(8, keys.get)
    s3.push(1)
    s3.push(2)
    assert s3.pop() == 1  # new content: the small queue, FIFO; its key becomes a ghost
    s3.push(3)  # the same content computed again: a ghost, so it joins the main queue
    assert s3.pop() == 2 and s3.pop() == 3


def test_s3fifo_gives_a_used_block_another_round_in_the_main_queue():
    s3 = S3FIFOPolicy(8, lambda b: None)
    for _ in range(2):  # hit twice: the main queue, two uses
        s3.push(1)
        s3.remove(1)
    s3.push(1)
    s3.push(2)
    s3.remove(2)  # hit once
    s3.push(2)
    assert s3.pop() == 2  # each went round once per use: 1 had one more
    assert s3.pop() == 1


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="'lru', 'lfu', 'arc', 's3fifo', 'reuse'"):
        make_policy("clock")


def _retained_run(m: KVBlockManager, priority: int, one_offs: int) -> int:
    """A 4-block prefix admitted with ``priority``, then ``one_offs`` one-off prompts of 3
    blocks; the prefix's cached tokens when asked again."""
    system = list(range(1000, 1016))
    h = hashes([*system, 1, 2, 3, 4], BS)
    m.step([Admit(0, 20, 20, h, 0, priority)])
    m.step([Commit(0, 0, h), Free((0,))])
    for j in range(one_offs):
        _turn(m, 100 + j, list(range(2000 + 100 * j, 2000 + 100 * j + 12)))
    return _turn(m, 999, [*system, 9, 9, 9, 9])


def test_a_retained_prefix_outlives_one_off_prompts_under_lru():
    assert _retained_run(KVBlockManager(PoolSpec(17, BS)), priority=0, one_offs=10) == 0
    assert _retained_run(KVBlockManager(PoolSpec(17, BS)), priority=2, one_offs=10) == 16


def test_retention_is_bounded_in_steps_then_the_prefix_is_evicted_like_any_other():
    m = KVBlockManager(PoolSpec(17, BS), retention_steps=8)  # each one-off prompt is 2 Steps
    assert _retained_run(m, priority=3, one_offs=10) == 0
    assert m.pool.num_demoted == 5  # the prefix's 5 blocks lost their priority


def test_a_retention_priority_beyond_the_bound_is_invalid_argument_naming_the_field():
    m = KVBlockManager(PoolSpec(17, BS))
    with pytest.raises(BlockManagerError, match=r"ops\[0\].admit.retention_priority"):
        m.step([Admit(1, 8, 8, (), 0, 4)])
    assert not m.seqs


@pytest.mark.parametrize("policy", ["lfu", "arc", "s3fifo"])
def test_a_demoted_block_is_not_taken_for_a_hit_block(policy):
    """Demotion moves a retained block to level 0 without counting a hit: it is evicted before
    a newer block that was never hit either."""
    m = KVBlockManager(PoolSpec(4, BS, eviction_policy=policy), retention_steps=2)  # 3 usable
    retained, newer = list(range(100, 104)), list(range(200, 204))
    h_ret = hashes(retained, BS)
    m.step([Admit(1, 5, 5, hashes([*retained, 9], BS), 0, 3)])
    m.step([Commit(1, 0, h_ret), Free((1,))])
    m.step([])
    m.step([])  # the retention ran out
    _turn(m, 2, [*newer, 9])
    m.step([Admit(3, 8, 8, ())])  # 2 blocks: the uncached one, then one eviction
    assert m.pool.lookup(h_ret[0]) is None
    assert m.pool.lookup(hashes(newer, BS)[0]) is not None


def test_evictions_report_the_age_and_the_reuse_of_what_they_took():
    m = KVBlockManager(PoolSpec(3, BS))  # 2 usable
    a = list(range(10, 18))
    m.step([Admit(1, 8, 8, hashes(a, BS))])  # step 1
    m.step([Commit(1, 0, hashes(a, BS)), Free((1,))])  # step 2: both blocks cached, freed
    m.step([Admit(2, 5, 5, hashes([*a[:4], 9], BS))])  # 3: hits a0, evicts a1 (age 1)
    m.step([Free((2,))])  # 4: a0 freed again
    m.step([Admit(3, 8, 8, ())])  # 5: the uncached block, then a0 (age 1, reused once)
    assert m.pool.num_evicted == 2
    assert (m.pool.eviction_age_steps, m.pool.eviction_reuse) == (2, 1)


def _keyed(keys: dict[int, bytes]) -> ReusePolicy:
    return ReusePolicy(4, keys.get)  # horizon: 16 frees


def test_reuse_with_one_class_of_content_is_lru():
    policy = _keyed({b: bytes([b]) * 32 for b in range(8)})
    for b in (3, 1, 2, 0):
        policy.push(b)
    assert [policy.pop() for _ in range(4)] == [3, 1, 2, 0]


def test_reuse_learns_how_often_each_class_of_content_comes_back():
    keys = {b: bytes([b]) * 32 for b in range(40)}
    policy = ReusePolicy(2, keys.get)  # horizon: 8 frees
    policy.push(0)
    policy.remove(0)  # first-use content that came back
    for b in range(1, 21):  # first-use content that never does
        policy.push(b)
        policy.pop()
        policy.forget(b, keys[b])
    probabilities = policy.reuse_probabilities()
    # class 0: 1 came back of 13 resolved so far (12 expired), over the prior 1/2
    assert probabilities[0] == pytest.approx((1 + 1) / (2 + 13))
    assert probabilities[1:] == [0.5] * (ReusePolicy.CLASSES - 1)


def test_reuse_counts_content_computed_again_after_its_eviction_as_used_again():
    keys = {1: b"a" * 32, 2: b"a" * 32}  # block 2 holds what block 1 held
    policy = ReusePolicy(8, keys.get)
    policy.push(1)
    assert policy.pop() == 1
    policy.forget(1, keys[1])
    policy.push(2)  # the same content, computed again and freed: its second use
    assert policy.reuse_probabilities()[0] == pytest.approx(2 / 3)
    assert policy._class_of[2] == 1


def test_reuse_evicts_younger_one_off_content_before_older_content_that_comes_back():
    keys = {b: b.to_bytes(4, "big") * 8 for b in range(300)}
    policy = ReusePolicy(4, keys.get)  # span: 8 frees a factor e; horizon: 16 frees
    for b in range(100, 110):  # content comes back at its first, second and third use
        for _ in range(3):
            policy.push(b)
            policy.remove(b)
    for b in range(200, 300):  # first-use content never comes back
        policy.push(b)
        policy.pop()
        policy.forget(b, keys[b])
    p = policy.reuse_probabilities()
    assert p[2] == pytest.approx(11 / 12) and p[0] < 0.12
    policy.push(100)  # used three times: class 3, never seen freed: p = 1/2
    policy.push(101)  # ... and class 2: p = 11/12
    for b in range(60, 70):  # ten younger blocks of first-use content
        policy.push(b)
    # 101's place moves 8 * ln(p[2] / p[0]) > 16 frees later than its LRU place, 100's
    # 8 * ln(0.5 / p[0]) > 11: each outlives the ten younger one-off blocks
    assert [policy.pop() for _ in range(10)] == list(range(60, 70))
    assert [policy.pop(), policy.pop()] == [100, 101]


def _stream(policy: str) -> list[int]:
    """A 4-block prefix asked for before every 8th of 96 one-off prompts of 3 blocks, in a
    pool of 16 usable blocks; the prefix's cached tokens each time."""
    m = KVBlockManager(PoolSpec(17, BS, eviction_policy=policy))
    system, cached = list(range(1000, 1016)), []
    for j in range(96):
        if j % 8 == 0:
            cached.append(_turn(m, 1000 + j, [*system, 1, 2, 3, 4 + j]))
        _turn(m, 100 + j, list(range(2000 + 100 * j, 2000 + 100 * j + 12)))
    assert m.pool.num_evicted > 200
    return cached


def test_reuse_learns_to_keep_a_shared_prefix_that_lru_loses_to_one_off_prompts():
    assert _stream("lru")[1:] == [0] * 11  # 7 one-off prompts flush it every time
    # LRU's order until the one-off content's first outcomes are known (64 frees), then the
    # prefix's class has come back every time and one-off content never: it stays
    assert _stream("reuse")[-8:] == [16] * 8


def test_reuse_keeps_a_contents_uses_when_it_moves_out_of_a_slot_and_back():
    """A tier's slot is hit (its content goes to the device) and forgotten; offloaded again
    later into another slot, the content keeps the uses it had."""
    keys = {1: b"a" * 32, 2: b"a" * 32}
    policy = ReusePolicy(8, keys.get)
    for _ in range(2):
        policy.push(1)
        policy.remove(1)  # two hits: 2 uses
    policy.forget(1, keys[1])
    policy.push(2)  # the same content in another slot: class 2, not 0
    assert policy._class_of[2] == 2
    assert policy.reuse_probabilities()[:2] == [pytest.approx(2 / 3)] * 2
