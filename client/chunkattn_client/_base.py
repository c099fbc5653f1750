"""What ChunkAttnClient and AsyncChunkAttnClient share: the constructor, the channel and its stubs, and the
call metadata (token, routing key)."""

from __future__ import annotations

import copy
import secrets
from types import SimpleNamespace
from typing import Any, ClassVar, Self

from grpc_health.v1 import health_pb2_grpc

from chunkattn_client import wire
from chunkattn_client._channel import DEFAULT_MAX_MESSAGE_BYTES, ROUTE_HEADER, Credentials, bearer, open_channel
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2_grpc as pb_grpc
from chunkattn_client._requests import ATTEND, ATTEND_STREAM, Call
from chunkattn_client.limits import route_problem


class Routed:
    """The call metadata (token, routing key).

    route: the ``x-chunkattn-route`` value of every call. None (the default) makes a random key for this
    client, so that behind Envoy all of its calls reach one replica; "" sends no header (Envoy then picks a
    replica per call: only for servers that hold no state for you). ``with_route(key)`` gives a client on
    the same channel with another key: one per session spreads the sessions over the replicas.
    """

    _metadata: tuple[tuple[str, str], ...] | None

    def _set_metadata(self, token: str | None, route: str | None) -> None:
        route = secrets.token_hex(8) if route is None else route
        problem = route_problem(route)
        if problem:
            raise ValueError(problem)
        self._token, self.route = token, route
        self._metadata = (*(bearer(token) or ()), *(((ROUTE_HEADER, route),) if route else ())) or None
        self._owns_channel = True

    def with_route(self, route: str) -> Self:
        """This client, on the same channel (closing it leaves the channel open), with another route."""
        other = copy.copy(self)
        other._set_metadata(self._token, route)
        other._owns_channel = False
        return other


class ClientBase(Routed):
    """A client of one server (``api``: the grpc module, or grpc.aio).

    target: "host:port". root_certificates, certificate_chain, private_key, token: see ``Credentials``
    (none of them: plaintext, no token). timeout_s: the deadline of each call, and of each call on a stream
    (None: none). route: the routing key for Envoy in front of several replicas (see ``Routed``; default:
    one random key per client).
    """

    api: ClassVar[Any]

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keepalive_s: float | None = None,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        token: str | None = None,
        timeout_s: float | None = None,
        route: str | None = None,
    ) -> None:
        credentials = Credentials(root_certificates, certificate_chain, private_key, token)
        self._set_metadata(token, route)
        self._channel = open_channel(self.api, target, max_message_bytes, keepalive_s, credentials)
        identity = {"request_serializer": wire.identity, "response_deserializer": wire.identity}
        self._stubs = {
            "ChunkAttn": pb_grpc.ChunkAttnStub(self._channel),
            "Health": health_pb2_grpc.HealthStub(self._channel),
            "Raw": SimpleNamespace(Attend=self._channel.unary_unary(ATTEND, **identity)),
        }
        self._attend_stream = self._channel.stream_stream(ATTEND_STREAM, **identity)
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes

    def _start(self, call: Call[Any]) -> Any:
        """The call, started: its response (blocking), its awaitable (grpc.aio), or its response stream."""
        method = getattr(self._stubs[call.stub], call.method)
        return method(call.request, timeout=self.timeout_s, metadata=self._metadata)
