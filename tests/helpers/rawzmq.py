"""A data-plane client that is not ours: a raw pyzmq DEALER that sends frames as given and reads AttendResponses
into rawrpc's ``Answer`` shape, so that the data plane's tests need nothing of the client library's data plane
(and a test written against ``rawrpc.Raw.call("Attend", ...)`` runs over it as it is)."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Protocol

import grpc
import zmq

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from tests.helpers.rawrpc import BIG, SERVICE, Answer


class Informed(Protocol):
    """Whatever answers Info (a gRPC caller)."""

    def info(self) -> pb.InfoResponse: ...


def open_session(
    target: str, token: str | None = None, credentials: grpc.ChannelCredentials | None = None
) -> pb.OpenDataPlaneResponse:
    """OpenDataPlane over gRPC (under ``token``; TLS with ``credentials``)."""
    channel = (
        grpc.insecure_channel(target, options=BIG)
        if credentials is None
        else grpc.secure_channel(target, credentials, options=BIG)
    )
    with channel:
        metadata = None if token is None else (("authorization", f"Bearer {token}"),)
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(SERVICE + "OpenDataPlane")
        return pb.OpenDataPlaneResponse.FromString(call(b"", metadata=metadata, timeout=30))


def code_of(response: pb.AttendResponse) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == response.status.code)


class RawZmq:
    """``with RawZmq(address, key) as z: z.call("Attend", request_bytes)``: one DEALER connected to ``address``
    (a CURVE client of ``server_key`` when given), sending under session ``key``. ``info`` (optional): what
    ``info()`` answers with, for helpers that read the server's state (a gRPC caller's own info)."""

    def __init__(
        self, address: str, key: bytes, server_key: str = "", timeout_s: float = 30.0, info: Informed | None = None
    ) -> None:
        self.key = key
        self.timeout_ms = int(timeout_s * 1000)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if server_key:
            public, secret = zmq.curve_keypair()
            self.socket.curve_publickey = public
            self.socket.curve_secretkey = secret
            self.socket.curve_serverkey = server_key.encode("ascii")
        self.socket.connect(address)
        self._info = info

    @classmethod
    def opened(
        cls, target: str, token: str | None = None, transport: str = "tcp", info: Informed | None = None
    ) -> RawZmq:
        """A session opened on the server at ``target`` (plaintext gRPC), on its ``transport`` endpoint."""
        session = open_session(target, token)
        (address,) = [e.address for e in session.endpoints if e.transport == transport]
        return cls(address, session.session_key, session.curve_server_key, info=info)

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(frames)

    def receive(self, timeout_s: float | None = None) -> pb.AttendResponse | None:
        """The next answer, or None when none comes within ``timeout_s`` (default: the socket's timeout)."""
        data = self.receive_bytes(timeout_s)
        return None if data is None else pb.AttendResponse.FromString(data)

    def receive_bytes(self, timeout_s: float | None = None) -> bytes | None:
        """The next answer's frame as it came, or None (see ``receive``)."""
        wait = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        if not self.socket.poll(wait, zmq.POLLIN):
            return None
        frames = self.socket.recv_multipart()
        assert len(frames) == 1, f"an answer is one frame, got {len(frames)}"
        return frames[0]

    def request(self, data: bytes, key: bytes | None = None) -> pb.AttendResponse:
        """One request under the session (or ``key``), its answer (AssertionError when none comes)."""
        self.send(self.key if key is None else key, data)
        response = self.receive()
        assert response is not None, "no answer from the data plane"
        return response

    def call(self, method: str, data: bytes, timeout: float = 60) -> Answer:
        """rawrpc.Raw.call's shape for Attend: the answer's status as an Answer, data the AttendResponse's bytes
        when it is OK."""
        assert method == "Attend", f"the data plane serves Attend only, not {method}"
        response = self.request(data)
        if response.status.code:
            return Answer(code_of(response), response.status.message)
        return Answer(grpc.StatusCode.OK, data=response.SerializeToString())

    def many(self, requests: Sequence[bytes]) -> list[pb.AttendResponse]:
        """Send every request at once, then read as many answers (in the order they come)."""
        for data in requests:
            self.send(self.key, data)
        answers = [self.receive() for _ in requests]
        assert all(a is not None for a in answers), "an answer did not come"
        return [a for a in answers if a is not None]

    def info(self) -> pb.InfoResponse:
        assert self._info is not None, "RawZmq(info=...) names who answers Info"
        return self._info.info()

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def __enter__(self) -> RawZmq:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
