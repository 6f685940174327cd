"""Every service serves gRPC reflection as ``grpc.reflection.v1`` (grpcurl and current
clients ask it first) and ``grpc.reflection.v1alpha``, through ``add_health_and_reflection``."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from pagedserve.v1 import generation_pb2
from services.common.grpc_server import MalformedRequestInterceptor, add_health_and_reflection
from services.common.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME, v1_messages

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def _ask(service: str, request_type, response_type, *requests) -> list:
    """Send ``requests`` on one ``ServerReflectionInfo`` stream of ``service`` to a server set
    up as the services set theirs up; return the responses."""
    server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()])
    add_health_and_reflection(server, GENERATION)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                f"/{service}/ServerReflectionInfo",
                request_serializer=request_type.SerializeToString,
                response_deserializer=response_type.FromString,
            )
            return [response async for response in call(iter(requests))]
    finally:
        await server.stop(None)


def _v1(**requests: str) -> list:
    """Ask v1 reflection one request per keyword (its field and value), in order."""
    request_type, response_type = v1_messages()  # classes of no module: not module globals
    sent = [request_type(**{field: value}) for field, value in requests.items()]
    return asyncio.run(_ask(V1_SERVICE_NAME, request_type, response_type, *sent))


def test_a_v1_reflection_client_lists_the_services() -> None:
    (response,) = _v1(list_services="")
    assert response.DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionResponse"
    names = {s.name for s in response.list_services_response.service}
    assert names == {GENERATION, health.SERVICE_NAME, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME}


def test_a_v1_reflection_client_reads_the_descriptors_v1_itself_included() -> None:
    files = []
    for symbol in (GENERATION, V1_SERVICE_NAME):
        (response,) = _v1(file_containing_symbol=symbol)
        assert not response.HasField("error_response"), response.error_response
        proto = descriptor_pb2.FileDescriptorProto()
        proto.ParseFromString(response.file_descriptor_response.file_descriptor_proto[0])
        files.append(proto)
    assert [s.name for s in files[0].service] == ["Generation", "Adapters"]
    assert (files[1].name, files[1].package) == (
        "grpc/reflection/v1/reflection.proto",
        "grpc.reflection.v1",
    )
    (method,) = files[1].service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert not files[1].options.deprecated  # v1alpha's is


def test_v1alpha_is_still_served() -> None:
    (response,) = asyncio.run(
        _ask(
            V1ALPHA_SERVICE_NAME,
            v1alpha_pb2.ServerReflectionRequest,
            v1alpha_pb2.ServerReflectionResponse,
            v1alpha_pb2.ServerReflectionRequest(list_services=""),
        )
    )
    assert V1_SERVICE_NAME in {s.name for s in response.list_services_response.service}
