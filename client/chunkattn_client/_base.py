"""What ChunkAttnClient and AsyncChunkAttnClient share: the constructor, the channel and its stubs, the
call metadata (token, routing key), and the choice of the data plane (``data_plane``)."""

from __future__ import annotations

import copy
import secrets
import time
from types import SimpleNamespace
from typing import Any, ClassVar, Self

import grpc
from grpc_health.v1 import health_pb2_grpc

from chunkattn_client import dataplane, wire
from chunkattn_client._channel import DEFAULT_MAX_MESSAGE_BYTES, ROUTE_HEADER, Credentials, bearer, open_channel
from chunkattn_client._errors import ChunkAttnError
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
    one random key per client). data_plane: where Attend calls go (``attend``, ``attend_blocks``, ``stream()``;
    every other call stays on gRPC): "auto" (the data plane where the server offers one, else gRPC), "grpc",
    "zmq" (the data plane, or FAILED_PRECONDITION where the server offers none); None: $CHUNKATTN_DATA_PLANE,
    else "auto". The choice is made on the first Attend (or ``open_data_plane()``) by an OpenDataPlane call;
    ``data_plane`` then says which is in use.
    """

    api: ClassVar[Any]
    lock: ClassVar[Any]  # threading.Lock or asyncio.Lock: held while the data plane is chosen
    _plane: Any  # the open data plane (_zmqplane's ZmqDataPlane or AsyncZmqDataPlane), None on gRPC

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
        data_plane: str | None = None,
    ) -> None:
        self._plane_setting = dataplane.setting(data_plane)
        self._forget_plane()
        self._zmq: list[Any] = []  # the ZeroMQ context, made with the first plane; shared with with_route clients
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

    @property
    def data_plane(self) -> str:
        """What Attend calls go over: "grpc", "zmq:tcp" or "zmq:ipc"; before the choice is made (the first
        Attend, or ``open_data_plane()``), the setting: "auto" or "zmq"."""
        if self._plane is not None:
            return str(self._plane.name)
        return "grpc" if self._plane_decided else self._plane_setting

    def with_route(self, route: str) -> Any:
        """This client, on the same channel, with another route and its own data-plane session (opened on its
        first Attend: behind Envoy the session call is routed by the route, to its replica). Where this client
        found that the server offers no data plane, so does the new one (it asks no more)."""
        other = super().with_route(route)
        offered = self._plane is not None or not self._plane_decided
        other._forget_plane()
        other._plane_decided = other._plane_decided or not offered
        return other

    def _context(self) -> Any:
        """The client's ZeroMQ context (made on first use; its with_route clients share it)."""
        if not self._zmq:
            from chunkattn_client._zmqplane import context  # zmq only once it is used

            self._zmq.append(context(asynchronous=self.api is not grpc))
        return self._zmq[0]

    def _end_context(self) -> None:
        """Close the context and every socket left on it (the client that made it closes)."""
        if self._owns_channel and self._zmq:
            self._zmq.pop().destroy(linger=0)

    def _forget_plane(self) -> None:
        self._plane = None
        self._plane_decided = self._plane_setting == "grpc"
        self._opening = self.lock()

    def _offer(self, outcome: Any, opened: float) -> dataplane.Offer | None:
        """The choice, given OpenDataPlane's outcome (its response, or its ChunkAttnError): the session to
        connect to, or None for gRPC (the decision is final: ``_plane_decided``). Raises where the setting is
        "zmq" and there is no usable data plane, and for "auto" returns None undecided when OpenDataPlane
        failed otherwise than "not offered" (this Attend goes over gRPC and meets its own fate; the next one
        asks again)."""
        zmq_only = self._plane_setting == "zmq"
        if isinstance(outcome, ChunkAttnError):
            if outcome.code not in _NOT_OFFERED:
                if zmq_only:
                    raise outcome
                return None
            why = f"the server offers no data plane ({outcome.code.name}: {outcome.message})"
        else:
            choice = dataplane.choose(outcome, opened)
            if isinstance(choice, dataplane.Offer):
                return choice
            why = choice
        if zmq_only:
            raise ChunkAttnError(
                grpc.StatusCode.FAILED_PRECONDITION, f"data_plane='zmq', but {why}; use 'auto' or 'grpc' here"
            )
        self._plane_decided = True
        return None

    @staticmethod
    def _renewed(response: Any, opened: float) -> dataplane.Offer:
        """A renewed session's offer; FAILED_PRECONDITION when it has no usable endpoint any more."""
        choice = dataplane.choose(response, opened)
        if isinstance(choice, str):
            raise ChunkAttnError(
                grpc.StatusCode.FAILED_PRECONDITION, f"the data-plane session was not renewed: {choice}"
            )
        return choice

    @staticmethod
    def _now() -> float:
        return time.monotonic()


# OpenDataPlane's answers that mean "no data plane here": a server started without its flags, an older one.
_NOT_OFFERED = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED})
