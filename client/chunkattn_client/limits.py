"""The protocol's fixed limits, shared by the server (which enforces them) and the clients (which may check
early), and the helpers that keep error messages bounded whatever a client sent.

Requests over a limit get INVALID_ARGUMENT saying which limit and by how much. The server's configurable
limits (message size, calls at once, bytes in flight, idle streams) are flags; see docs/server.md, "Limits
and errors".
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

# A sequence id: 1 to MAX_ID_BYTES bytes of UTF-8.
MAX_ID_BYTES = 256
# Sequences in one call: entries of an AttendRequest, ids of a ReleaseRequest.
MAX_BATCH = 8192
# A sequence's length in any layer (position + num_tokens): the largest position the CUDA kernels' int32
# metadata holds. Chunked layers keep one chunk, so only this bounds them; a global layer is bounded sooner
# by the pool (num_blocks * block_size tokens).
MAX_TOKENS = 2**31 - 1
# A block space's lease (OpenBlockSpaceRequest.lease_s), in seconds; 0 asks for none.
MIN_LEASE_S, MAX_LEASE_S = 1.0, 86400.0
# TransferKV's target address.
MAX_TARGET_BYTES = 512
# A bearer token's characters (gRPC's headers are at most 8 KiB in all).
MAX_TOKEN_CHARS = 4096
# A routing key's characters (the x-chunkattn-route header that Envoy hashes).
MAX_ROUTE_CHARS = 256

# A message of at most this many bytes parses through protobuf's C parser, its tensors' bytes copied (nothing
# at this size); a larger one is taken apart without copying them (``codec.parse_tensors``), and the server
# parses it off its event loop. The one threshold of both sides.
SMALL_MESSAGE_BYTES = 64 << 10

# How much of a client's string an error message quotes, and how many of its ids.
QUOTE_CHARS = 64
QUOTE_IDS = 3
# No status message is longer (gRPC's trailers must fit 16 KiB, and a message is read by people).
MAX_MESSAGE_CHARS = 2048
# Block spaces one tenant may hold open at once (a serving engine needs one per instance).
MAX_BLOCK_SPACES = 64


def quote(s: object) -> str:
    """``repr(s)``, cut to QUOTE_CHARS characters with its full length said when longer."""
    if isinstance(s, str) and len(s) > QUOTE_CHARS:
        return f"{s[:QUOTE_CHARS]!r}... ({len(s.encode('utf-8', 'surrogatepass'))} bytes)"
    text = repr(s)
    return text if len(text) <= QUOTE_CHARS + 2 else f"{text[:QUOTE_CHARS]}... ({len(text)} characters)"


def some(ids: Sequence[object]) -> str:
    """A few of ``ids``, quoted: "'a', 'b', 'c' and 4997 more"."""
    shown = ", ".join(quote(i) for i in ids[:QUOTE_IDS])
    more = len(ids) - QUOTE_IDS
    return f"{shown} and {more} more" if more > 0 else shown


def bounded(message: str) -> str:
    """A status message cut to MAX_MESSAGE_CHARS characters."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 40] + f"... ({len(message)} characters in all)"


def token_problem(token: str, what: str = "a token") -> str | None:
    """Why ``token`` cannot be a bearer token (it travels in a header: printable ASCII, no surrounding
    spaces, at most MAX_TOKEN_CHARS), or None. Never quotes the token."""
    if not token or not token.isascii() or not token.isprintable() or token != token.strip():
        return f"{what} must be printable ASCII without surrounding spaces (it travels in a header)"
    if len(token) > MAX_TOKEN_CHARS:
        return f"{what} has {len(token)} characters; at most {MAX_TOKEN_CHARS} (it travels in a header)"
    return None


def route_problem(route: str) -> str | None:
    """Why ``route`` cannot be a routing key (printable ASCII, no surrounding spaces, at most
    MAX_ROUTE_CHARS), or None."""
    if not route.isascii() or not route.isprintable() or route != route.strip():
        return f"a route must be printable ASCII without surrounding spaces (a header); got {quote(route)}"
    if len(route) > MAX_ROUTE_CHARS:
        return f"a route has at most {MAX_ROUTE_CHARS} characters (it travels in a header); got {len(route)}"
    return None


def id_problem(seq_id: object, what: str = "seq_id") -> str | None:
    """Why ``seq_id`` is not a valid sequence id, or None when it is."""
    if not isinstance(seq_id, str):
        return f"{what} must be a string, got {type(seq_id).__name__}"
    if not seq_id:
        return f"{what} must be a non-empty string"
    size = len(seq_id.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        return f"{what} {quote(seq_id)} is too long: at most {MAX_ID_BYTES} bytes of UTF-8, got {size}"
    return None


_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"  # RFC 1123, and "_" as Docker's names have
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")
TARGET_FORMS = (
    "host:port, [ipv6]:port, dns:///host:port, ipv4:a.b.c.d:port or ipv6:[addr]:port, with 1 <= port <= 65535"
)


def _host_port(text: str, *, ipv4_only: bool = False, ipv6_only: bool = False) -> str | None:
    """Why ``text`` is not host:port (or [v6]:port), or None."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        return "its port must be a number from 1 to 65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{quote(host)} is not an IPv6 address"
        return None if not ipv4_only else "expected an IPv4 address"
    if ipv6_only:
        return "expected an IPv6 address in brackets"
    if ipv4_only:
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{quote(host)} is not an IPv4 address"
        return None
    return None if _HOSTNAME.fullmatch(host) else f"{quote(host)} is not a host name or address"


# gRPC's name resolvers: a target "unix:50051" is not host "unix", port 50051, but the Unix socket "50051".
# TransferKV reaches other servers over TCP only: a request could otherwise point the server at any local socket.
OTHER_SCHEMES = ("unix", "unix-abstract", "vsock", "xds", "google-c2p", "sockaddr", "uds")


def dial_target(target: str) -> str:
    """The name to give gRPC for a TransferKV target that ``target_problem`` accepted: a bare ``host:port`` as
    ``dns:///host:port``, so that gRPC never reads its host as the scheme of some resolver ("dns:1" is host
    "dns", port 1, as checked, not the DNS name "1")."""
    return target if target.startswith(("dns:///", "ipv4:", "ipv6:")) else "dns:///" + target


def target_problem(target: object) -> str | None:
    """Why ``target`` is not an address TransferKV can connect to (TARGET_FORMS), or None when it is."""
    if not isinstance(target, str):
        return f"the target must be a string, got {type(target).__name__}"
    if len(target.encode("utf-8", "surrogatepass")) > MAX_TARGET_BYTES:
        return f"the target {quote(target)} is longer than {MAX_TARGET_BYTES} bytes"
    scheme = target.partition(":")[0]
    if scheme.lower() in OTHER_SCHEMES:
        return (
            f"the target {quote(target)} names gRPC's {quote(scheme + ':')} scheme: TransferKV connects to other"
            f" servers over TCP only (a Unix socket or any other local endpoint is refused); expected {TARGET_FORMS}"
        )
    for scheme, kw in (("dns:///", {}), ("ipv4:", {"ipv4_only": True}), ("ipv6:", {"ipv6_only": True})):
        if target.startswith(scheme):
            problem = _host_port(target.removeprefix(scheme), **kw)
            break
    else:
        problem = _host_port(target)
    return (
        None
        if problem is None
        else f"the target {quote(target)} is not an address ({problem}); expected {TARGET_FORMS}"
    )
