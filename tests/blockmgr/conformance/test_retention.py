"""The contract's retention priorities (``AdmitOp.retention_priority``): a retained prefix
outlives unretained content under pressure, and a priority beyond the served bound is refused.
Skipped against an implementation whose Info says ``max_retention_priority == 0``. The bound
in time (``--retention-steps``) is an implementation setting, tested with our core."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.api.types import Admit, Commit, Free, PoolSpec
from tests.blockmgr.conformance.ops import BS, admit, step1
from tests.blockmgr.helpers import hashes, raises_code

SYSTEM = list(range(1000, 1016))  # 4 blocks


@pytest.fixture
def max_priority(client: BlockManagerClient) -> int:
    n = client.info().max_retention_priority
    if n == 0:
        pytest.skip("this implementation serves no retention priorities")
    return n


def _turn(client, pool_id, epoch, seq_id, tokens, priority=0) -> int:
    h = hashes(tokens, BS)
    r = step1(client, pool_id, epoch, Admit(seq_id, len(tokens), len(tokens), h, 0, priority))
    client.step(pool_id, epoch, [Commit(seq_id, 0, h), Free((seq_id,))])
    return r.num_cached_tokens


@pytest.mark.parametrize("priority", [0, 1])
def test_a_retained_prefix_outlives_a_stream_of_one_off_prompts(
    client, pool_id, max_priority, priority
):
    epoch = client.register(pool_id, PoolSpec(17, BS, eviction_policy="lru")).epoch  # 16 usable
    _turn(client, pool_id, epoch, 1, [*SYSTEM, 1, 2, 3], priority)
    for j in range(8):  # 3 blocks each: the pool turns over
        _turn(client, pool_id, epoch, 10 + j, list(range(2000 + 100 * j, 2012 + 100 * j)))
    cached = _turn(client, pool_id, epoch, 99, [*SYSTEM, 7, 7])
    assert cached == (len(SYSTEM) if priority else 0)


def test_a_retention_priority_beyond_the_bound_is_invalid_argument(client, pool_id, max_priority):
    epoch = client.register(pool_id, PoolSpec(16, BS)).epoch
    with raises_code(ErrorCode.INVALID_ARGUMENT, "ops[0].admit.retention_priority"):
        client.step(pool_id, epoch, [Admit(1, 8, 8, (), 0, max_priority + 1)])
    assert admit(client, pool_id, epoch, 1, list(range(8))).num_tokens == 8
