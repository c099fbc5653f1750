"""ChunkAttnError, the one exception of the clients, and how a failed gRPC call or response status becomes one.

A call whose connection to the server was lost gets UNAVAILABLE, whatever status gRPC gave it
(``connection_lost``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import grpc


class ChunkAttnError(Exception):
    """A call failed. ``code`` is the grpc.StatusCode; ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> ChunkAttnError:
        """The ChunkAttnError of a failed gRPC call: its status and details, except that a connection lost
        mid-call (see ``connection_lost``) is UNAVAILABLE, whatever status gRPC gave it, with a message
        that says so."""
        # Failed calls raise grpc.Call objects (code(), details()); a bare RpcError has neither.
        code = getattr(err, "code", lambda: None)()
        details: str = getattr(err, "details", lambda: None)() or str(err)
        code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
        if connection_lost(code, details):
            return cls(grpc.StatusCode.UNAVAILABLE, lost_connection_message(code, details))
        return cls(code, details)

    @classmethod
    def from_status(cls, code: int, message: str) -> ChunkAttnError:
        """The ChunkAttnError of a status carried in a response (an int code; one this client does not know
        is UNKNOWN)."""
        return cls(_STATUS_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN), message)


_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}

# What gRPC core's HTTP/2 transport says of a call whose connection or stream went away under it, and never
# a chunkattn server's message: "Stream removed (Socket closed)" (the server died), "Stream removed
# (recvmsg:Connection reset by peer (104))", and "Stream removed (RST_STREAM (Received RST_STREAM with error
# code 2))" where a proxy reset the stream: Envoy, when the replica behind it dies mid-stream. gRPC gives
# the last INTERNAL (an RST_STREAM is INTERNAL by its HTTP/2 mapping), the others UNAVAILABLE.
_CONNECTION_LOST = re.compile(r"Stream removed(?: \(.*\))?|Received RST_STREAM with error code \d+", re.DOTALL)


def connection_lost(code: grpc.StatusCode, details: str) -> bool:
    """Whether a call failed because its connection to the server was lost (or a proxy reset it): INTERNAL
    or UNAVAILABLE with gRPC core's own words for it. An INTERNAL with the server's message (a server bug)
    is not."""
    transport = code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    return transport and _CONNECTION_LOST.fullmatch(details) is not None


def lost_connection_message(code: grpc.StatusCode, details: str) -> str:
    """The message of a call whose connection was lost: what happened, gRPC's original status, what it means."""
    return (
        f"the connection to the server was lost mid-call (gRPC: {code.name}: {details}): the server went away"
        " or a proxy in between reset the call. Whether the server carried this call out is unknown; on a"
        " stream, the answers received before stand, and an export or import cut short is incomplete. Retry on"
        " a new call or stream (the channel reconnects); the server that answers it, a restarted one or, behind"
        " Envoy, another replica, may not hold this session's KV (NOT_FOUND): then start the sequence again"
    )


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Turn a failed gRPC call into ChunkAttnError (works around ``await`` too)."""
    try:
        yield
    except grpc.RpcError as err:
        raise ChunkAttnError.from_rpc(err) from None


class LostConnection(ChunkAttnError):
    """UNAVAILABLE: the data-plane connection carrying a call was lost (the server went away, or the heartbeat
    timed out on a connection that went silent). As with gRPC's, the call may or may not have been carried out."""

    def __init__(self, address: str, event: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"the data-plane connection to {address} was lost mid-call (ZeroMQ: {event}): the server went away,"
            " or the connection went silent past the heartbeat timeout. Whether the server carried this call out"
            " is unknown; retry (the socket reconnects), and where a restarted server answers NOT_FOUND, start the"
            " sequence again",
        )
        self.address = address


class NoAnswer(ChunkAttnError):
    """DEADLINE_EXCEEDED: no answer on the data plane within the client's timeout_s (the server may still run
    the call; its late answer is dropped)."""
