"""Everything about opening a channel to a chunkattn server, and the one client module the server imports:
channel options and keepalive, credentials, the bearer token's metadata, the routing header."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from chunkattn_client.limits import token_problem

# Large enough for a 4,096-token prefill of Llama-4-Scout's shape in bf16 (q, k, v: 56 MiB) with room.
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20

# Envoy in front of several replicas hashes this header to pick one (deploy/envoy/envoy.yaml): the calls
# of one session must reach the replica that holds its KV. A direct connection ignores it.
ROUTE_HEADER = "x-chunkattn-route"

# Keepalive pings: chunkattn servers take one every MIN_KEEPALIVE_S or more (server.PING_POLICY).
MIN_KEEPALIVE_S = 5.0
MAX_KEEPALIVE_S = 86_400.0


@dataclass(frozen=True)
class Credentials:
    """How a client proves who it is and checks whom it talks to (docs/security.md).

    root_certificates: PEM CA(s) the server's certificate must chain to; setting it (or a client
    certificate) turns TLS on. certificate_chain, private_key: PEM, a client certificate for servers that
    require one (mutual TLS); both or neither. token: sent as ``authorization: Bearer <token>`` call
    metadata on every call (over plaintext too: keep that to trusted networks).
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain and private_key go together: give both (mutual TLS), or neither")
        problem = None if self.token is None else token_problem(self.token)
        if problem:
            raise ValueError(problem)

    @property
    def tls(self) -> bool:
        return self.root_certificates is not None or self.certificate_chain is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """gRPC's credentials for a TLS channel (None: plaintext)."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that presents ``token`` (None or empty: none)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def check_keepalive(keepalive_s: float | None) -> None:
    """ValueError unless ``keepalive_s`` is None or 0 (no pings) or within [MIN_KEEPALIVE_S, MAX_KEEPALIVE_S]."""
    if keepalive_s and not MIN_KEEPALIVE_S <= keepalive_s <= MAX_KEEPALIVE_S:  # NaN fails the comparison too
        raise ValueError(
            f"keepalive must be None or 0 (no pings), or from {MIN_KEEPALIVE_S:g} s (chunkattn servers refuse more"
            f" frequent pings) to {MAX_KEEPALIVE_S:g} s; got {keepalive_s!r}"
        )


def channel_options(max_message_bytes: int, keepalive_s: float | None) -> list[tuple[str, Any]]:
    """gRPC channel arguments. With ``keepalive_s``, the channel pings the server after that long without
    activity (between calls too) and closes the connection, failing its calls with UNAVAILABLE, when a ping
    is not answered within as long: a server that vanished without closing the connection is found out
    within ~2 x keepalive_s. ValueError for a keepalive servers would refuse (see check_keepalive)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if keepalive_s:
        check_keepalive(keepalive_s)
        ms = int(keepalive_s * 1000)
        options += [
            ("grpc.keepalive_time_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # else, between calls, two pings and then one a minute
            # Both timeouts: with the keepalive one alone, gRPC 1.85 still waits its 60 s ping timeout.
            ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms),
        ]
    return options


def open_channel(
    api: Any, target: str, max_message_bytes: int, keepalive_s: float | None, credentials: Credentials
) -> Any:
    """A channel from ``api`` (the grpc module, or grpc.aio): TLS when the credentials say so."""
    options = channel_options(max_message_bytes, keepalive_s)
    creds = credentials.channel_credentials()
    if creds is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, creds, options=options)
