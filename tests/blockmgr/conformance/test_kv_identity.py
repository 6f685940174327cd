"""The contract's KV identity (``RegisterPoolRequest.kv_cache_dtype`` / ``kv_scales``): echoed
in PoolInfo, and a pool registered again under another dtype is a new epoch whose cache holds
nothing of the old one (no block stored under one dtype is a hit under another). Skipped
against an implementation that echoes neither."""

from __future__ import annotations

import pytest

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.types import Commit, Free, PoolSpec
from tests.blockmgr.conformance.ops import BS, admit
from tests.blockmgr.helpers import hashes, raises_code

PROMPT = list(range(100, 117))  # 4 full blocks and one token


def test_the_kv_dtype_and_scales_are_echoed_and_a_change_keeps_no_block(client, pool_id) -> None:
    spec = PoolSpec(17, BS, kv_cache_dtype="float8_e4m3fn", kv_scales="0f1e2d3c")
    info = client.register(pool_id, spec)
    if info.kv_cache_dtype != "float8_e4m3fn":
        pytest.skip("this implementation echoes no KV dtype")
    assert info.kv_scales == "0f1e2d3c"
    epoch = info.epoch
    assert admit(client, pool_id, epoch, 1, PROMPT).num_cached_tokens == 0
    client.step(pool_id, epoch, [Commit(1, 0, hashes(PROMPT, BS)), Free((1,))])
    assert admit(client, pool_id, epoch, 2, PROMPT).num_cached_tokens == 4 * BS
    other = client.register(
        pool_id, PoolSpec(17, BS, kv_cache_dtype="float32"), owner_token=info.owner_token
    )
    assert other.epoch != epoch and other.kv_cache_dtype == "float32"
    assert admit(client, pool_id, other.epoch, 3, PROMPT).num_cached_tokens == 0


def test_an_overlong_kv_identity_is_invalid_argument_naming_it(client, pool_id) -> None:
    with raises_code(ErrorCode.INVALID_ARGUMENT, "kv_scales"):
        client.register(pool_id, PoolSpec(17, BS, kv_scales="x" * 65))
