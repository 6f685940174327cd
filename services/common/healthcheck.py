"""``python -m services.common.healthcheck HOST:PORT``: exit 0 iff the service is SERVING.

A client of the standard ``grpc.health.v1`` service for container healthchecks
(``compose.yaml``) and scripts. It asks the overall status (service ``""``) unless
``--service`` names one, gives up after ``--timeout`` seconds, and prints one line saying
what it found. Exit status: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, timeout).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """Ask ``address`` for the health of ``service``; return (serving, what was found)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    status = response.status
    return status == health_pb2.HealthCheckResponse.SERVING, (
        health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.common.healthcheck",
        description="Exit 0 iff the gRPC health service at ADDRESS reports SERVING.",
    )
    p.add_argument("address", help="host:port of the service")
    p.add_argument("--service", default="", help="service name to ask about (default: overall)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default %(default)s)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    serving, found = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {found}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
