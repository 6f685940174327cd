"""Property-based tests: random operation sequences keep the pool's invariants, in full-attention
pools and in sliding-window ones (whose tables start with null entries)."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.blockmgr.errors import BlockManagerError
from services.blockmgr.kv_manager import KVBlockManager
from services.blockmgr.types import Admit, Commit, Fork, Free, Grow, OpStatus, RestoredSequence
from services.common.blocks import first_live_block as first_live
from tests.blockmgr.helpers import hashes

BS = 4
NUM_BLOCKS = 24
# A small alphabet makes shared prefixes (and so cache hits) frequent.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=40)


class PoolMachine(RuleBasedStateMachine):
    policy = "lru"
    window = 0  # > 0: a sliding-window pool of this many tokens

    def __init__(self) -> None:
        super().__init__()
        self.m = self._manager()
        self.tokens: dict[int, list[int]] = {}  # our model of each live sequence's tokens
        self.next_id = 0

    def _manager(self) -> KVBlockManager:
        return KVBlockManager(
            NUM_BLOCKS, BS, eviction_policy=self.policy, sliding_window=self.window
        )

    def _tables(self) -> dict[int, tuple[list[int], int]]:
        return {s: (list(v.block_table), v.first_live) for s, v in self.m.seqs.items()}

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(tokens=prompts, budget=st.integers(1, 48))
    def admit(self, tokens: list[int], budget: int) -> None:
        seq_id = self._new_id()
        (r,) = self.m.step([Admit(seq_id, len(tokens), budget, hashes(tokens, BS))])
        if r.status is OpStatus.OK:
            assert r.num_cached_tokens < len(tokens)
            assert r.num_cached_tokens % BS == 0
            live = first_live(r.num_cached_tokens, self.window, BS)
            assert r.block_ids[:live] == (0,) * live and 0 not in r.block_ids[live:]
            self.tokens[seq_id] = tokens[: r.num_tokens]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 9))
    def grow(self, data: st.DataObject, n: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._tables()[seq_id]
        old = self.m.seqs[seq_id].num_tokens
        (r,) = self.m.step([Grow((seq_id,), (n,))])
        if r.statuses[0] is OpStatus.OK:
            self.tokens[seq_id] += [data.draw(st.integers(0, 2)) for _ in range(n)]
            live = max(before[1], first_live(old, self.window, BS))
            assert self.m.seqs[seq_id].first_live == live
        else:  # all or nothing
            assert self._tables()[seq_id] == before
        assert r.first_live_blocks == ((self.m.seqs[seq_id].first_live,) if self.window else ())

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(0, 5))
    def grow_every_sequence_in_one_step(self, n: int) -> None:
        """Blocks released by an entry count for later entries of the same Grow."""
        seq_ids = tuple(sorted(self.tokens))
        (r,) = self.m.step([Grow(seq_ids, (n,) * len(seq_ids))])
        for seq_id, status in zip(seq_ids, r.statuses, strict=True):
            if status is OpStatus.OK:
                self.tokens[seq_id] += [1] * n

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit_full_blocks(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        h = hashes(self.tokens[seq_id], BS)
        (r,) = self.m.step([Commit(seq_id, 0, h)])
        assert r.status is OpStatus.OK

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.m.step([Fork(parent, child)])
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.step([Free((seq_id,))])
        del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def invalid_step_changes_nothing(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = (self.m.counters(), self._tables())
        try:
            self.m.step([Grow((seq_id,), (3,)), Free((seq_id,)), Free((seq_id,))])
        except BlockManagerError:
            pass
        else:
            raise AssertionError("double free in one step was accepted")
        assert (self.m.counters(), self._tables()) == before

    @rule()
    def restart_and_restore(self) -> None:
        """Rebuild the pool from the live tables, as an executor does after a restart."""
        live = [
            RestoredSequence(s, st_.num_tokens, tuple(st_.block_table))
            for s, st_ in self.m.seqs.items()
        ]
        fresh = self._manager()
        fresh.restore(live)
        assert fresh.pool.refcount == self.m.pool.refcount
        assert self._tables() == {
            s: (list(v.block_table), v.first_live) for s, v in fresh.seqs.items()
        }
        self.m = fresh

    @invariant()
    def null_entries_are_exactly_a_prefix_of_first_live_entries(self) -> None:
        for s in self.m.seqs.values():
            live = s.first_live
            assert s.block_table[:live] == [0] * live and 0 not in s.block_table[live:]
            # Never released: the blocks the next query (at num_tokens) still reads.
            assert live <= first_live(s.num_tokens, self.window, BS)
            if not self.window:
                assert live == 0

    @invariant()
    def refcount_equals_number_of_tables_holding_the_block(self) -> None:
        held = Counter(b for s in self.m.seqs.values() for b in s.block_table if b)
        pool = self.m.pool
        assert pool.refcount[0] == 0
        for b in range(1, NUM_BLOCKS):
            assert pool.refcount[b] == held.get(b, 0)

    @invariant()
    def no_block_has_two_owners_unless_shared_by_refcount(self) -> None:
        for s in self.m.seqs.values():
            held = s.block_table[s.first_live :]
            assert len(set(held)) == len(held)

    @invariant()
    def free_plus_in_use_equals_usable_and_free_blocks_are_unreferenced(self) -> None:
        pool = self.m.pool
        free = pool.free_block_ids()
        assert len(free) == len(set(free)) == pool.num_free
        assert all(pool.refcount[b] == 0 for b in free)
        in_use = sum(1 for b in range(1, NUM_BLOCKS) if pool.refcount[b] > 0)
        c = self.m.counters()
        assert c.num_free_blocks + c.num_in_use_blocks == c.num_usable_blocks == NUM_BLOCKS - 1
        assert in_use == c.num_in_use_blocks
        assert c.num_cached_free_blocks <= c.num_free_blocks

    @invariant()
    def tables_cover_exactly_their_tokens(self) -> None:
        for seq_id, s in self.m.seqs.items():
            assert len(s.block_table) == -(-s.num_tokens // BS)
            assert s.num_tokens == len(self.tokens[seq_id])

    @invariant()
    def hash_index_is_consistent_and_matches_block_contents(self) -> None:
        pool = self.m.pool
        for h, b in pool.hash_to_block.items():
            assert pool.block_hash[b] == h
        # A cached block reachable from a live sequence holds that sequence's prefix hash.
        for seq_id, s in self.m.seqs.items():
            expected = hashes(self.tokens[seq_id], BS)
            for i, b in enumerate(s.block_table[: len(expected)]):
                if pool.block_hash[b] is not None:
                    assert pool.block_hash[b] == expected[i]
                if b in pool._duplicate_of:
                    assert pool._duplicate_of[b] == expected[i]

    @invariant()
    def duplicates_are_live_unhashed_copies_of_a_hashed_block(self) -> None:
        pool = self.m.pool
        for h, copies in pool._duplicates.items():
            assert copies and pool.hash_to_block[h] not in copies
            for d in copies:
                assert pool.refcount[d] > 0 and pool.block_hash[d] is None
                assert pool._duplicate_of[d] == h

    def teardown(self) -> None:
        if self.m.seqs:
            self.m.step([Free(tuple(self.m.seqs))])
        c = self.m.counters()
        assert c.num_in_use_blocks == 0 and c.num_free_blocks == NUM_BLOCKS - 1


class LFUPoolMachine(PoolMachine):
    policy = "lfu"


class SlidingPoolMachine(PoolMachine):
    window = 6  # not a multiple of the block size: the window straddles blocks


class SlidingLFUPoolMachine(PoolMachine):
    policy = "lfu"
    window = 9


class SlidingWindowOfOnePoolMachine(PoolMachine):
    window = 1  # the degenerate window: every full block is out of it at once


_settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolInvariantsLRU = PoolMachine.TestCase
TestPoolInvariantsLRU.settings = _settings
TestPoolInvariantsLFU = LFUPoolMachine.TestCase
TestPoolInvariantsLFU.settings = _settings
_sliding_settings = settings(_settings, max_examples=60)
TestSlidingPoolInvariantsLRU = SlidingPoolMachine.TestCase
TestSlidingPoolInvariantsLRU.settings = _sliding_settings
TestSlidingPoolInvariantsLFU = SlidingLFUPoolMachine.TestCase
TestSlidingPoolInvariantsLFU.settings = _sliding_settings
TestSlidingWindowOfOneInvariants = SlidingWindowOfOnePoolMachine.TestCase
TestSlidingWindowOfOneInvariants.settings = _sliding_settings
