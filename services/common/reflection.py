"""gRPC server reflection under both names: ``grpc.reflection.v1`` (what grpcurl and current
clients ask first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection ships only v1alpha. v1 is the same protocol under another package: its
messages are v1alpha's, field for field, so v1alpha's servicer answers both, on the wire. The
v1 file descriptor, derived here from v1alpha's, is added to the default descriptor pool (once,
unless a library has added it already), so that reflection describes its v1 service too and
:func:`v1_messages` gives a client v1's request and response classes.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import Message
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = v1alpha.SERVICE_NAME
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
_V1_OPTIONS = {
    "java_package": "io.grpc.reflection.v1",
    "java_outer_classname": "ServerReflectionProto",
    "java_multiple_files": True,
    "go_package": "google.golang.org/grpc/reflection/grpc_reflection_v1",
}


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection on ``server``, v1 and v1alpha, listing ``service_names`` and both
    reflection services."""
    v1_file_descriptor()
    servicer = v1alpha.aio.ReflectionServicer((*service_names, *SERVICE_NAMES))
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),)
    )


def v1_file_descriptor() -> FileDescriptor:
    """``grpc/reflection/v1/reflection.proto`` in the default pool (added on first call)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's are deprecated=true and its Java / Go names
    for name, value in _V1_OPTIONS.items():
        setattr(proto.options, name, value)
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:  # a message field (setting it on a scalar one is an error)
                field.type_name = field.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    pool.Add(proto)
    return pool.FindFileByName(V1_FILE)


def v1_messages() -> tuple[type[Message], type[Message]]:
    """v1's ``ServerReflectionRequest`` and ``ServerReflectionResponse`` classes, for a
    client (the ``ServerReflectionInfo`` method is bidirectional streaming)."""
    messages = v1_file_descriptor().message_types_by_name
    return (
        message_factory.GetMessageClass(messages["ServerReflectionRequest"]),
        message_factory.GetMessageClass(messages["ServerReflectionResponse"]),
    )
