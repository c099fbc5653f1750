"""The data plane's shared facts: what client and server agree on besides the protobuf messages (see
OpenDataPlane in proto/chunkattn/v1/chunkattn.proto), and the client's choices that need no socket: its setting
(``setting``) and which endpoint of a session it uses (``choose``). Imports no ZeroMQ, gRPC or protobuf: the
sockets live where they are used (the client's in ``_zmqplane``)."""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any

# The session key: the first frame of every data-plane request.
KEY_BYTES = 32
# ZeroMQ heartbeats on both ends (ZMQ_HEARTBEAT_IVL / _TIMEOUT, ms): a peer that answers none for the timeout is
# taken as gone, so that a half-open connection is noticed without waiting for TCP.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


@functools.cache
def host_id() -> str:
    """This host, as an opaque id (hex): the same for every process of one boot of one machine (its boot id
    and host name), so a client whose id equals the server's OpenDataPlane host_id may use its ipc endpoint.
    Containers of one host share the boot id but not, in general, the host name or the socket's folder."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{boot}\0{socket.gethostname()}".encode()).hexdigest()[:32]


# -- the client's side: which data plane, and which of a session's endpoints (plain data: no zmq, no grpc) ------

# The client's ``data_plane`` setting: "auto" (the data plane where the server offers one, else gRPC), "grpc"
# (never the data plane), "zmq" (the data plane or an error). The environment variable gives the default.
SETTINGS = ("auto", "grpc", "zmq")
ENV = "CHUNKATTN_DATA_PLANE"
# A session is opened again once less than this share of its life is left (and on UNAUTHENTICATED, once).
RENEW_SHARE = 0.1


def setting(value: str | None) -> str:
    """The ``data_plane`` setting a client uses: ``value``, else $CHUNKATTN_DATA_PLANE, else "auto";
    ValueError naming the choices for anything else."""
    chosen = value if value is not None else os.environ.get(ENV, "") or "auto"
    if chosen not in SETTINGS:
        where = "data_plane" if value is not None else f"${ENV}"
        raise ValueError(f"{where} must be one of {', '.join(SETTINGS)}; got {chosen!r}")
    return chosen


@dataclass(frozen=True)
class Offer:
    """One usable data-plane session, as OpenDataPlane gave it: the endpoint this client connects to
    (transport "tcp" or "ipc", a ZeroMQ address), the session key (KEY_BYTES bytes), how long it lives
    (seconds, from ``opened``, a time.monotonic() reading), and the server's CURVE public key (Z85; "" when
    the data plane is not encrypted)."""

    transport: str
    address: str
    key: bytes = field(repr=False)  # a secret, like a token: never in a log line
    lifetime_s: float
    opened: float
    curve_server_key: str = ""

    @property
    def name(self) -> str:
        """What a client's ``data_plane`` attribute reports: "zmq:tcp" or "zmq:ipc"."""
        return f"zmq:{self.transport}"

    @property
    def link(self) -> tuple[str, str]:
        """What a socket is connected for: the address and the server's key (a new session that keeps both
        keeps the sockets; only the session key in each message changes)."""
        return self.address, self.curve_server_key

    def renew_due(self, now: float) -> bool:
        """Whether less than RENEW_SHARE of the session's life is left at ``now`` (time.monotonic())."""
        return now >= self.opened + (1.0 - RENEW_SHARE) * self.lifetime_s

    def expired(self, now: float) -> bool:
        return now >= self.opened + self.lifetime_s


def choose(response: Any, opened: float, this_host: str | None = None) -> Offer | str:
    """The endpoint of an OpenDataPlaneResponse this client uses: its ipc endpoint when the server is on this
    host (``response.host_id`` equals ``this_host``, default ``host_id()``) and the socket exists here, else its
    tcp endpoint. Returns why none is usable (a sentence) when there is none, or when the response is not
    one a client can use (a key of the wrong length, a lifetime that is not positive)."""
    if len(response.session_key) != KEY_BYTES:
        return f"the server's session key has {len(response.session_key)} bytes; expected {KEY_BYTES}"
    if not response.expires_in_s > 0:
        return f"the server's session expires in {response.expires_in_s!r} s; expected a positive number"
    same_host = response.host_id == (host_id() if this_host is None else this_host)
    by_transport = {e.transport: e.address for e in reversed(response.endpoints)}  # the first of each wins
    ipc = by_transport.get("ipc")
    if ipc is not None and same_host and os.path.exists(ipc.removeprefix("ipc://")):
        transport, address = "ipc", ipc
    elif "tcp" in by_transport:
        transport, address = "tcp", by_transport["tcp"]
    else:
        offered = ", ".join(f"{e.transport} {e.address}" for e in response.endpoints) or "none"
        why = "" if ipc is None else " (its ipc socket is on another host, or not visible from here)"
        return f"no data-plane endpoint this client can reach{why}; offered: {offered}"
    return Offer(
        transport, address, bytes(response.session_key), float(response.expires_in_s), opened,
        response.curve_server_key,
    )  # fmt: skip
