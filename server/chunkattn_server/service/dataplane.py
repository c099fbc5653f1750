"""The data plane: Attend over ZeroMQ (issue 37), for model runners that wait for each layer's answer.

One ROUTER socket on the server's event loop, bound to each configured endpoint (--data-plane-tcp,
--data-plane-ipc). The loop watches the socket's file descriptor itself (``add_reader``: zmq.asyncio's futures
and callbacks cost more than a decode-sized call's whole step): each wake-up takes every message waiting, at
most MAX_BURST before the loop's other callbacks run. A request is two frames, a session key (OpenDataPlane's,
sessions.py) and a serialized AttendRequest; its answer is one frame, a serialized AttendResponse whose status
holds the outcome (see OpenDataPlane in proto/chunkattn/v1/chunkattn.proto). Each message is its own task and is
served exactly as one AttendStream message is (rpc.Rpcs.answer: admission, the parse, the handler, the count), as
rpc "Attend" over transport "zmq", and while it is handled it counts among its tenant's open calls; its engine
call batches with gRPC calls in the one scheduler. The answer is sent at once, to the sender's identity (a
ROUTER never blocks a send); a sender gone by then is not there to route to, and ROUTER drops it (no error,
nothing kept).

Security: with TLS (--tls-cert) the socket is a CURVE server (a key pair made at start; its public key goes out
in OpenDataPlane's response over TLS); a TLS server whose libzmq has no CURVE refuses to start with a data plane
(``check``). An ipc socket is mode 0600 in a folder no other user can write (auto: a fresh 0700 one), removed
at stop. A message longer than the server's message limit (ZMQ_MAXMSGSIZE) drops its peer's connection, and
only that. Heartbeats (chunkattn_client.dataplane) find peers gone without waiting for TCP.

Drain: from SIGTERM on, new messages get UNAVAILABLE (rpc.DRAINING) while the ones in flight finish and are
answered (they count as open calls, which server.py waits for); ``close`` then ends the socket and the context.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
import zmq

from chunkattn_client import dataplane, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import bounded
from chunkattn_server.config import ServerConfig, data_plane_host_port
from chunkattn_server.errors import ConfigError, InvalidArgument, NotOffered, ShuttingDown
from chunkattn_server.service.attend import MAX_ATTEND_FIELDS
from chunkattn_server.service.auth import Tenant
from chunkattn_server.service.edge import Edge
from chunkattn_server.service.rpc import DRAINING, SMALL_REQUEST_BYTES, Context, Rpcs, message
from chunkattn_server.service.sessions import Sessions
from chunkattn_server.service.status import status_code

log = logging.getLogger(__name__)

RPC = "Attend"  # what a data-plane message counts as
TRANSPORT = "zmq"
# ZMQ_MAXMSGSIZE is the server's message limit plus this: a frame's own framing never pushes a valid request past.
MAX_MESSAGE_MARGIN = 4096
FLUSH_MS = 500  # at close, answers still queued get this long to leave (a vanished peer's cannot hold it longer)
MAX_BURST = 64  # messages taken in one wake-up of the socket before the loop's other callbacks run
SWEEP_S = 30.0  # ended sessions are forgotten on this period (sessions.KEPT_S after their end)
IPC_NAME = "data.sock"
MAX_IPC_PATH = 107  # a Unix socket's path, in bytes (sockaddr_un's sun_path less its NUL)
EVERY_ADDRESS = ("0.0.0.0", "::", "*", "")
NOT_OFFERED = (
    "this server offers no data plane (chunkattn-server --data-plane-tcp HOST:PORT and/or --data-plane-ipc"
    " PATH|auto turn it on); use Attend over gRPC (the client's data_plane='auto' does so by itself)"
)

# The per-message path: Attend's parse and handler through rpc.Rpcs.answer, bound by AttendService.
Answer = Callable[[bytes | memoryview, Tenant, float], Awaitable[bytes]]


def check(config: ServerConfig) -> None:
    """The data plane's flags against this machine, before the pool is allocated: ConfigError for a TLS
    server whose libzmq cannot do CURVE, for ipc without ipc support, and for an ipc path too long or in a
    folder other users can write."""
    if not config.data_plane:
        return
    if config.tls_cert is not None and not zmq.has("curve"):
        raise ConfigError(
            f"this server serves TLS, so its data plane must be encrypted with ZeroMQ's CURVE, which this libzmq"
            f" ({zmq.zmq_version()}) lacks: drop --data-plane-tcp / --data-plane-ipc (clients stay on gRPC), or"
            " install a pyzmq whose libzmq has CURVE (libsodium)"
        )
    if config.data_plane_ipc is not None:
        if not zmq.has("ipc"):
            raise ConfigError(f"--data-plane-ipc: this libzmq ({zmq.zmq_version()}) has no ipc transport")
        if config.data_plane_ipc != "auto":
            _check_ipc_path(config.data_plane_ipc)


def _check_ipc_path(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if len(os.fsencode(os.path.abspath(path))) > MAX_IPC_PATH:
        raise ConfigError(f"--data-plane-ipc {path[:200]!r}: a Unix socket's path is at most {MAX_IPC_PATH} bytes")
    try:
        mode = os.stat(folder).st_mode
    except OSError as e:
        raise ConfigError(f"--data-plane-ipc {path[:200]!r}: its folder {folder!r}: {e.strerror}") from None
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"--data-plane-ipc {path[:200]!r}: {folder!r} is not a folder")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"--data-plane-ipc {path[:200]!r}: its folder {folder!r} is writable by other users (mode"
            f" {stat.S_IMODE(mode):o}), who could replace the socket with theirs: use a folder only the server's"
            " user can write, or --data-plane-ipc auto"
        )
    owner = os.stat(folder).st_uid
    if owner not in (os.geteuid(), 0):
        raise ConfigError(
            f"--data-plane-ipc {path[:200]!r}: its folder {folder!r} belongs to another user (uid {owner}), who"
            " could replace the socket with theirs: use a folder of the server's user, or --data-plane-ipc auto"
        )
    if _in_use(path):
        raise ConfigError(
            f"--data-plane-ipc {path[:200]!r}: another process is listening there (a second server?); binding"
            " would take its socket over: give each server its own path, or --data-plane-ipc auto"
        )


def _in_use(path: str) -> bool:
    """Whether a Unix socket at ``path`` accepts connections (a stale one left by a killed server does not)."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
    except OSError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


@dataclass(frozen=True)
class Endpoint:
    """One address of the data plane, as OpenDataPlane gives it: "tcp" or "ipc", and the address to connect to."""

    transport: str
    address: str


class DataPlane:
    """The data plane's socket and its receive loop (see the module docstring). ``answer(raw, tenant, started)``
    serves one request (AttendService.data_plane_answer); ``curve``: encrypt (a TLS server)."""

    def __init__(self, config: ServerConfig, rpcs: Rpcs, sessions: Sessions, answer: Answer, *, curve: bool) -> None:
        self._config = config
        self._rpcs = rpcs
        self.sessions = sessions
        self._answer = answer
        self._curve = curve
        self.curve_public_key = ""
        self.endpoints: tuple[Endpoint, ...] = ()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None  # the socket's file descriptor, while the loop watches it
        self._read_pending = False  # a look at the socket is scheduled (call_soon)
        self._ipc_path: str | None = None
        self._ipc_folder: str | None = None  # made by auto: removed at close
        self._ipc_inode: int | None = None  # the bound socket's: removed at close only while it is still ours
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Bind every endpoint and start receiving; OSError (or ConfigError) saying which flag failed, with
        nothing left bound."""
        self._context = zmq.Context()
        sock = self._socket = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a second peer with a taken identity does not take its answers
        # (SNDHWM stays libzmq's 1000 answers per peer: a client may pipeline many requests on one socket, and ROUTER
        # drops what passes the mark. A peer that never reads holds that many answers: see docs/deployment.md.)
        sock.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes + MAX_MESSAGE_MARGIN)
        sock.setsockopt(zmq.HEARTBEAT_IVL, dataplane.HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, dataplane.HEARTBEAT_TIMEOUT_MS)
        if self._curve:
            public, secret = zmq.curve_keypair()
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
            self.curve_public_key = public.decode("ascii")
        try:
            endpoints = []
            if self._config.data_plane_tcp is not None:
                endpoints.append(self._bind_tcp(sock, self._config.data_plane_tcp))
            if self._config.data_plane_ipc is not None:
                endpoints.append(self._bind_ipc(sock, self._config.data_plane_ipc))
        except BaseException:
            self._close_now()
            raise
        self.endpoints = tuple(endpoints)
        loop = self._loop = asyncio.get_running_loop()
        fd = self._fd = cast(int, sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._readable)
        self._look_again()  # (the descriptor signals changes only: look once now)
        self._loops = [asyncio.ensure_future(self._sweep())]

    def _bind_tcp(self, sock: zmq.Socket[Any], value: str) -> Endpoint:
        host, port = data_plane_host_port(value)
        six = ":" in host
        if six:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(f"tcp://{f'[{host}]' if six else host}:{port if port else '*'}")
        except zmq.ZMQError as e:
            why = "the port is in use, by another server perhaps" if e.errno == zmq.EADDRINUSE else e.strerror
            raise OSError(f"cannot listen on {value} (--data-plane-tcp): {why}") from None
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        real_port = int(bound.rsplit(":", 1)[1])
        advertised = self._config.data_plane_advertise
        if advertised is None:
            advertised = socket.gethostname() if host in EVERY_ADDRESS else f"[{host}]" if six else host
        return Endpoint("tcp", f"tcp://{advertised}:{real_port}")

    def _bind_ipc(self, sock: zmq.Socket[Any], value: str) -> Endpoint:
        if value == "auto":
            runtime = os.environ.get("XDG_RUNTIME_DIR")
            base = runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()
            self._ipc_folder = tempfile.mkdtemp(prefix="chunkattn-", dir=base)  # mode 0700
            path = os.path.join(self._ipc_folder, IPC_NAME)
            if len(os.fsencode(path)) > MAX_IPC_PATH:
                raise ConfigError(f"--data-plane-ipc auto: {path!r} is longer than a Unix socket's path may be")
        else:
            path = os.path.abspath(value)
        # The socket is made 0600 (the umask at bind: no moment when others may connect; the server is starting,
        # its other threads create no files now), then checked.
        umask = os.umask(0o177)
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as e:
            raise OSError(f"cannot listen on {path} (--data-plane-ipc): {e.strerror}") from None
        finally:
            os.umask(umask)
        os.chmod(path, 0o600)
        self._ipc_path, self._ipc_inode = path, os.stat(path).st_ino
        return Endpoint("ipc", f"ipc://{path}")

    def _readable(self) -> None:
        """(The loop's reader of the socket's descriptor.) Each message waiting, its own task, MAX_BURST at most:
        then the loop's other callbacks run before the next look."""
        self._read_pending = False
        sock, loop = self._socket, self._loop
        if sock is None or sock.closed or loop is None or self._fd is None:  # (closing: receives no more)
            return
        for _ in range(MAX_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # nothing waits: the descriptor signals the next arrival
                return
            except zmq.ZMQError:  # the socket is closing
                return
            task = loop.create_task(self._serve(frames, time.perf_counter()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._look_again()

    def _look_again(self) -> None:
        """Look at the socket once more, soon: the descriptor signals a change of the socket's state, not a
        message waiting, and a send may take that signal while messages wait."""
        if not self._read_pending and self._loop is not None:
            self._read_pending = True
            self._loop.call_soon(self._readable)

    async def _serve(self, frames: list[zmq.Frame], started: float) -> None:
        """One message answered: its frames and session checked, then served as one AttendStream message is."""
        identity = frames[0].bytes
        tenant: Tenant | None = None
        raw: bytes | memoryview = b""
        try:
            if len(frames) != 3:  # (ROUTER puts the sender's identity first)
                raise InvalidArgument(
                    f"a data-plane request is 2 frames (the session key, then a serialized AttendRequest); got"
                    f" {len(frames) - 1}"
                )
            key = frames[1].bytes
            if len(key) != dataplane.KEY_BYTES:
                raise InvalidArgument(
                    f"a data-plane request's first frame is the session key, {dataplane.KEY_BYTES} bytes"
                    f" (OpenDataPlane's session_key); got {len(key)} bytes"
                )
            body = frames[2]
            raw = body.bytes if len(body) <= SMALL_REQUEST_BYTES else body.buffer  # a large one is not copied
            if self._rpcs.draining:
                raise ShuttingDown(DRAINING)
            tenant = self.sessions.lookup(key)
            with self._rpcs.open_call(tenant):
                response = await self._answer(raw, tenant, started)  # counts itself; raises nothing
        except Exception as e:
            code = status_code(e)
            self._rpcs.count(RPC, code, time.perf_counter() - started, tenant, TRANSPORT)
            # A large message of a peer without a session is not read at all (its answer's request_id is 0).
            readable = raw if tenant is not None or len(raw) <= SMALL_REQUEST_BYTES else b""
            response = refusal(readable, code, bounded(str(e)))
        self.send(identity, response)

    def send(self, identity: bytes, response: bytes) -> None:
        """An answer to the peer ``identity``, now; dropped when the peer has gone (ROUTER drops what it cannot
        route, and what a peer that reads nothing has no room for) or the socket has closed."""
        sock = self._socket
        if sock is None or sock.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart((identity, response), zmq.NOBLOCK, copy=len(response) <= SMALL_REQUEST_BYTES)
        try:
            arrived = cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN  # a send may take the signal of an arrival
        except zmq.ZMQError:  # closed meanwhile
            return
        if arrived:
            self._look_again()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sessions.sweep()

    async def close(self, timeout_s: float) -> None:
        """Stop receiving, let the messages in flight finish and be answered (``timeout_s`` at most; server.py has
        already waited for them as open calls), then close the socket (answers still queued get FLUSH_MS) and the
        context, and remove the ipc socket (and its folder when auto made it)."""
        self._stop_reading()
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in set(self._tasks):
            task.cancel()
        if self._socket is not None:
            self._socket.close(linger=FLUSH_MS)
        context, self._context = self._context, None
        if context is not None:
            await asyncio.to_thread(context.term)  # waits for the flush, FLUSH_MS at most
        self.sessions.end_all("ended: the server stopped")
        self._remove_ipc()

    def _close_now(self) -> None:
        """Undo a start that failed."""
        self._stop_reading()
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()
            self._context = None
        self._remove_ipc()

    def _stop_reading(self) -> None:
        if self._fd is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._fd = None

    def _remove_ipc(self) -> None:
        path = self._ipc_path
        with contextlib.suppress(OSError):
            if path is not None and os.stat(path).st_ino == self._ipc_inode:  # ours still (not a later server's)
                os.unlink(path)
        if self._ipc_folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._ipc_folder)
        self._ipc_path = self._ipc_folder = None


def refusal(raw: bytes | memoryview, code: grpc.StatusCode, message: str) -> bytes:
    """The answer to a message refused before it was served: its status, under the request's request_id when
    that can be read (0 otherwise), so that a client with several requests in flight knows which one."""
    return wire.encode_attend_response(request_id(raw), None, code.value[0], message)


def request_id(raw: bytes | memoryview) -> int:
    """An AttendRequest's request_id, without its tensors (0 when it does not parse)."""
    try:
        if len(raw) <= SMALL_REQUEST_BYTES:
            return int(pb.AttendRequest.FromString(bytes(raw)).request_id)
        rest = wire.split(cast(bytes, raw), _TENSORS, MAX_ATTEND_FIELDS).rest  # (split reads a memoryview as bytes)
        return int(pb.AttendRequest.FromString(rest).request_id)
    except Exception:
        return 0


_TENSORS = frozenset(f.number for f in pb.AttendRequest.DESCRIPTOR.fields if f.message_type is pb.Tensor.DESCRIPTOR)


class DataPlaneService:
    """OpenDataPlane: a session of the caller's tenant on ``plane`` (None: the server offers none)."""

    def __init__(self, edge: Edge, plane: DataPlane | None) -> None:
        self._edge = edge
        self._plane = plane

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        parse = message(pb.OpenDataPlaneRequest, SMALL_REQUEST_BYTES, max_fields=16)
        return {"OpenDataPlane": self._edge.rpcs.unary("OpenDataPlane", self.OpenDataPlane, parse)}

    async def OpenDataPlane(  # noqa: N802
        self, request: pb.OpenDataPlaneRequest, context: Context, tenant: Tenant
    ) -> pb.OpenDataPlaneResponse:
        """A new session of ``tenant``: its key, the endpoints, its lifetime, the host id and CURVE key. A tenant
        holds at most sessions.MAX_SESSIONS_PER_TENANT: opening one more ends its oldest."""
        plane = self._plane
        if plane is None:
            raise NotOffered(NOT_OFFERED)
        auth = self._edge.rpcs.auth
        credential = auth.credential(context.invocation_metadata(), context.auth_context()) if auth.enabled else None
        session = plane.sessions.open(tenant, credential)
        return pb.OpenDataPlaneResponse(
            endpoints=[pb.DataPlaneEndpoint(transport=e.transport, address=e.address) for e in plane.endpoints],
            session_key=session.key,
            expires_in_s=plane.sessions.ttl_s,
            host_id=dataplane.host_id(),
            curve_server_key=plane.curve_public_key,
        )


__all__ = ["DataPlane", "DataPlaneService", "Endpoint", "check", "refusal", "request_id"]
