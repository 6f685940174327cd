"""One-operation Steps for the conformance tests, written against :class:`BlockManagerClient`
(block size :data:`BS`)."""

from __future__ import annotations

from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import (
    Admit,
    AdmitResult,
    Free,
    FreeResult,
    Grow,
    GrowResult,
    Operation,
)
from tests.blockmgr.helpers import hashes

BS = 4


def step1(client: BlockManagerClient, pool_id: str, epoch: int, op: Operation):
    """The result of a Step of ``op`` alone."""
    (res,) = client.step(pool_id, epoch, [op]).results
    return res


def admit(
    client: BlockManagerClient,
    pool_id: str,
    epoch: int,
    seq_id: int,
    tokens: list[int],
    *,
    budget: int = 10**6,
    salt: bytes = b"",
    reserve: int = 0,
) -> AdmitResult:
    res = step1(
        client,
        pool_id,
        epoch,
        Admit(seq_id, len(tokens), budget, hashes(tokens, BS, salt), reserve),
    )
    assert isinstance(res, AdmitResult)
    return res


def grow(client: BlockManagerClient, pool_id: str, epoch: int, seq_id: int, n: int) -> GrowResult:
    res = step1(client, pool_id, epoch, Grow((seq_id,), (n,)))
    assert isinstance(res, GrowResult)
    return res


def free(client: BlockManagerClient, pool_id: str, epoch: int, *seq_ids: int) -> FreeResult:
    res = step1(client, pool_id, epoch, Free(tuple(seq_ids)))
    assert isinstance(res, FreeResult)
    return res


def in_use(client: BlockManagerClient, pool_id: str) -> int:
    return client.stats(pool_id).counters.num_in_use_blocks
