"""A block manager started with an internal token serves only callers that carry it; health
stays open, and a caller without it is refused before its request is even parsed."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.blockmgr.client import GrpcClient
from services.blockmgr.config import BlockManagerServiceConfig
from services.blockmgr.errors import ErrorCode
from services.common.auth import INTERNAL_TOKEN_HEADER, InternalSecurity
from tests.blockmgr.helpers import ThreadedServer, raises_code

TOKEN = "internal-secret"


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    config = BlockManagerServiceConfig(
        port=0, grace_period_s=0.2, security=InternalSecurity(token=TOKEN)
    )
    s = ThreadedServer(config)
    yield s
    s.stop()


def test_calls_without_the_internal_token_are_unauthenticated(server) -> None:
    for token in (None, "wrong"):
        client = GrpcClient(server.address, internal_token=token)
        with raises_code(ErrorCode.UNAUTHENTICATED, INTERNAL_TOKEN_HEADER):
            client.info()
        with raises_code(ErrorCode.UNAUTHENTICATED):
            client.register("victim", 8, 4)
        client.close()


def test_calls_with_the_internal_token_are_served(server) -> None:
    client = GrpcClient(server.address, internal_token=TOKEN)
    info = client.register("owned", 8, 4)
    assert client.stats("owned").pool.epoch == info.epoch
    client.unregister("owned", info.epoch)
    client.close()


def test_health_stays_open_and_garbage_without_a_token_is_unauthenticated(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        raw = channel.unary_unary("/pagedserve.v1.BlockManager/Step")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff not a protobuf", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
