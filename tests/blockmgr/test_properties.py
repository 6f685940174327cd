"""Property-based tests: random operation sequences keep the pool's invariants, in full-attention
pools, in sliding-window ones (whose tables start with null entries) and in hybrid pools (one
table per KV-cache group, from one set of blocks)."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.blockmgr.api.errors import BlockManagerError
from services.blockmgr.api.types import (
    NO_SLOT,
    Admit,
    AttentionKindName,
    Commit,
    Fork,
    Free,
    Grow,
    KVCacheGroup,
    OpStatus,
    PoolSpec,
    RestoredSequence,
    SwapIn,
    SwapOut,
    Uncache,
)
from services.blockmgr.pool.groups import group_key, split_key
from services.blockmgr.pool.manager import KVBlockManager
from services.common.blocks import NULL_BLOCK
from services.common.blocks import first_live_block as first_live
from tests.blockmgr.helpers import hashes
from tests.hypothesis_budget import examples

BS = 4
NUM_BLOCKS = 24
# A small alphabet makes shared prefixes (and so cache hits) frequent.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=40)


Tables = dict[int, tuple[list[list[int]], list[int]]]


class PoolMachine(RuleBasedStateMachine):
    policy = "lru"
    windows: tuple[int, ...] = (0,)  # one per KV-cache group: > 0 slides over that many tokens
    retention_steps = 4096
    host_blocks = 0  # > 0: a host tier of that many slots (one full group only)
    disk_blocks = 0  # > 0: a disk tier below the host tier
    num_blocks = NUM_BLOCKS
    tier_policy = "lru"  # the host and disk tiers' eviction policy
    hit_margin = 0  # > 0: an admission's hit stops that many blocks short of the run (EAGLE)
    pin_budget = 5  # free blocks session pins may keep (their clock: self.now, in seconds)

    def __init__(self) -> None:
        super().__init__()
        self.m = self._manager()
        self.tokens: dict[int, list[int]] = {}  # our model of each live sequence's tokens
        self.lookahead: dict[int, int] = {}  # slots a sequence holds beyond its tokens
        self.next_id = 0

    now = 0.0

    def _manager(self) -> KVBlockManager:
        groups = [
            KVCacheGroup(AttentionKindName.SLIDING, w) if w else KVCacheGroup()
            for w in self.windows
        ]
        return KVBlockManager(
            PoolSpec(
                self.num_blocks,
                BS,
                eviction_policy=self.policy,
                groups=tuple(groups),
                host_blocks=self.host_blocks,
                disk_blocks=self.disk_blocks,
                tier_eviction_policy=self.tier_policy,
                prefix_hit_margin=self.hit_margin,
                pin_budget_blocks=self.pin_budget,
            ),
            retention_steps=self.retention_steps,
            clock=lambda: self.now,
        )

    def _tables(self, m: KVBlockManager | None = None) -> Tables:
        seqs = (m or self.m).seqs
        return {s: ([list(t) for t in v.tables], list(v.first_lives)) for s, v in seqs.items()}

    def _lives(self, num_tokens: int) -> list[int]:
        return [first_live(num_tokens, w, BS) for w in self.windows]

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(
        tokens=prompts,
        budget=st.integers(1, 48),
        priority=st.integers(0, 3),
        pin=st.sampled_from([0.0, 0.0, 1.0, 5.0]),
    )
    def admit(self, tokens: list[int], budget: int, priority: int, pin: float) -> None:
        seq_id = self._new_id()
        op = Admit(seq_id, len(tokens), budget, hashes(tokens, BS), 0, priority, pin)
        (r,) = self.m.step([op])
        if r.status is OpStatus.OK:
            assert r.num_cached_tokens < len(tokens)
            assert r.num_cached_tokens % BS == 0
            assert r.num_cached_tokens <= max(0, (len(tokens) - 1) // BS - self.hit_margin) * BS
            n = -(-r.num_tokens // BS)
            assert len(r.block_ids) == n * len(self.windows)
            for g, live in enumerate(self._lives(r.num_cached_tokens)):
                table = r.block_ids[g * n : (g + 1) * n]
                assert table[:live] == (0,) * live and 0 not in table[live:]
            self.tokens[seq_id] = tokens[: r.num_tokens]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 9))
    def grow(self, data: st.DataObject, n: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._tables()[seq_id]
        old = self.m.seqs[seq_id].num_tokens
        (r,) = self.m.step([Grow((seq_id,), (n,))])
        lives = self.m.seqs[seq_id].first_lives
        if r.statuses[0] is OpStatus.OK:
            self.tokens[seq_id] += [data.draw(st.integers(0, 2)) for _ in range(n)]
            self.lookahead[seq_id] = max(0, self.lookahead.get(seq_id, 0) - n)
            expected = [max(a, b) for a, b in zip(before[1], self._lives(old), strict=True)]
            assert lives == expected
            new = r.new_block_ids[0]
            assert len(new) % len(self.windows) == 0  # the same number per group
        else:  # all or nothing
            assert self._tables()[seq_id] == before
        assert r.first_live_blocks == (tuple(lives) if any(self.windows) else ())

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 4), lookahead=st.integers(0, 7))
    def speculate(self, data: st.DataObject, n: int, lookahead: int) -> None:
        """Speculative decoding: ``n`` more verified tokens, ``lookahead`` draft slots beyond
        them; rejected drafts' slots are kept."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._tables()[seq_id]
        (r,) = self.m.step([Grow((seq_id,), (n,), (lookahead,))])
        if r.statuses[0] is OpStatus.OK:
            slots = len(self.tokens[seq_id]) + self.lookahead.get(seq_id, 0)
            self.tokens[seq_id] += [data.draw(st.integers(0, 2)) for _ in range(n)]
            after = max(slots, len(self.tokens[seq_id]) + lookahead)
            self.lookahead[seq_id] = after - len(self.tokens[seq_id])
        else:
            assert self._tables()[seq_id] == before

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(0, 5))
    def grow_every_sequence_in_one_step(self, n: int) -> None:
        """Blocks released by an entry count for later entries of the same Grow."""
        seq_ids = tuple(sorted(self.tokens))
        (r,) = self.m.step([Grow(seq_ids, (n,) * len(seq_ids))])
        for seq_id, status in zip(seq_ids, r.statuses, strict=True):
            if status is OpStatus.OK:
                self.tokens[seq_id] += [1] * n
                self.lookahead[seq_id] = max(0, self.lookahead.get(seq_id, 0) - n)

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
        self.tokens[child] = list(self.tokens[parent])  # (its parent's lookahead stays its own)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.step([Free((seq_id,))])
        del self.tokens[seq_id]
        self.lookahead.pop(seq_id, None)

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
            RestoredSequence(
                s,
                st_.num_tokens,
                tuple(self.m.block_table(s)),
                num_lookahead=st_.num_slots - st_.num_tokens,
            )
            for s, st_ in self.m.seqs.items()
        ]
        fresh = self._manager()
        fresh.restore(live)
        assert fresh.pool.refcount == self.m.pool.refcount
        assert self._tables() == self._tables(fresh)
        self.m = fresh

    @invariant()
    def null_entries_are_exactly_a_prefix_of_first_live_entries(self) -> None:
        for s in self.m.seqs.values():
            # Never released: the blocks the next query (at num_tokens) still reads.
            bounds = self._lives(s.num_tokens)
            for table, live, bound, w in zip(
                s.tables, s.first_lives, bounds, self.windows, strict=True
            ):
                assert table[:live] == [0] * live and 0 not in table[live:]
                assert live <= bound
                if not w:
                    assert live == 0

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def pins_keep_free_cached_blocks_within_the_budget(self) -> None:
        pool = self.m.pool
        pinned = pool.pins.pinned
        assert len(pinned) <= self.pin_budget
        for b in pinned:
            assert pool.refcount[b] == 0 and pool.block_hash[b] is not None

    @invariant()
    def refcount_equals_number_of_tables_holding_the_block(self) -> None:
        held = Counter(b for s in self.m.seqs.values() for t in s.tables for b in t if b)
        pool = self.m.pool
        assert pool.refcount[0] == 0
        for b in range(1, self.num_blocks):
            assert pool.refcount[b] == held.get(b, 0)

    @invariant()
    def a_block_is_held_once_per_table_and_by_one_group_only(self) -> None:
        group_of: dict[int, int] = {}
        for s in self.m.seqs.values():
            for g, (table, live) in enumerate(zip(s.tables, s.first_lives, strict=True)):
                held = table[live:]
                assert len(set(held)) == len(held)
                for b in held:
                    assert group_of.setdefault(b, g) == g

    @invariant()
    def free_plus_in_use_equals_usable_and_free_blocks_are_unreferenced(self) -> None:
        pool = self.m.pool
        free = pool.free_block_ids()
        assert len(free) == len(set(free)) == pool.num_free
        assert all(pool.refcount[b] == 0 for b in free)
        in_use = sum(1 for b in range(1, self.num_blocks) if pool.refcount[b] > 0)
        c = self.m.counters()
        assert c.num_free_blocks + c.num_in_use_blocks == c.num_usable_blocks == self.num_blocks - 1
        assert in_use == c.num_in_use_blocks
        assert c.num_cached_free_blocks <= c.num_free_blocks

    @invariant()
    def tables_cover_exactly_their_tokens_and_lookahead_slots(self) -> None:
        for seq_id, s in self.m.seqs.items():
            assert [len(t) for t in s.tables] == [-(-s.num_slots // BS)] * len(self.windows)
            assert s.num_tokens == len(self.tokens[seq_id])
            assert s.num_slots - s.num_tokens == self.lookahead.get(seq_id, 0)

    @invariant()
    def no_block_past_the_verified_tokens_is_shared_or_cached(self) -> None:
        """A block holding a draft's slot (beyond the last full block of verified tokens) is
        the sequence's own, and never matchable."""
        pool = self.m.pool
        for s in self.m.seqs.values():
            for table in s.tables:
                for b in table[s.num_tokens // BS :]:
                    if b:
                        assert pool.block_hash[b] is None
                for b in table[-(-s.num_tokens // BS) :]:
                    assert pool.refcount[b] == 1

    @invariant()
    def hash_index_is_consistent_and_matches_block_contents(self) -> None:
        pool = self.m.pool
        for h, b in pool.hash_to_block.items():
            assert pool.block_hash[b] == h
        # A cached block reachable from a live sequence holds that sequence's prefix hash, in
        # the group whose table holds it.
        for seq_id, s in self.m.seqs.items():
            expected = hashes(self.tokens[seq_id], BS)
            for g, table in enumerate(s.tables):
                for i, b in enumerate(table[: len(expected)]):
                    key = group_key(expected[i], g)
                    if b and pool.block_hash[b] is not None:
                        assert pool.block_hash[b] == key
                    if b in pool._duplicate_of:
                        assert pool._duplicate_of[b] == key

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
        assert c.num_in_use_blocks == 0 and c.num_free_blocks == self.num_blocks - 1


class LFUPoolMachine(PoolMachine):
    policy = "lfu"


class ARCPoolMachine(PoolMachine):
    policy = "arc"
    retention_steps = 2  # retention priorities expire fast: blocks demoted while free


class S3FIFOPoolMachine(PoolMachine):
    policy = "s3fifo"


class ReusePoolMachine(PoolMachine):
    policy = "reuse"
    windows = (0, 6)  # a full group and a sliding one


class HostTierPoolMachine(PoolMachine):
    host_blocks = 6  # evictions offload, admissions onboard
    swaps = False  # a swap-in's onboard may fill a block that had no hash

    @invariant()
    def the_host_map_is_one_to_one_and_onboards_land_in_fresh_tables(self) -> None:
        host = self.m.pool.host
        assert host is not None
        for key, slot in host.slot_of.items():
            assert host.key_of[slot] == key
        assert host.occupied() <= host.num_slots
        offloads, onboards = host.moves()
        assert len({m.host_slot for m in onboards}) == len(onboards)
        assert len({m.host_slot for m in offloads}) == len(offloads)
        for m in onboards if not self.swaps else ():  # from the tier: matchable at once
            assert self.m.pool.block_hash[m.device_block] is not None


Content = tuple[int, tuple[int, ...]]  # (group, what a block holds)


GARBAGE: Content = (-2, ())  # what a failed move left


def _content(tokens: list[int], i: int) -> tuple[int, ...]:
    """What block ``i`` of a sequence of ``tokens`` holds: its whole prefix (a chained hash)."""
    return tuple(tokens[: (i + 1) * BS])


class SwapPoolMachine(HostTierPoolMachine):
    """Preemption by swapping on top of the host tier, with the KV content modelled: every
    Step's moves and copies are applied to a model of the device and host memory, then the
    "forward" writes what every live sequence's blocks hold. A sequence swapped back in must
    find exactly its content in its new table, whatever was offloaded meanwhile."""

    swaps = True

    def __init__(self) -> None:
        self.swapped: dict[int, list[int]] = {}  # swapped-out sequences' tokens
        self.dev: dict[int, Content] = {}  # device block -> (group, content)
        self.hostmem: dict[int, Content] = {}  # host slot -> (group, content)
        self.diskmem: dict[int, Content] = {}  # disk slot -> (group, content)
        # Made wrong at the start of the next Step (a fill or spill that failed; see
        # DiskTierPoolMachine): device blocks, disk slots.
        self.corrupt: tuple[set[int], set[int]] = (set(), set())
        super().__init__()

    def _manager(self) -> KVBlockManager:
        m = super()._manager()
        inner = m.step

        def step(ops):  # type: ignore[no-untyped-def]
            self._forward()  # the last step's forward ran before this Step's moves
            for b in self.corrupt[0]:
                self.dev[b] = GARBAGE
            for slot in self.corrupt[1]:
                self.diskmem[slot] = GARBAGE
            self.corrupt[0].clear()
            self.corrupt[1].clear()
            results = inner(ops)
            offloads, onboards, spills, loads, stores = m.take_moves()
            for sp in spills:  # in the executor's order
                self.diskmem[sp.dst] = self.hostmem[sp.src]
            for mv in offloads:
                self.hostmem[mv.host_slot] = self.dev.get(mv.device_block, (-1, ()))
            for st_ in stores:
                self.diskmem[st_.dst] = self.dev.get(st_.src, (-1, ()))
            for mv in onboards:
                self.dev[mv.device_block] = self.hostmem[mv.host_slot]
            for ld in loads:
                self.dev[ld.dst] = self.diskmem[ld.src]
            # A block filled from a tier holds the content its key names (its group's).
            filled = [mv.device_block for mv in onboards] + [ld.dst for ld in loads]
            for b in filled:
                key = m.pool.block_hash[b]
                if key is not None:
                    h, group = split_key(key)
                    content_group, content = self.dev[b]
                    assert (content_group, hashes(list(content), BS)[-1]) == (group, h), b
            for r in results:
                for c in getattr(r, "copies", ()):
                    self.dev[c.dst] = self.dev.get(c.src, ())
            return results

        m.step = step  # type: ignore[method-assign]
        return m

    def _forward(self) -> None:
        for seq_id, state in self.m.seqs.items():
            for group, table in enumerate(state.tables):
                for i, b in enumerate(table):
                    if b != NULL_BLOCK:  # a sliding group's blocks before its window
                        self.dev[b] = (group, _content(self.tokens[seq_id], i))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        self._forward()
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._tables()[seq_id]
        (r,) = self.m.step([SwapOut((seq_id,))])
        if r.statuses[0] is OpStatus.OK:
            tables = before[0]
            assert len(r.host_slots[0]) == sum(len(t) for t in tables)
            flat = [b for t in tables for b in t]
            assert [x == NO_SLOT for x in r.host_slots[0]] == [b == NULL_BLOCK for b in flat]
            self.swapped[seq_id] = self.tokens.pop(seq_id)
        else:
            assert self._tables()[seq_id] == before

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self._forward()
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        (r,) = self.m.step([SwapIn((seq_id,))])
        if r.statuses[0] is OpStatus.OK:
            tokens = self.tokens[seq_id] = self.swapped.pop(seq_id)
            n = len(r.block_ids[0]) // len(self.windows)
            for j, b in enumerate(r.block_ids[0]):
                group, i = divmod(j, n)
                if b != NULL_BLOCK:  # (a sliding group's released entries stay so)
                    assert self.dev.get(b) == (group, _content(tokens, i)), (seq_id, j, b)
        else:
            assert seq_id in self.m.swapped

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        self.m.step([Free((seq_id,))])
        del self.swapped[seq_id]
        self.lookahead.pop(seq_id, None)

    @rule()
    def restart_and_restore(self) -> None:
        """Rebuild the pool, swapped-out sequences included, as an executor does."""
        self._forward()
        seqs = [
            RestoredSequence(
                s,
                st_.num_tokens,
                tuple(self.m.block_table(s)),
                num_lookahead=st_.num_slots - st_.num_tokens,
            )
            for s, st_ in self.m.seqs.items()
        ] + [
            RestoredSequence(
                s, sw.num_tokens, (), (), tuple(sw.slots), sw.num_slots - sw.num_tokens
            )
            for s, sw in self.m.swapped.items()
        ]
        fresh = self._manager()
        fresh.restore(seqs)
        assert fresh.pool.refcount == self.m.pool.refcount
        assert self._tables() == self._tables(fresh)
        assert {s: w.slots for s, w in fresh.swapped.items()} == {
            s: w.slots for s, w in self.m.swapped.items()
        }
        self.m = fresh

    @invariant()
    def swapped_slots_are_held_once_per_table_and_never_cached(self) -> None:
        host = self.m.pool.host
        assert host is not None
        assert set(self.m.swapped) == set(self.swapped)
        refs = Counter(
            slot for sw in self.m.swapped.values() for slot in sw.slots if slot != NO_SLOT
        )
        assert refs == Counter(host._swap_refs)
        assert not set(refs) & set(host.slot_of.values()) and not set(refs) & set(host._free)
        for seq_id, sw in self.m.swapped.items():
            assert sw.num_tokens == len(self.swapped[seq_id])
            assert len(sw.slots) == -(-sw.num_slots // BS) * len(self.windows)
            assert sw.num_slots - sw.num_tokens == self.lookahead.get(seq_id, 0)

    def teardown(self) -> None:
        if self.m.swapped:
            self.m.step([Free(tuple(self.m.swapped))])
        super().teardown()


class DiskTierPoolMachine(SwapPoolMachine):
    """A small host tier over a disk tier: evicted host slots spill to disk, hits load from
    either (the content model checks every block filled from a tier)."""

    num_blocks = 10  # a small device pool: cached blocks are evicted to the tiers often
    host_blocks = 3
    disk_blocks = 5

    @rule(tokens=st.lists(st.integers(0, 9), min_size=5, max_size=24))
    def turn(self, tokens: list[int]) -> None:
        """A whole request: admitted, its full blocks committed, freed (cached, then evicted
        down the tiers by later turns); remembered to come back."""
        self.prompts.append(tokens)
        seq_id = self._new_id()
        (r,) = self.m.step([Admit(seq_id, len(tokens), len(tokens), hashes(tokens, BS))])
        if r.status is OpStatus.OK:
            self.tokens[seq_id] = tokens  # computed by the next step's forward
            self.m.step([Commit(seq_id, 0, hashes(tokens, BS))])
            self.m.step([Free((seq_id,))])
            del self.tokens[seq_id]

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), extra=st.integers(0, 9))
    def admit_free_and_admit_in_one_step(self, data: st.DataObject, extra: int) -> None:
        """A block filled from a tier, freed and reused within one Step: its fill is
        cancelled, never left to overwrite the next content (the wrapper checks every
        filled block against its hash, in the executor's order of moves)."""
        first = [*data.draw(st.sampled_from(self.prompts)), extra]
        # Long enough to evict what the first one was just given.
        second = [*data.draw(st.sampled_from(self.prompts)), *[extra + 1] * 20]
        a, b = self._new_id(), self._new_id()
        h1, h2 = hashes(first, BS), hashes(second, BS)
        results = self.m.step(
            [Admit(a, len(first), len(first), h1), Free((a,)), Admit(b, len(second), 64, h2)]
        )
        _, onboards, _, loads, _ = self.m.take_moves()
        filled = [mv.device_block for mv in onboards] + [ld.dst for ld in loads]
        assert len(set(filled)) == len(filled)  # one fill per block and Step
        if results[2].status is OpStatus.OK:
            self.tokens[b] = second[: results[2].num_tokens]

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), extra=st.integers(0, 9))
    def turn_again(self, data: st.DataObject, extra: int) -> None:
        """An earlier prompt plus a token: its prefix hits the device or the tiers below."""
        self.turn([*data.draw(st.sampled_from(self.prompts)), extra])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def a_fill_fails_and_its_holders_are_recomputed(self, data: st.DataObject) -> None:
        """A live block turns out wrong (its onboard or load failed): the executor reports it
        first in its next Step, with the Free of every sequence listing it (recomputed). The
        invariant below checks that no key ever names it again."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        blocks = [b for t in self.m.seqs[seq_id].tables for b in t if b != NULL_BLOCK]
        if not blocks:
            return
        b = data.draw(st.sampled_from(blocks))
        holders = tuple(s for s, v in self.m.seqs.items() if any(b in t for t in v.tables))
        self.corrupt[0].add(b)
        (r, _) = self.m.step([Uncache(device_blocks=(b,)), Free(holders)])
        assert r.num_forgotten <= 1
        for s in holders:
            del self.tokens[s]

    @rule(data=st.data())
    def a_spill_fails_and_is_reported(self, data: st.DataObject) -> None:
        disk = self.m.pool.disk
        assert disk is not None
        slots = sorted(disk.slot_of.values())
        if not slots:
            return
        slot = data.draw(st.sampled_from(slots))
        self.corrupt[1].add(slot)
        (r,) = self.m.step([Uncache(disk_slots=(slot,))])
        assert r.num_forgotten == 1 and slot not in disk.slot_of.values()

    @invariant()
    def every_key_names_a_block_or_slot_holding_its_content(self) -> None:
        """Device blocks and tier slots hold what their keys name: a failed move reported is
        forgotten before anything could match it."""
        pool, disk, host = self.m.pool, self.m.pool.disk, self.m.pool.host
        assert disk is not None and host is not None
        for where, mem in (
            (pool.hash_to_block, self.dev),
            (host.slot_of, self.hostmem),
            (disk.slot_of, self.diskmem),
        ):
            for key, at in where.items():
                h, group = split_key(key)
                content_group, content = mem[at]
                assert content, (key, at, "a key names what a failed move left")
                assert (content_group, hashes(list(content), BS)[-1]) == (group, h), (key, at)

    @property
    def prompts(self) -> list[list[int]]:
        return self.__dict__.setdefault("_prompts", [])

    @invariant()
    def the_tiers_hold_disjoint_keys(self) -> None:
        host, disk = self.m.pool.host, self.m.pool.disk
        assert host is not None and disk is not None
        assert not set(host.slot_of) & set(disk.slot_of)
        assert disk.occupied() <= disk.num_slots


class HybridTierPoolMachine(DiskTierPoolMachine):
    """Gemma-style groups (sliding windows around a full one) over host and disk tiers: an
    admission's hit continues in the tiers group by group; every block filled from a tier
    holds its own group's content; a swapped-in sequence finds each group's content again,
    its released entries still null."""

    windows = (6, 0, 6)
    num_blocks = 16
    host_blocks = 12  # room to swap out a sequence's three tables

    @rule(data=st.data(), length=st.integers(8, 20), grown=st.integers(1, 8))
    def a_sequence_past_its_window_swaps_out_and_in(
        self, data: st.DataObject, length: int, grown: int
    ) -> None:
        """Its sliding tables' released entries have no slot and come back null (the
        rules check the content of every block that comes back)."""
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=length, max_size=length))
        self.admit(tokens, 64, 0, 0.0)
        seq_id = self.next_id
        if seq_id not in self.tokens:
            return
        (r,) = self.m.step([Grow((seq_id,), (grown,))])
        if r.statuses[0] is not OpStatus.OK:
            return
        self.tokens[seq_id] += [1] * grown
        self.swap_out(st_fixed(data, seq_id))
        if seq_id in self.swapped:
            self.swap_in(st_fixed(data, seq_id))

    @invariant()
    def a_live_block_holds_one_content_whoever_lists_it(self) -> None:
        _one_content_per_live_block(self.m, self.tokens)


def st_fixed(data: st.DataObject, value: int) -> st.DataObject:
    """A data object whose next draw is ``value`` (to call a rule on a chosen sequence)."""

    class Fixed:
        def draw(self, _strategy: object) -> int:
            return value

    return Fixed()  # type: ignore[return-value]


def _one_content_per_live_block(m: KVBlockManager, tokens: dict[int, list[int]]) -> None:
    """No block is listed by two tables (or two groups) for different content: one
    admission's allocations never take a cached block another of its groups hit."""
    owner: dict[int, Content] = {}
    for seq_id, state in m.seqs.items():
        for group, table in enumerate(state.tables):
            for i, b in enumerate(table):
                if b != NULL_BLOCK:
                    want = (group, _content(tokens[seq_id], i))
                    assert owner.setdefault(b, want) == want, (seq_id, group, i, b)


class DiskTierARCPoolMachine(DiskTierPoolMachine):
    tier_policy = "arc"


class DiskTierS3FIFOPoolMachine(DiskTierPoolMachine):
    tier_policy = "s3fifo"


class DiskTierReusePoolMachine(DiskTierPoolMachine):
    tier_policy = "reuse"


class EagleDiskTierPoolMachine(DiskTierPoolMachine):
    hit_margin = 2  # hits stop short on the device or in the tiers (a shortened tier run)


class EagleHybridTierPoolMachine(HybridTierPoolMachine):
    hit_margin = 1  # the hit of a prefix a block shorter, in every group and tier


class SlidingPoolMachine(PoolMachine):
    windows = (6,)  # not a multiple of the block size: the window straddles blocks


class SlidingLFUPoolMachine(PoolMachine):
    policy = "lfu"
    windows = (9,)


class SlidingWindowOfOnePoolMachine(PoolMachine):
    windows = (1,)  # the degenerate window: every full block is out of it at once


class HybridPoolMachine(PoolMachine):
    windows = (6, 0, 6)  # Gemma-style: sliding groups around a full one

    @invariant()
    def a_live_block_holds_one_content_whoever_lists_it(self) -> None:
        _one_content_per_live_block(self.m, self.tokens)


class HybridS3FIFOPoolMachine(PoolMachine):
    policy = "s3fifo"
    windows = (0, 9, 1)  # two windows of their own


_settings = settings(
    max_examples=examples(120),
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolInvariantsLRU = PoolMachine.TestCase
TestPoolInvariantsLRU.settings = _settings
TestPoolInvariantsLFU = LFUPoolMachine.TestCase
TestPoolInvariantsLFU.settings = _settings
_adaptive_settings = settings(_settings, max_examples=examples(60))
TestPoolInvariantsARC = ARCPoolMachine.TestCase
TestPoolInvariantsARC.settings = _adaptive_settings
TestPoolInvariantsS3FIFO = S3FIFOPoolMachine.TestCase
TestPoolInvariantsS3FIFO.settings = _adaptive_settings
TestPoolInvariantsReuse = ReusePoolMachine.TestCase
TestPoolInvariantsReuse.settings = _adaptive_settings
TestHostTierInvariants = HostTierPoolMachine.TestCase
TestHostTierInvariants.settings = _adaptive_settings
TestSwapInvariants = SwapPoolMachine.TestCase
TestSwapInvariants.settings = settings(_settings, max_examples=examples(80))
TestDiskTierInvariants = DiskTierPoolMachine.TestCase
TestDiskTierInvariants.settings = settings(_settings, max_examples=examples(80))
TestDiskTierARCInvariants = DiskTierARCPoolMachine.TestCase
TestDiskTierARCInvariants.settings = settings(_settings, max_examples=examples(40))
TestHybridTierInvariants = HybridTierPoolMachine.TestCase
TestHybridTierInvariants.settings = settings(_settings, max_examples=examples(60))
TestDiskTierS3FIFOInvariants = DiskTierS3FIFOPoolMachine.TestCase
TestDiskTierS3FIFOInvariants.settings = settings(_settings, max_examples=examples(40))
TestDiskTierReuseInvariants = DiskTierReusePoolMachine.TestCase
TestDiskTierReuseInvariants.settings = settings(_settings, max_examples=examples(40))
TestEagleDiskTierInvariants = EagleDiskTierPoolMachine.TestCase
TestEagleDiskTierInvariants.settings = settings(_settings, max_examples=examples(40))
TestEagleHybridTierInvariants = EagleHybridTierPoolMachine.TestCase
TestEagleHybridTierInvariants.settings = settings(_settings, max_examples=examples(40))
_sliding_settings = settings(_settings, max_examples=examples(60))
TestSlidingPoolInvariantsLRU = SlidingPoolMachine.TestCase
TestSlidingPoolInvariantsLRU.settings = _sliding_settings
TestSlidingPoolInvariantsLFU = SlidingLFUPoolMachine.TestCase
TestSlidingPoolInvariantsLFU.settings = _sliding_settings
TestSlidingWindowOfOneInvariants = SlidingWindowOfOnePoolMachine.TestCase
TestSlidingWindowOfOneInvariants.settings = _sliding_settings
TestHybridPoolInvariantsLRU = HybridPoolMachine.TestCase
TestHybridPoolInvariantsLRU.settings = _sliding_settings
TestHybridPoolInvariantsS3FIFO = HybridS3FIFOPoolMachine.TestCase
TestHybridPoolInvariantsS3FIFO.settings = _sliding_settings
