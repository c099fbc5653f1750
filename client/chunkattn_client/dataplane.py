"""The data plane's shared facts: what client and server agree on besides the protobuf messages (see
OpenDataPlane in proto/chunkattn/v1/chunkattn.proto). Imports no ZeroMQ: the sockets live where they are used."""

from __future__ import annotations

import functools
import hashlib
import socket

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
