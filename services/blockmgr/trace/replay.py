"""Offline replay of a recorded block-manager trace under other eviction policies and pool sizes:
compare policies in seconds, without a model.

    pagedserve blockmgr replay TRACE [--policy lru,lfu,arc,s3fifo,reuse] [--device-blocks N]

(A public trace, ``--format mooncake|bailian``, is a cache experiment instead: :mod:`.sweep`.)

Each pool of the trace is rebuilt from its Register record (``--device-blocks``: its
``num_blocks``, the null block included, instead of the recorded one; ``--policy``: its
eviction policy) and driven through the real :class:`~.kv_manager.KVBlockManager` by the
recorded Steps and Restores. Replayed as recorded, it reproduces the live run exactly (the same
hits, evictions, copies). Under another policy or size the pool may refuse what the live one
granted: an admission refused in the replay, or a grow that no longer fits (that sequence is
freed), makes the replay drop the sequence's later operations until the trace admits it again
(a preempted sequence is); they are counted as ``dropped``, apart from the admissions refused
(which the live pool refuses too, and the executor sends again later). The hit ratio is that of
the prompt tokens looked up at admission, as the pool's statistics count it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.blockmgr.api.errors import BlockManagerError
from services.blockmgr.api.types import (
    Admit,
    Commit,
    EvictionPolicyName,
    Fork,
    Free,
    Grow,
    GrowResult,
    Operation,
    OpResult,
    OpStatus,
    SwapIn,
    SwapInResult,
    SwapOut,
    SwapOutResult,
    Uncache,
)
from services.blockmgr.pool.manager import KVBlockManager
from services.blockmgr.trace.public import FORMATS
from services.blockmgr.trace.record import (
    RegisterRecord,
    RestoreRecord,
    StepRecord,
    TraceRecord,
    read_trace,
)
from services.common.blocks import full_blocks

__all__ = ["ReplayResult", "main", "replay"]


@dataclass
class ReplayResult:
    """Totals over the trace's pools."""

    policy: str
    num_blocks: int | None  # None: as recorded
    num_steps: int = 0
    num_ops: int = 0
    queries_tokens: int = 0
    hits_tokens: int = 0
    num_evicted_blocks: int = 0
    num_cow_copies: int = 0
    num_dropped: int = 0  # running sequences the replayed pool could not hold (grow, restore)
    num_refused_admissions: int = 0  # admissions refused (live too, where they were then)
    host_hits_tokens: int = 0  # of hits_tokens, onboarded from the host tier
    num_offloaded_blocks: int = 0
    num_onboarded_blocks: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    disk_hits_tokens: int = 0  # of hits_tokens, loaded from the disk tier
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else 0.0


class _ReplayedPool:
    def __init__(
        self,
        record: RegisterRecord,
        policy: EvictionPolicyName | None,
        num_blocks: int | None,
        host_blocks: int | None = None,
        tier_policy: EvictionPolicyName | None = None,
    ) -> None:
        recorded = record.spec
        tier_ok = len(recorded.groups) == 1 and not recorded.groups[0].sliding_window
        host = host_blocks if host_blocks is not None and tier_ok else recorded.host_blocks
        spec = dataclasses.replace(
            recorded,
            num_blocks=num_blocks or recorded.num_blocks,
            eviction_policy=policy or recorded.eviction_policy,
            # (an override of the tier applies to the pools that can have one)
            host_blocks=host,
            # (the disk tier as recorded, while the pool keeps a host tier above it)
            disk_blocks=recorded.disk_blocks if host_blocks != 0 else 0,
            tier_eviction_policy=tier_policy or recorded.tier_eviction_policy,
        )
        self.manager = KVBlockManager(spec, retention_steps=record.retention_steps)
        self.num_dropped = 0
        self.num_refused_admissions = 0
        # A failed move of the recorded run names its blocks and slots: replayed only where
        # they are the same ones (the pool as recorded).
        sizes = (recorded.num_blocks, recorded.host_blocks, recorded.disk_blocks)
        self._as_recorded = self.manager.pool.sizes == sizes

    def step(self, ops: Sequence[Operation]) -> int:
        """Apply the recorded ``ops`` that still make sense here; returns how many."""
        m = self.manager
        kept = self._kept(ops)
        results = m.step(kept)  # (empty too: a Step is also the pool's clock)
        self._drop_refused(kept, results)
        return len(kept)

    def _kept(self, ops: Sequence[Operation]) -> list[Operation]:
        """``ops`` without those on sequences this pool does not hold as the live one did:
        simulated through the step, as the pool validates it."""
        m, bs = self.manager, self.manager.block_size
        tokens: dict[int, int] = {s: st.num_tokens for s, st in m.seqs.items()}  # the live ones
        swapped: dict[int, int] = {s: st.num_tokens for s, st in m.swapped.items()}
        kept: list[Operation] = []
        for op in ops:
            if isinstance(op, Grow):
                lookahead = op.num_lookahead or (0,) * len(op.seq_ids)
                entries = [
                    (s, n, la)
                    for s, n, la in zip(op.seq_ids, op.num_tokens, lookahead, strict=True)
                    if s in tokens
                ]
                for s, n, _ in entries:
                    tokens[s] += n
                if entries:
                    kept.append(
                        Grow(
                            tuple(e[0] for e in entries),
                            tuple(e[1] for e in entries),
                            tuple(e[2] for e in entries) if op.num_lookahead else (),
                        )
                    )
            elif isinstance(op, Free):
                live = tuple(s for s in op.seq_ids if s in tokens or s in swapped)
                for s in live:
                    tokens.pop(s, None)
                    swapped.pop(s, None)
                if live:
                    kept.append(Free(live))
            elif isinstance(op, SwapOut):
                live = tuple(s for s in op.seq_ids if s in tokens)
                for s in live:
                    if m.pool.host is not None:
                        swapped[s] = tokens[s]
                    del tokens[s]
                if live:  # without a host tier here: recomputed (a Free)
                    kept.append(SwapOut(live) if m.pool.host is not None else Free(live))
            elif isinstance(op, SwapIn):
                back = tuple(s for s in op.seq_ids if s in swapped)
                for s in back:
                    tokens[s] = swapped.pop(s)
                if back:
                    kept.append(SwapIn(back))
            elif isinstance(op, Commit):
                if op.seq_id in tokens:
                    room = full_blocks(tokens[op.seq_id], bs) - op.start_block
                    fit = max(0, min(len(op.block_hashes), room))
                    if fit:
                        kept.append(Commit(op.seq_id, op.start_block, op.block_hashes[:fit]))
            elif isinstance(op, Uncache):
                if self._as_recorded:
                    kept.append(op)
            elif isinstance(op, Admit):
                if op.seq_id not in tokens:
                    tokens[op.seq_id] = min(op.num_prompt_tokens, op.max_new_tokens)
                    kept.append(op)
            elif (
                isinstance(op, Fork)
                and op.parent_seq_id in tokens
                and op.child_seq_id not in tokens
            ):
                tokens[op.child_seq_id] = tokens[op.parent_seq_id]
                kept.append(op)
        return kept

    def _drop_refused(self, ops: Sequence[Operation], results: Sequence[OpResult]) -> None:
        """Free the sequences whose grow, swap-out or swap-in no longer fits (the recorded
        run went on with them; this one cannot); count them and refused admissions."""
        m = self.manager
        for op, result in zip(ops, results, strict=True):
            if isinstance(op, Admit) and result.status is not OpStatus.OK:  # type: ignore[union-attr]
                self.num_refused_admissions += 1
            elif isinstance(op, SwapOut | SwapIn) and isinstance(
                result, SwapOutResult | SwapInResult
            ):
                refused = tuple(
                    s
                    for s, status in zip(op.seq_ids, result.statuses, strict=True)
                    if status is OpStatus.RESOURCE_EXHAUSTED
                )
                if refused:
                    m.release(refused)
                    self.num_dropped += len(refused)
            elif isinstance(op, Grow) and isinstance(result, GrowResult):
                refused = tuple(
                    s
                    for s, status in zip(op.seq_ids, result.statuses, strict=True)
                    if status is OpStatus.RESOURCE_EXHAUSTED and s in m.seqs
                )
                if refused:
                    m.release(refused)  # (not a Step of the pool: no tick)
                    self.num_dropped += len(refused)


def replay(
    records: Iterable[TraceRecord],
    *,
    policy: EvictionPolicyName | None = None,
    num_blocks: int | None = None,
    host_blocks: int | None = None,
    tier_policy: EvictionPolicyName | None = None,
) -> ReplayResult:
    """Run ``records`` through fresh pools (see the module docstring); ``host_blocks``: each
    pool's host tier instead of the recorded one (0: none); ``tier_policy``: the tiers' eviction
    policy instead of the recorded one."""
    result = ReplayResult(policy.value if policy else "recorded", num_blocks)
    pools: dict[str, _ReplayedPool] = {}
    done: list[_ReplayedPool] = []
    start = time.perf_counter()
    for record in records:
        if isinstance(record, RegisterRecord):
            if record.pool_id in pools:
                done.append(pools[record.pool_id])
            pools[record.pool_id] = _ReplayedPool(
                record, policy, num_blocks, host_blocks, tier_policy
            )
            continue
        pool = pools.get(record.pool_id)
        if pool is None:
            continue
        if isinstance(record, StepRecord):
            result.num_steps += 1
            result.num_ops += pool.step(record.ops)
        elif isinstance(record, RestoreRecord):
            try:
                pool.manager.restore(record.sequences)
            except BlockManagerError:  # the tables do not fit this pool: those sequences go
                pool.num_dropped += len(record.sequences)
        else:
            done.append(pools.pop(record.pool_id))
    for pool in [*done, *pools.values()]:
        m = pool.manager
        result.queries_tokens += m.prefix_queries_tokens
        result.hits_tokens += m.prefix_hits_tokens
        result.num_evicted_blocks += m.pool.num_evicted
        result.num_cow_copies += m.num_cow_copies
        result.num_dropped += pool.num_dropped
        result.num_refused_admissions += pool.num_refused_admissions
        result.host_hits_tokens += m.host_hits_tokens
        if m.pool.host is not None:
            result.num_offloaded_blocks += m.pool.host.num_offloaded
            result.num_onboarded_blocks += m.pool.host.num_onboarded
            result.num_swapped_out_blocks += m.pool.host.num_swapped_out
            result.num_swapped_in_blocks += m.pool.host.num_swapped_in
        result.disk_hits_tokens += m.disk_hits_tokens
    result.seconds = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    formats = ["pagedserve", *sorted(FORMATS)]
    pre = argparse.ArgumentParser(prog="pagedserve blockmgr replay", add_help=False)
    pre.add_argument("--format", choices=formats, default="pagedserve")
    if pre.parse_known_args(argv)[0].format != "pagedserve":  # a public trace (.sweep)
        from services.blockmgr.trace.sweep import main as sweep_main

        return sweep_main(argv)
    p = argparse.ArgumentParser(
        prog="pagedserve blockmgr replay",
        description="Replay a trace recorded with `pagedserve blockmgr --record-trace` under "
        "other eviction policies and pool sizes; prints one row per policy.",
    )
    p.add_argument("trace", help="the trace file (JSON lines)")
    p.add_argument(
        "--format",
        choices=formats,
        default="pagedserve",
        help="pagedserve: recorded with --record-trace; mooncake, bailian: a public trace, "
        "replayed as a cache experiment (see `--format mooncake --help`)",
    )
    p.add_argument(
        "--policy",
        default="recorded",
        help="comma-separated eviction policies, of "
        f"{[x.value for x in EvictionPolicyName]}, or 'recorded' (default)",
    )
    p.add_argument(
        "--device-blocks",
        type=int,
        default=None,
        help="each pool's num_blocks (the null block included) instead of the recorded one",
    )
    p.add_argument(
        "--host-blocks",
        type=int,
        default=None,
        help="each pool's host tier in blocks instead of the recorded one (0: none)",
    )
    p.add_argument(
        "--tier-policy",
        default=None,
        help="comma-separated eviction policies of the host and disk tiers, one row each "
        "with every --policy (default: the recorded one)",
    )
    args = p.parse_args(argv)
    try:
        names = [x.strip() for x in args.policy.split(",") if x.strip()]
        policies = [None if x == "recorded" else EvictionPolicyName.parse(x) for x in names]
        tier_names = [x.strip() for x in (args.tier_policy or "").split(",") if x.strip()]
        tier_policies: list[EvictionPolicyName | None] = [
            EvictionPolicyName.parse(x) for x in tier_names
        ] or [None]
    except ValueError as exc:
        p.error(str(exc))
    if args.device_blocks is not None and args.device_blocks < 2:
        p.error("--device-blocks must be >= 2")
    if args.host_blocks is not None and args.host_blocks < 0:
        p.error("--host-blocks must be >= 0")
    try:
        records = list(read_trace(args.trace))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    num_ops = sum(len(r.ops) for r in records if isinstance(r, StepRecord))
    print(f"trace {args.trace}: {len(records)} records, {num_ops} operations\n")
    print(
        "| policy | tier policy | device blocks | prompt tokens looked up | hit tokens | hit "
        "ratio | host / disk hit tokens | offloaded / onboarded | evicted blocks | "
        "copy-on-write | admissions refused | dropped sequences | replay s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy, tier in [(p_, t) for p_ in policies for t in tier_policies]:
        r = replay(
            records,
            policy=policy,
            num_blocks=args.device_blocks,
            host_blocks=args.host_blocks,
            tier_policy=tier,
        )
        blocks = "recorded" if r.num_blocks is None else str(r.num_blocks)
        print(
            f"| {r.policy} | {tier.value if tier else 'recorded'} | {blocks} | "
            f"{r.queries_tokens:,} | {r.hits_tokens:,} | {r.hit_ratio:.1%} | "
            f"{r.host_hits_tokens:,} / {r.disk_hits_tokens:,} | "
            f"{r.num_offloaded_blocks:,} / {r.num_onboarded_blocks:,} | "
            f"{r.num_evicted_blocks:,} | {r.num_cow_copies:,} | "
            f"{r.num_refused_admissions:,} | {r.num_dropped:,} | {r.seconds:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
