"""Runs the conformance suite against every block-manager implementation we can reach:
ours in-process, ours over gRPC on loopback, and ``--blockmgr-address`` if given."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest

from services.blockmgr.api.errors import BlockManagerError
from services.blockmgr.api.protocol import BlockManagerClient
from services.blockmgr.client import GrpcClient, InProcessClient
from tests.blockmgr.helpers import ThreadedServer

_pool_ids = itertools.count()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        impls = ["inproc", "grpc"]
        if metafunc.config.getoption("--blockmgr-address"):
            impls.append("external")
        metafunc.parametrize("impl", impls, scope="session")


@pytest.fixture(scope="session")
def loopback_server() -> Iterator[ThreadedServer]:
    server = ThreadedServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(impl: str, request: pytest.FixtureRequest) -> Iterator[BlockManagerClient]:
    if impl == "inproc":
        c: BlockManagerClient = InProcessClient()
    elif impl == "grpc":
        c = GrpcClient(request.getfixturevalue("loopback_server").address)
    else:
        c = GrpcClient(request.config.getoption("--blockmgr-address"))
    yield c
    c.close()


@pytest.fixture
def other_client(impl: str, client: BlockManagerClient, request: pytest.FixtureRequest):
    """A second client of the same implementation: another would-be owner."""
    if impl == "inproc":
        assert isinstance(client, InProcessClient)
        c: BlockManagerClient = InProcessClient(client.core)
    elif impl == "grpc":
        c = GrpcClient(request.getfixturevalue("loopback_server").address)
    else:
        c = GrpcClient(request.config.getoption("--blockmgr-address"))
    yield c
    c.close()


@pytest.fixture
def pool_id(request: pytest.FixtureRequest, client: BlockManagerClient) -> Iterator[str]:
    """A fresh pool id per test, so an external server's state never leaks between tests;
    unregistered afterwards when the test left it registered by ``client``."""
    pool_id = f"conformance-{request.node.name[:60]}-{next(_pool_ids)}"
    yield pool_id
    with contextlib.suppress(BlockManagerError):
        (pool,) = client.info(pool_id).pools
        client.unregister(pool_id, pool.epoch)
