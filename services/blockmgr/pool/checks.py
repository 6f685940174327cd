"""Validation of a Step before anything changes (pure, no I/O): a malformed op, an unknown
sequence, a double free or a duplicate id rejects the whole Step, with the field named."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Protocol

from services.blockmgr.api.errors import invalid, not_found, precondition
from services.blockmgr.api.hashing import HASH_SIZE
from services.blockmgr.api.types import (
    Admit,
    Commit,
    Fork,
    Free,
    Grow,
    Operation,
    SwapIn,
    SwapOut,
    Uncache,
)
from services.blockmgr.eviction.pins import MAX_PIN_TTL_S
from services.blockmgr.eviction.retention import MAX_RETENTION_PRIORITY
from services.common.blocks import NULL_BLOCK, full_blocks

MAX_SEQ_ID = 2**64 - 1
MAX_TOKENS = 2**40


class SeqLike(Protocol):
    num_tokens: int


def validate_step(
    ops: Sequence[Operation],
    seqs: Mapping[int, SeqLike],
    recently_freed: Container[int],
    block_size: int,
    swapped: Mapping[int, SeqLike] | None = None,
    *,
    has_host: bool = False,
    sizes: tuple[int, int, int] = (0, 0, 0),
) -> None:
    """Reject the whole step on any malformed op, simulating liveness and token counts in
    order as if every entry succeeded (a capacity failure only ever removes effects).
    ``swapped``: the swapped-out sequences; ``has_host``: the pool has a host tier;
    ``sizes``: the pool's blocks (the null block included), host and disk slots."""
    overlay: dict[int, int | None] = {}  # seq_id -> simulated num_tokens, None = freed
    swapped = swapped or {}
    out: dict[int, int | None] = {}  # seq_id -> num_tokens if swapped out now, None if not
    touched: set[int] = set()  # admitted, forked, grown or swapped in earlier in this step

    def swapped_tokens(seq_id: int) -> int | None:
        if seq_id in out:
            return out[seq_id]
        state = swapped.get(seq_id)
        return None if state is None else state.num_tokens

    def tokens_of(seq_id: int, where: str) -> int:
        if swapped and swapped_tokens(seq_id) is not None:
            raise precondition(f"{where}: seq_id {seq_id} is swapped out")
        if seq_id in overlay:
            n = overlay[seq_id]
            if n is None:
                raise precondition(f"{where}: seq_id {seq_id} was freed earlier in this step")
            return n
        state = seqs.get(seq_id)
        if state is None:
            if seq_id in recently_freed:
                raise precondition(f"{where}: seq_id {seq_id} was already freed")
            raise not_found(f"{where}: unknown seq_id {seq_id}")
        return state.num_tokens

    def absent(seq_id: int, where: str) -> None:
        check_seq_id(seq_id, where)
        live = overlay[seq_id] is not None if seq_id in overlay else seq_id in seqs
        if live or swapped_tokens(seq_id) is not None:
            raise precondition(f"{where}: seq_id {seq_id} already exists")

    for i, op in enumerate(ops):
        where = f"ops[{i}]"
        if isinstance(op, Grow):
            if len(op.seq_ids) != len(op.num_tokens):
                raise invalid(f"{where}.grow: seq_ids and num_tokens differ in length")
            if op.num_lookahead and len(op.num_lookahead) != len(op.seq_ids):
                raise invalid(
                    f"{where}.grow.num_lookahead: {len(op.num_lookahead)} entries for "
                    f"{len(op.seq_ids)} seq_ids (give one per entry, or none)"
                )
            for j, la in enumerate(op.num_lookahead):
                if not 0 <= la <= MAX_TOKENS:
                    raise invalid(f"{where}.grow.num_lookahead[{j}] must be >= 0, got {la}")
            if len(set(op.seq_ids)) != len(op.seq_ids):
                dup = next(x for j, x in enumerate(op.seq_ids) if x in op.seq_ids[:j])
                raise invalid(f"{where}.grow.seq_ids: seq_id {dup} is listed twice")
            for j, (seq_id, n) in enumerate(zip(op.seq_ids, op.num_tokens, strict=True)):
                if not 0 <= n <= MAX_TOKENS:
                    raise invalid(f"{where}.grow.num_tokens[{j}] must be >= 0, got {n}")
                state = seqs.get(seq_id)  # fast path: a live sequence untouched so far
                if state is not None and seq_id not in overlay and not swapped:
                    overlay[seq_id] = state.num_tokens + n
                else:
                    overlay[seq_id] = tokens_of(seq_id, f"{where}.grow.seq_ids[{j}]") + n
            if has_host:
                touched.update(op.seq_ids)
        elif isinstance(op, Free):
            for j, seq_id in enumerate(op.seq_ids):
                if swapped_tokens(seq_id) is not None:
                    out[seq_id] = None
                else:
                    tokens_of(seq_id, f"{where}.free.seq_ids[{j}]")
                overlay[seq_id] = None
        elif isinstance(op, Commit):
            n = tokens_of(op.seq_id, f"{where}.commit.seq_id")
            check_hashes(op.block_hashes, f"{where}.commit.block_hashes")
            if op.start_block < 0:
                raise invalid(f"{where}.commit.start_block must be >= 0")
            full = full_blocks(n, block_size)
            if op.start_block + len(op.block_hashes) > full:
                raise invalid(
                    f"{where}.commit: blocks {op.start_block}.."
                    f"{op.start_block + len(op.block_hashes) - 1} are not all full "
                    f"(seq_id {op.seq_id} has {full} full blocks)"
                )
        elif isinstance(op, Admit):
            absent(op.seq_id, f"{where}.admit.seq_id")
            if not 1 <= op.num_prompt_tokens <= MAX_TOKENS:
                raise invalid(f"{where}.admit.num_prompt_tokens must be >= 1")
            if not 1 <= op.max_new_tokens <= MAX_TOKENS:
                raise invalid(f"{where}.admit.max_new_tokens must be >= 1")
            if op.reserve_blocks < 0:
                raise invalid(f"{where}.admit.reserve_blocks must be >= 0")
            if not 0 <= op.pin_ttl_s <= MAX_PIN_TTL_S:  # (NaN is refused too)
                raise invalid(
                    f"{where}.admit.pin_ttl_s must be in [0, {MAX_PIN_TTL_S:g}] seconds, "
                    f"got {op.pin_ttl_s}"
                )
            if not 0 <= op.retention_priority <= MAX_RETENTION_PRIORITY:
                raise invalid(
                    f"{where}.admit.retention_priority must be in [0, "
                    f"{MAX_RETENTION_PRIORITY}], got {op.retention_priority}"
                )
            check_hashes(op.block_hashes, f"{where}.admit.block_hashes")
            if len(set(op.block_hashes)) != len(op.block_hashes):
                # A chained hash never repeats within one prompt; a repeat would put one
                # block twice in a table (refcount != tables holding it).
                raise invalid(f"{where}.admit.block_hashes: a hash is listed twice")
            if len(op.block_hashes) > full_blocks(op.num_prompt_tokens, block_size):
                raise invalid(
                    f"{where}.admit.block_hashes: {len(op.block_hashes)} hashes for "
                    f"{full_blocks(op.num_prompt_tokens, block_size)} full prompt blocks"
                )
            # The hit length is only known at apply time; min(P, M) is the fewest slots a
            # successful admission holds, so later commits are checked against that.
            overlay[op.seq_id] = min(op.num_prompt_tokens, op.max_new_tokens)
            touched.add(op.seq_id)
        elif isinstance(op, Fork):
            n = tokens_of(op.parent_seq_id, f"{where}.fork.parent_seq_id")
            absent(op.child_seq_id, f"{where}.fork.child_seq_id")
            overlay[op.child_seq_id] = n
            touched.add(op.child_seq_id)
        elif isinstance(op, SwapOut | SwapIn):
            name = "swap_out" if isinstance(op, SwapOut) else "swap_in"
            if not has_host:
                raise precondition(f"{where}.{name}: the pool has no host tier (host_blocks)")
            if len(set(op.seq_ids)) != len(op.seq_ids):
                dup = next(x for j, x in enumerate(op.seq_ids) if x in op.seq_ids[:j])
                raise invalid(f"{where}.{name}.seq_ids: seq_id {dup} is listed twice")
            for j, seq_id in enumerate(op.seq_ids):
                field = f"{where}.{name}.seq_ids[{j}]"
                if isinstance(op, SwapOut):
                    n = tokens_of(seq_id, field)
                    if seq_id in touched:
                        # Its blocks are copied out before this Step's fills (onboards,
                        # copies) are made: it must not have got any in this Step.
                        raise precondition(
                            f"{field}: seq_id {seq_id} was admitted, forked, grown or swapped "
                            "in earlier in this Step; swap it out in a Step of its own"
                        )
                    overlay[seq_id], out[seq_id] = None, n
                else:
                    n_out = swapped_tokens(seq_id)
                    if n_out is None:
                        tokens_of(seq_id, field)  # unknown or freed: that error
                        raise precondition(f"{field}: seq_id {seq_id} is not swapped out")
                    overlay[seq_id], out[seq_id] = n_out, None
                    touched.add(seq_id)
        elif isinstance(op, Uncache):
            if i:  # (before any move of this Step could read what it forgets)
                raise invalid(f"{where}.uncache must be the Step's first operation")
            check_uncache(op, sizes, f"{where}.uncache")
        else:
            raise invalid(f"{where}: unknown operation {type(op).__name__}")


def check_uncache(op: Uncache, sizes: tuple[int, int, int], where: str) -> None:
    num_blocks, num_host, num_disk = sizes
    check_block_ids(op.device_blocks, num_blocks, f"{where}.device_blocks")
    for name, slots, n, tier in (
        ("host_slots", op.host_slots, num_host, "host_blocks"),
        ("disk_slots", op.disk_slots, num_disk, "disk_blocks"),
    ):
        for j, slot in enumerate(slots):
            if not n:
                raise invalid(f"{where}.{name}[{j}]: the pool has no such tier ({tier})")
            if not 0 <= slot < n:
                raise invalid(f"{where}.{name}[{j}] = {slot} is out of range [0, {n})")


def check_seq_id(seq_id: int, where: str) -> None:
    if not 0 <= seq_id <= MAX_SEQ_ID:
        raise invalid(f"{where} must be a uint64, got {seq_id}")


def check_hashes(hashes: Iterable[bytes], where: str) -> None:
    for j, h in enumerate(hashes):
        if len(h) != HASH_SIZE:
            raise invalid(f"{where}[{j}] must be {HASH_SIZE} bytes, got {len(h)}")


def check_block_ids(
    block_ids: Iterable[int], num_blocks: int, where: str, *, offset: int = 0
) -> None:
    for j, b in enumerate(block_ids, start=offset):
        if b == NULL_BLOCK:
            raise invalid(
                f"{where}[{j}]: block 0 is reserved (null entries may only lead the table of "
                "a sliding group)"
            )
        if not 0 < b < num_blocks:
            raise invalid(f"{where}[{j}] = {b} is out of range [1, {num_blocks})")


__all__ = [
    "MAX_SEQ_ID",
    "MAX_TOKENS",
    "check_block_ids",
    "check_hashes",
    "check_seq_id",
    "check_uncache",
    "validate_step",
]
