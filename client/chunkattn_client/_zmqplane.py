"""The client's data plane: Attend requests over ZeroMQ (see OpenDataPlane in proto/chunkattn/v1/chunkattn.proto).

A data plane is: open a session (the client's OpenDataPlane call gives an ``Offer``), send a request's bytes,
receive the answer's. ``ZmqDataPlane`` (blocking: one DEALER socket per thread, since a ZeroMQ socket is used
by one thread at a time) and ``AsyncZmqDataPlane`` (zmq.asyncio: one socket, a reader task that hands each
answer to its caller) share everything but the socket calls: the request ids, the session's renewal (ahead of
its expiry, and once on an UNAUTHENTICATED answer, which the server gives before running the request), the
socket's options, how an answer is matched to its request, and every error:

- the client's ``timeout_s`` with no answer: DEADLINE_EXCEEDED (``NoAnswer``);
- the connection carrying the call lost (the socket monitor's EVENT_DISCONNECTED: the server went away, or
  the heartbeat timed out on a half-open connection): UNAVAILABLE (``LostConnection``), the call may or may
  not have been carried out;
- no connection within HEARTBEAT_TIMEOUT_MS to send on: UNAVAILABLE, nothing was sent.

Imported only when a client opens the data plane: ``import chunkattn_client`` loads no zmq.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from chunkattn_client import wire
from chunkattn_client._errors import ChunkAttnError, LostConnection, NoAnswer
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._requests import Output, decode_attend_response
from chunkattn_client.dataplane import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS, Offer

# A request's serialized AttendRequest, built for its request id.
Build = Callable[[int], bytes]

# The socket monitor's events a call cares about: a connection made or lost, or a CURVE handshake refused.
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
# Requests this long or longer are sent without a copy (pyzmq's own threshold: below it a copy is cheaper).
_COPY_BELOW = zmq.COPY_THRESHOLD
# How long a call waits for a connection to send on (the server down, unreachable, or refusing the handshake).
CONNECT_S = HEARTBEAT_TIMEOUT_MS / 1000


def context(asynchronous: bool) -> zmq.Context[Any]:
    """A client's ZeroMQ context (one I/O thread), for its planes and its with_route clients'."""
    return zmq.asyncio.Context() if asynchronous else zmq.Context()


def configure(socket: zmq.Socket[Any], offer: Offer) -> None:
    """A DEALER's options: heartbeats (a silent peer is dropped after HEARTBEAT_TIMEOUT_MS), no linger, messages
    only to completed connections (IMMEDIATE: a call made while the server is away waits to connect, it is not
    queued for a later one), CURVE with a fresh keypair when the session names the server's key; MAXMSGSIZE
    stays unset (the server's limits apply)."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    if offer.curve_server_key:
        public, secret = zmq.curve_keypair()
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_serverkey = offer.curve_server_key.encode("ascii")


def answer_id(raw: bytes) -> int:
    """The request_id of a serialized AttendResponse (0 when it has none or does not parse). The server writes
    it first (wire.encode_attend_response): read there without parsing the rest."""
    if raw[:1] == b"\x10":  # field 2 (request_id), varint
        result = shift = 0
        for byte in raw[1:11]:
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7
    try:
        return int(pb.AttendResponse.FromString(wire.split(raw, _OUTPUT).rest).request_id)
    except Exception:  # a malformed answer is nobody's: its caller times out or loses the link
        return 0


_OUTPUT = frozenset({wire.field_number(pb.AttendResponse, "output")})


def _event_name(event: int) -> str:
    return zmq.Event(event).name or str(event)


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _unreachable(address: str, handshake: str) -> ChunkAttnError:
    why = f"; the last handshake failed ({handshake})" if handshake else ""
    return ChunkAttnError(
        grpc.StatusCode.UNAVAILABLE,
        f"could not connect to the data plane at {address} within {CONNECT_S:g} s{why}: the server is down or"
        " unreachable from here. Nothing was sent; retry, or use data_plane='grpc'",
    )


class _Waiting:
    """One socket's calls in flight: their answers as they come, and which one a malformed answer (request id
    0, as the server sends for a message it cannot read) goes to: the oldest."""

    def __init__(self) -> None:
        self.calls: dict[int, Any] = {}  # request id -> what the caller waits on (insertion order: oldest first)

    def owner(self, raw: bytes) -> int | None:
        rid = answer_id(raw)
        if rid in self.calls:
            return rid
        if rid == 0 and self.calls:
            oldest: int = next(iter(self.calls))
            return oldest
        return None  # the late answer of a call that stopped waiting


class _Plane:
    """What both data planes share: the session (``offer``), the request ids (the client's own counter, unique
    among its requests in flight), and the call around the exchange (build once, renew, decode, resend once)."""

    def __init__(self, offer: Offer) -> None:
        self.offer = offer
        self._ids = itertools.count(1)  # next() is atomic under the GIL: one counter for every thread
        self._retry_renewal_at = 0.0

    @property
    def name(self) -> str:
        """ "zmq:tcp" or "zmq:ipc"."""
        return self.offer.name

    def _prepare(self, build: Build) -> tuple[int, bytes]:
        rid = next(self._ids)
        return rid, build(rid)

    def _renewal(self) -> bool:
        """Whether the session is due for renewal (not again within a second of a renewal that failed)."""
        now = time.monotonic()
        return self.offer.renew_due(now) and now >= self._retry_renewal_at

    def _renewal_failed(self, error: ChunkAttnError) -> None:
        """A renewal ahead of expiry failed: go on with the session while it lives, else raise."""
        now = time.monotonic()
        if self.offer.expired(now):
            raise error
        self._retry_renewal_at = now + 1.0

    @staticmethod
    def _decoded(raw: bytes, rid: int, attempt: int) -> Output | None:
        """The answer's output, or None for an UNAUTHENTICATED answer worth one resend."""
        try:
            return decode_attend_response(raw, rid)
        except ChunkAttnError as e:
            if e.code == grpc.StatusCode.UNAUTHENTICATED and attempt == 0:
                return None
            raise

    @staticmethod
    def _no_answer(timeout_s: float | None) -> NoAnswer:
        return NoAnswer(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on the data plane within {timeout_s:g} s")


class ZmqDataPlane(_Plane):
    """The blocking data plane: ``call`` from any thread (each has its own socket, made on its first call).
    ``reopen`` opens a new session over gRPC (OpenDataPlane). ``context``: the client's (its with_route clients
    share it: one I/O thread). ``close()`` closes this plane's sockets."""

    def __init__(self, offer: Offer, reopen: Callable[[], Offer], context: zmq.Context[Any]) -> None:
        super().__init__(offer)
        self._reopen = reopen
        self._renewing = threading.Lock()
        self._context = context
        self._local = threading.local()
        self._links: weakref.WeakSet[_Link] = weakref.WeakSet()  # every thread's (a dead thread's goes with it)

    def call(self, build: Build, timeout_s: float | None) -> Output:
        """One Attend: ``build(request_id)`` is its serialized AttendRequest; returns the output, or raises the
        ChunkAttnError of the answer's status, of the deadline or of the connection."""
        deadline = _deadline(timeout_s)
        if self._renewal():
            self._renew(self.offer, ahead=True)
        rid, request = self._prepare(build)
        for attempt in (0, 1):
            offer = self.offer
            raw = self._link(offer).exchange(offer.key, rid, request, deadline, timeout_s)
            output = self._decoded(raw, rid, attempt)
            if output is not None:
                return output
            self._renew(offer, ahead=False)
        raise AssertionError("unreachable")

    def _renew(self, stale: Offer, *, ahead: bool) -> None:
        with self._renewing:
            if self.offer is not stale:  # another thread renewed it meanwhile
                return
            try:
                self.offer = self._reopen()
            except ChunkAttnError as e:
                if not ahead:
                    raise
                self._renewal_failed(e)

    def _link(self, offer: Offer) -> _Link:
        link: _Link | None = getattr(self._local, "link", None)
        if link is None or link.link != offer.link:
            if link is not None:
                link.close()
            link = self._local.link = _Link(self._context, offer)
            self._links.add(link)
        return link

    def close(self) -> None:
        """Close every thread's socket (linger 0): call it once no call is in progress."""
        for link in list(self._links):
            link.close()


class _Link:
    """One thread's DEALER, connected to one endpoint, with its monitor.

    The monitor is read only when a poll finds it readable, and tells which connection a call's request went
    over: its events come in order, and a connection's EVENT_CONNECTED comes before the socket can send on
    it (IMMEDIATE). So an EVENT_DISCONNECTED not followed by an EVENT_CONNECTED (``lost``) is the loss of the
    connection the socket last sent on; one followed by a reconnection (a loss between calls) is no call's.
    """

    def __init__(self, context: zmq.Context[Any], offer: Offer) -> None:
        self.link, self.address = offer.link, offer.address
        self.socket = context.socket(zmq.DEALER)
        configure(self.socket, offer)
        self.monitor = self.socket.get_monitor_socket(_MONITORED)
        self.socket.connect(offer.address)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.waiting = _Waiting()
        self.lost = ""  # the disconnection the socket has not reconnected since ("": connected, or connecting)
        self.handshake = ""  # the last handshake failure, for the error of a call that cannot connect
        weakref.finalize(self, _close_sockets, self.socket, self.monitor)  # the thread ended: its socket goes

    def exchange(self, key: bytes, rid: int, request: bytes, deadline: float | None, timeout_s: float | None) -> bytes:
        calls = self.waiting.calls
        calls[rid] = None
        try:
            try:  # sent at once where a connection takes it (the first frame taken, the second is too)
                self.socket.send(key, _SEND_MORE, copy=True)
            except zmq.Again:
                self._send_when_connected(key, deadline, timeout_s)
            self.socket.send(request, zmq.NOBLOCK, copy=len(request) < _COPY_BELOW)
            return self._wait(rid, deadline, timeout_s)
        finally:
            calls.pop(rid, None)

    def _send_when_connected(self, key: bytes, deadline: float | None, timeout_s: float | None) -> None:
        """Send the first frame once a connection takes it (IMMEDIATE: no connection, no room to send), within
        the deadline and CONNECT_S."""
        connect_by = time.monotonic() + CONNECT_S
        while True:
            now = time.monotonic()
            until = connect_by if deadline is None else min(deadline, connect_by)
            if now >= until:
                self._events()
                if deadline is not None and deadline <= connect_by:
                    raise _Plane._no_answer(timeout_s)
                raise _unreachable(self.address, self.handshake)
            if self.socket.poll(int((until - now) * 1000) + 1, zmq.POLLOUT):
                with contextlib.suppress(zmq.Again):
                    self.socket.send(key, _SEND_MORE, copy=True)
                    return

    def _wait(self, rid: int, deadline: float | None, timeout_s: float | None) -> bytes:
        timeout = None if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000) + 1
        while True:
            for polled, _ in self.poller.poll(timeout):
                if polled is self.socket:
                    answer = self._receive(rid)
                    if answer is not None:
                        return answer
                elif self._events():
                    raise LostConnection(self.address, self.lost)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Plane._no_answer(timeout_s)
                timeout = int(left * 1000) + 1

    def _receive(self, rid: int) -> bytes | None:
        """Read the answers that came (NOBLOCK) until this call's; each to the call it answers."""
        calls = self.waiting.calls
        socket = self.socket
        while True:
            try:
                raw: bytes = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if socket.getsockopt(zmq.RCVMORE):  # not an answer: nobody's (its other frames with it)
                while socket.getsockopt(zmq.RCVMORE):
                    socket.recv()
                continue
            owner = self.waiting.owner(raw)
            if owner == rid:
                return raw
            if owner is not None and calls[owner] is None:
                calls[owner] = raw

    def _events(self) -> bool:
        """Read the monitor's events; whether the connection is lost (``lost``: a disconnection since the last
        connection)."""
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return bool(self.lost)
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.lost = ""
            elif kind == zmq.EVENT_DISCONNECTED:
                self.lost = _event_name(kind)
            else:
                self.handshake = _event_name(kind)

    def close(self) -> None:
        _close_sockets(self.socket, self.monitor)


_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK


def _close_sockets(socket: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
    with contextlib.suppress(zmq.ZMQError):
        if not socket.closed:
            socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)


class AsyncZmqDataPlane(_Plane):
    """The asyncio data plane: one socket (made on the first call, on the running loop), a reader task that
    hands each answer to the caller awaiting it, a monitor task that fails the calls in flight when their
    connection is lost. Several calls may be in flight at once (they are pipelined on the socket). ``reopen``
    opens a new session over gRPC; ``context``: the client's. ``await close()`` ends the tasks and closes the
    socket."""

    def __init__(self, offer: Offer, reopen: Callable[[], Awaitable[Offer]], context: zmq.asyncio.Context) -> None:
        super().__init__(offer)
        self._reopen = reopen
        self._renewing = asyncio.Lock()
        self._context = context
        self._link: _AsyncLink | None = None

    async def call(self, build: Build, timeout_s: float | None) -> Output:
        """ZmqDataPlane.call, awaited."""
        deadline = _deadline(timeout_s)
        if self._renewal():
            await self._renew(self.offer, ahead=True)
        rid, request = self._prepare(build)
        for attempt in (0, 1):
            offer = self.offer
            raw = await self._linked(offer).exchange(offer.key, rid, request, deadline, timeout_s)
            output = self._decoded(raw, rid, attempt)
            if output is not None:
                return output
            await self._renew(offer, ahead=False)
        raise AssertionError("unreachable")

    async def _renew(self, stale: Offer, *, ahead: bool) -> None:
        async with self._renewing:
            if self.offer is not stale:
                return
            try:
                self.offer = await self._reopen()
            except ChunkAttnError as e:
                if not ahead:
                    raise
                self._renewal_failed(e)

    def _linked(self, offer: Offer) -> _AsyncLink:
        if self._link is None or self._link.link != offer.link:
            if self._link is not None:
                self._link.close()
            self._link = _AsyncLink(self._context, offer)
        return self._link

    async def close(self) -> None:
        if self._link is not None:
            await self._link.stop()
            self._link = None


class _AsyncLink:
    """The asyncio data plane's DEALER, its reader and its monitor task."""

    def __init__(self, context: zmq.asyncio.Context, offer: Offer) -> None:
        self.link, self.address = offer.link, offer.address
        self.socket = context.socket(zmq.DEALER)
        configure(self.socket, offer)
        self.monitor = self.socket.get_monitor_socket(_MONITORED)
        self.socket.connect(offer.address)
        self.waiting = _Waiting()  # request id -> its future
        self.handshake = ""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]

    async def exchange(
        self, key: bytes, rid: int, request: bytes, deadline: float | None, timeout_s: float | None
    ) -> bytes:
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting.calls[rid] = answer
        try:
            await self._send(key, request, deadline, timeout_s)
            try:
                return await asyncio.wait_for(answer, _left(deadline))
            except TimeoutError:
                raise _Plane._no_answer(timeout_s) from None
        finally:
            self.waiting.calls.pop(rid, None)

    async def _send(self, key: bytes, request: bytes, deadline: float | None, timeout_s: float | None) -> None:
        left = _left(deadline)
        wait = CONNECT_S if left is None else min(left, CONNECT_S)
        try:
            await asyncio.wait_for(self.socket.send_multipart((key, request), copy=False), wait)
        except TimeoutError:
            if left is not None and left <= CONNECT_S:
                raise _Plane._no_answer(timeout_s) from None
            raise _unreachable(self.address, self.handshake) from None

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            owner = self.waiting.owner(frames[0]) if len(frames) == 1 else None
            future = None if owner is None else self.waiting.calls[owner]
            if future is not None and not future.done():
                future.set_result(frames[0])

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            name = _event_name(event["event"])
            if event["event"] == zmq.EVENT_CONNECTED:
                continue
            if event["event"] != zmq.EVENT_DISCONNECTED:
                self.handshake = name
                continue
            for future in self.waiting.calls.values():
                if not future.done():
                    future.set_exception(LostConnection(self.address, name))

    def close(self) -> None:
        """Stop at once (a new session's endpoint replaces this one): the calls in flight lose their link."""
        for task in self._tasks:
            task.cancel()
        for future in self.waiting.calls.values():
            if not future.done():
                future.set_exception(LostConnection(self.address, "the session moved to another endpoint"))
        _close_sockets(self.socket, self.monitor)

    async def stop(self) -> None:
        self.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
