"""Workload traces of a block manager: what its pools were asked, in order, to replay offline.

``pagedserve blockmgr --record-trace FILE`` appends one JSON line per call that changed a pool
(a Register, an accepted Step, empty ones included since a Step is also the pool's clock, a
Restore, an Unregister or a lease expiry); a Step refused as a whole changed nothing and is not
written. Lines are written whole (line-buffered). Hashes are base64. A line::

    {"t": "register", "pool": "p", "num_blocks": 257, "block_size": 16, "prefix": true,
     "policy": "lru", "groups": [["sliding", 64, [0, 1]], ["full", 0, [2]]],
     "retention_steps": 4096}
    {"t": "step", "pool": "p", "ops": [{"admit": [seq, prompt, max_new, [hash...], reserve,
     retention_priority, pin_ttl_s]},
     {"grow": [[seq...], [n...]]}, {"fork": [parent, child]}, {"free": [seq...]},
     {"commit": [seq, start, [hash...]]}, {"swap_out": [seq...]}, {"swap_in": [seq...]}]}
    {"t": "restore", "pool": "p",
     "seqs": [[seq, num_tokens, [block...], [hash...], [slot...], num_lookahead]]}
    {"t": "unregister", "pool": "p"}

:func:`read_trace` gives the records back as domain objects; :mod:`.replay` runs them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from services.blockmgr.api.types import (
    OP_NAMES,
    OP_TYPES,
    AttentionKindName,
    EvictionPolicyName,
    KVCacheGroup,
    Operation,
    PoolSpec,
    RestoredSequence,
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
    """``{name: value}`` for a one-field operation, ``{name: [values in field order]}``
    otherwise; hashes in base64."""
    values = [_json_value(getattr(op, f.name)) for f in dataclasses.fields(op)]
    return {OP_NAMES[type(op)]: values[0] if len(values) == 1 else values}


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return _b64(value) if value and isinstance(value[0], bytes) else list(value)
    return value


def _op_from_json(d: dict[str, Any]) -> Operation:
    """:func:`_op_json` reversed; fields recorded before they existed take their defaults."""
    ((name, v),) = d.items()
    cls = OP_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown operation {name!r}")
    fields = dataclasses.fields(cls)
    values = [v] if len(fields) == 1 else v
    return cls(
        **{f.name: _from_json_value(f.name, x) for f, x in zip(fields, values, strict=False)}
    )


def _from_json_value(name: str, value: Any) -> Any:
    if not isinstance(value, list):
        return value
    return _unb64(value) if name == "block_hashes" else tuple(value)


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
                "prefix_hit_margin": spec.prefix_hit_margin,
                "pin_budget_blocks": spec.pin_budget_blocks,
                "kv_cache_dtype": spec.kv_cache_dtype,
                "kv_scales": spec.kv_scales,
            }
        )

    def step(self, pool_id: str, ops: Sequence[Operation]) -> None:
        self._write({"t": "step", "pool": pool_id, "ops": [_op_json(op) for op in ops]})

    def restore(self, pool_id: str, sequences: Sequence[RestoredSequence]) -> None:
        seqs = [
            [
                s.seq_id,
                s.num_tokens,
                list(s.block_ids),
                _b64(s.block_hashes),
                list(s.host_slots),
                s.num_lookahead,
            ]
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
            int(d.get("prefix_hit_margin", 0)),
            int(d.get("pin_budget_blocks", 0)),
            str(d.get("kv_cache_dtype", "")),
            str(d.get("kv_scales", "")),
        )
        return RegisterRecord(pool_id, spec, int(d.get("retention_steps", DEFAULT_RETENTION_STEPS)))
    if kind == "restore":
        seqs = tuple(
            RestoredSequence(
                s[0],
                s[1],
                tuple(s[2]),
                _unb64(s[3]),
                tuple(s[4] if len(s) > 4 else ()),
                s[5] if len(s) > 5 else 0,
            )
            for s in d["seqs"]
        )
        return RestoreRecord(pool_id, seqs)
    if kind == "unregister":
        return UnregisterRecord(pool_id)
    raise ValueError(f"unknown record type {kind!r}")
