"""gRPC server reflection, both versions: ``grpc.reflection.v1`` (what grpcurl and newer clients ask
first) and ``grpc.reflection.v1alpha`` (older ones).

grpcio-reflection ships only v1alpha. The v1 protocol is the same file under another package (same
messages, same field numbers), so one servicer answers both: v1's method is registered with v1alpha's
(wire-identical) messages, and v1's file descriptor is added to the default pool so that it can be
described like any other service.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE = "grpc.reflection.v1.ServerReflection"


def _add_v1_descriptor() -> None:
    """grpc/reflection/v1/reflection.proto in the default pool (once per process)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1_SERVICE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name = "grpc/reflection/v1/reflection.proto"
    file.package = "grpc.reflection.v1"
    file.ClearField("options")  # v1alpha's are deprecated=true and name v1alpha's Java/Go packages
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."  # fully qualified type names
    for message in file.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(old, new)
    for method in file.service[0].method:
        method.input_type, method.output_type = (t.replace(old, new) for t in (method.input_type, method.output_type))
    pool.AddSerializedFile(file.SerializeToString())


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection (v1 and v1alpha) on ``server``, listing ``service_names`` and the reflection services."""
    _add_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, reflection.SERVICE_NAME, V1_SERVICE))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": v1}),))
