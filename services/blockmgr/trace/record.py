"""Workload traces of a block manager: what its pools were asked, in order, to replay offline.

``pagedserve blockmgr --record-trace FILE`` appends one JSON line per call that changed a pool
(a Register, an accepted Step, empty ones included since a Step is also the pool's clock, a
Restore, an Unregister or a lease expiry); a Step refused as a whole changed nothing and is not
written. Lines are written whole (line-buffered). Hashes are base64. A line::

    {"t": "register", "pool": "p", "num_blocks": 257, "block_size": 16, "prefix": true,
     "policy": "lru", "groups": [["sliding", 64, [0, 1]], ["full", 0, [2]]],
     "retention_steps": 4096}
    {"t": "step", "pool": "p", "ops": [{"admit": [seq, prompt, max_new, [hash...], reserve,
     retention_priority]},
     {"grow": [[seq...], [n...]]}, {"fork": [parent, child]}, {"free": [seq...]},
     {"commit": [seq, start, [hash...]]}, {"swap_out": [seq...]}, {"swap_in": [seq...]}]}
    {"t": "restore", "pool": "p", "seqs": [[seq, num_tokens, [block...], [hash...], [slot...]]]}
    {"t": "unregister", "pool": "p"}

:func:`read_trace` gives the records back as domain objects; :mod:`.replay` runs them.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from services.blockmgr.api.types import (
    Admit,
    AttentionKindName,
    Commit,
    EvictionPolicyName,
    Fork,
    Free,
    Grow,
    KVCacheGroup,
    Operation,
    PoolSpec,
    RestoredSequence,
    SwapIn,
    SwapOut,
    Uncache,
)
from services.blockmgr.eviction.retention import DEFAULT_RETENTION_STEPS

__all__ = [
    "RegisterRecord",
    "RestoreRecord",
    "StepRecord",
    "TraceRecord",
    "TraceWriter",
    "UnregisterRecord",
    "read_trace",
]


@dataclass(frozen=True)
class RegisterRecord:
    pool_id: str
    spec: PoolSpec  # policies parsed, groups as registered
    retention_steps: int = DEFAULT_RETENTION_STEPS


@dataclass(frozen=True)
class StepRecord:
    pool_id: str
    ops: tuple[Operation, ...]


@dataclass(frozen=True)
class RestoreRecord:
    pool_id: str
    sequences: tuple[RestoredSequence, ...]


@dataclass(frozen=True)
class UnregisterRecord:
    pool_id: str


TraceRecord = RegisterRecord | StepRecord | RestoreRecord | UnregisterRecord


def _b64(hashes: Sequence[bytes]) -> list[str]:
    return [base64.b64encode(h).decode() for h in hashes]


def _unb64(hashes: Sequence[str]) -> tuple[bytes, ...]:
    return tuple(base64.b64decode(h) for h in hashes)


def _op_json(op: Operation) -> dict[str, Any]:
    if isinstance(op, Grow):
        return {"grow": [list(op.seq_ids), list(op.num_tokens)]}
    if isinstance(op, Free):
        return {"free": list(op.seq_ids)}
    if isinstance(op, Commit):
        return {"commit": [op.seq_id, op.start_block, _b64(op.block_hashes)]}
    if isinstance(op, Admit):
        return {
            "admit": [
                op.seq_id,
                op.num_prompt_tokens,
                op.max_new_tokens,
                _b64(op.block_hashes),
                op.reserve_blocks,
                op.retention_priority,
            ]
        }
    if isinstance(op, SwapOut):
        return {"swap_out": list(op.seq_ids)}
    if isinstance(op, SwapIn):
        return {"swap_in": list(op.seq_ids)}
    if isinstance(op, Uncache):
        return {"uncache": [list(op.device_blocks), list(op.host_slots), list(op.disk_slots)]}
    return {"fork": [op.parent_seq_id, op.child_seq_id]}


def _op_from_json(d: dict[str, Any]) -> Operation:
    ((kind, v),) = d.items()
    if kind == "grow":
        return Grow(tuple(v[0]), tuple(v[1]))
    if kind == "free":
        return Free(tuple(v))
    if kind == "commit":
        return Commit(v[0], v[1], _unb64(v[2]))
    if kind == "admit":
        return Admit(v[0], v[1], v[2], _unb64(v[3]), v[4], v[5] if len(v) > 5 else 0)
    if kind == "fork":
        return Fork(v[0], v[1])
    if kind == "swap_out":
        return SwapOut(tuple(v))
    if kind == "swap_in":
        return SwapIn(tuple(v))
    if kind == "uncache":
        return Uncache(tuple(v[0]), tuple(v[1]), tuple(v[2]))
    raise ValueError(f"unknown operation {kind!r}")


class TraceWriter:
    """Appends records to ``path`` (thread-safe; each line flushed whole)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()
        self.num_records = 0

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self.num_records += 1

    def register(
        self, pool_id: str, spec: PoolSpec, retention_steps: int = DEFAULT_RETENTION_STEPS
    ) -> None:
        """``spec`` as the core holds it (policies parsed)."""
        self._write(
            {
                "t": "register",
                "pool": pool_id,
                "num_blocks": spec.num_blocks,
                "block_size": spec.block_size,
                "prefix": spec.enable_prefix_caching,
                "policy": EvictionPolicyName(spec.eviction_policy).value,
                "groups": [[g.kind.value, g.sliding_window, list(g.layers)] for g in spec.groups],
                "retention_steps": retention_steps,
                "host_blocks": spec.host_blocks,
                "disk_blocks": spec.disk_blocks,
                "tier_policy": EvictionPolicyName(spec.tier_eviction_policy).value,
            }
        )

    def step(self, pool_id: str, ops: Sequence[Operation]) -> None:
        self._write({"t": "step", "pool": pool_id, "ops": [_op_json(op) for op in ops]})

    def restore(self, pool_id: str, sequences: Sequence[RestoredSequence]) -> None:
        seqs = [
            [s.seq_id, s.num_tokens, list(s.block_ids), _b64(s.block_hashes), list(s.host_slots)]
            for s in sequences
        ]
        self._write({"t": "restore", "pool": pool_id, "seqs": seqs})

    def unregister(self, pool_id: str) -> None:
        self._write({"t": "unregister", "pool": pool_id})

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_trace(path: str | Path) -> Iterator[TraceRecord]:
    """The records of a trace file, in order. ``ValueError`` naming the line for a bad one."""
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield _record(json.loads(line))
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record ({exc})") from None


def _record(d: dict[str, Any]) -> TraceRecord:
    kind, pool_id = d["t"], d["pool"]
    if kind == "step":
        return StepRecord(pool_id, tuple(_op_from_json(op) for op in d["ops"]))
    if kind == "register":
        groups = tuple(
            KVCacheGroup(AttentionKindName(k), int(w), tuple(layers))
            for k, w, layers in d["groups"]
        )
        spec = PoolSpec(
            int(d["num_blocks"]),
            int(d["block_size"]),
            bool(d["prefix"]),
            EvictionPolicyName.parse(d["policy"]),
            groups,
            int(d.get("host_blocks", 0)),
            int(d.get("disk_blocks", 0)),
            EvictionPolicyName.parse(d.get("tier_policy", "lru")),
        )
        return RegisterRecord(pool_id, spec, int(d.get("retention_steps", DEFAULT_RETENTION_STEPS)))
    if kind == "restore":
        seqs = tuple(
            RestoredSequence(
                s[0], s[1], tuple(s[2]), _unb64(s[3]), tuple(s[4] if len(s) > 4 else ())
            )
            for s in d["seqs"]
        )
        return RestoreRecord(pool_id, seqs)
    if kind == "unregister":
        return UnregisterRecord(pool_id)
    raise ValueError(f"unknown record type {kind!r}")
