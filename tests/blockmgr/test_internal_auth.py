"""A block manager started with an internal token serves only callers that carry it; health
stays open, and a caller without it is refused before its request is even parsed."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.blockmgr.api.errors import ErrorCode
from services.blockmgr.api.types import PoolSpec
from services.blockmgr.client import GrpcClient
from services.blockmgr.service.config import BlockManagerServiceConfig
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
            client.register("victim", PoolSpec(8, 4))
        client.close()


def test_calls_with_the_internal_token_are_served(server) -> None:
    client = GrpcClient(server.address, internal_token=TOKEN)
    info = client.register("owned", PoolSpec(8, 4))
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


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An internal CA, a server certificate for 127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
        "-subj",
        "/CN=internal-ca",
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
            "-subj",
            f"/CN={name}",
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            str(d / f"{name}.pem"),
            "-extfile",
            str(d / f"{name}.ext"),
        )
    return {
        n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


def test_mtls_serves_clients_with_an_internal_certificate_only(pki) -> None:
    server_side = InternalSecurity(
        tls_cert=pki["server.pem"], tls_key=pki["server.key"], tls_ca=pki["ca.pem"]
    )
    client_side = InternalSecurity(
        tls_cert=pki["client.pem"], tls_key=pki["client.key"], tls_ca=pki["ca.pem"]
    )
    server = ThreadedServer(
        BlockManagerServiceConfig(port=0, grace_period_s=0.2, security=server_side)
    )
    try:
        good = GrpcClient(server.address, credentials=client_side.channel_credentials())
        assert good.register("mtls", PoolSpec(8, 4)).epoch > 0
        good.close()
        # TLS without a client certificate, and plaintext: both refused.
        ca = Path(pki["ca.pem"]).read_bytes()
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        for client in (
            GrpcClient(server.address, credentials=no_cert, timeout_s=3),
            GrpcClient(server.address, timeout_s=3),
        ):
            with raises_code(ErrorCode.UNAVAILABLE):
                client.info()
            client.close()
    finally:
        server.stop()


def test_internal_tls_files_go_together() -> None:
    with pytest.raises(ValueError, match="go together"):
        InternalSecurity(tls_cert="c.pem").validate()
