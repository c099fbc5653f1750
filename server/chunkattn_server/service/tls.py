"""TLS: the server's certificate and key (--tls-cert, --tls-key), the CA its clients' certificates must chain
to under mutual TLS (--tls-client-ca), reloaded on SIGHUP; and the credentials TransferKV uses to reach its
targets (--transfer-tls-ca, --transfer-tls-cert, --transfer-tls-key).

A reload reads the files again and gRPC hands the new certificate to each later handshake: connections
already open, and their streams, go on with the one they have. A reload that cannot read or parse the files
keeps the old ones (and says why in the log).
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
from collections.abc import Callable

import grpc

from chunkattn_client._channel import Credentials
from chunkattn_server.config import ServerConfig
from chunkattn_server.errors import ConfigError

log = logging.getLogger(__name__)


def read(path: str, what: str) -> bytes:
    """A PEM file's bytes; ConfigError naming the flag when it cannot be read or holds no PEM block."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {path} holds no PEM block (-----BEGIN ...)")
    return data


class ServerTLS:
    """The server's TLS files; ``credentials()`` for add_secure_port, ``reload()`` on SIGHUP."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        self._paths = (cert, key, client_ca)
        self._initial = self._read()
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None  # for the next handshake

    @property
    def mutual(self) -> bool:
        return self._paths[2] is not None

    def _read(self) -> grpc.ServerCertificateConfiguration:
        """The files, checked: gRPC takes any bytes here and fails at the next handshake (keeping the old
        certificate, but after a reload logged as done), so Python's ssl checks the pair, and the CA, first."""
        cert, key, client_ca = self._paths
        pems = [read(cert, "--tls-cert"), read(key, "--tls-key")]
        ca = None if client_ca is None else read(client_ca, "--tls-client-ca")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(cert, key)
            if client_ca is not None:
                context.load_verify_locations(cafile=client_ca)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ConfigError(
                f"the TLS files cannot be used ({e}): --tls-cert must hold a PEM certificate (chain) whose key is"
                " --tls-key, and --tls-client-ca PEM CA certificates"
            ) from None
        return grpc.ssl_server_certificate_configuration([(pems[1], pems[0])], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial,
            self._fetch,  # type: ignore[arg-type]  # None means "keep the current one" (gRPC's docs)
            require_client_authentication=self.mutual,
        )

    def reload(self) -> bool:
        """Read the files again for later handshakes; on an error keep the old ones. Returns whether the new
        ones were taken."""
        try:
            configuration = self._read()
        except ConfigError as e:
            log.error("TLS files not reloaded, the previous ones stay in force: %s", e)
            return False
        with self._lock:
            self._pending = configuration
        log.info("TLS certificate reloaded: new connections get it, open ones keep theirs")
        return True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks before each handshake: a new configuration once after a reload, else None (keep)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending


def transfer_channels(
    ca: str | None, cert: str | None, key: str | None, trusted: Callable[[str], bool]
) -> Callable[[str], grpc.ChannelCredentials | None]:
    """TransferKV's credentials per target (files read once): TLS verified against ``ca`` (None: no TLS, unless
    a client certificate is given, then the system's roots); the client certificate (``cert``, ``key``) only
    for ``trusted`` targets, since a tenant names the target of its transfer. ConfigError naming the flag for
    a missing half of the pair or an unreadable file."""
    if (cert is None) != (key is None):
        raise ConfigError("--transfer-tls-cert and --transfer-tls-key go together: give both, or neither")
    ca_pem = None if ca is None else read(ca, "--transfer-tls-ca")
    own = Credentials(
        ca_pem,
        None if cert is None else read(cert, "--transfer-tls-cert"),
        None if key is None else read(key, "--transfer-tls-key"),
    ).channel_credentials()
    anyone = Credentials(ca_pem).channel_credentials() if cert is not None else own
    return lambda target: own if trusted(target) else anyone


@functools.cache
def transfer_credentials(config: ServerConfig) -> Callable[[str], grpc.ChannelCredentials | None]:
    """``transfer_channels`` for a server's config (its files read once per config): TLS for TransferKV's
    channel to each target (None: plaintext), the server's client certificate only to ``config.trusts``."""
    return transfer_channels(config.transfer_tls_ca, config.transfer_tls_cert, config.transfer_tls_key, config.trusts)
