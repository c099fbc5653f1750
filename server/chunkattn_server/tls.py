"""TLS: the server's certificate and key (--tls-cert, --tls-key), the CA its clients' certificates must chain
to under mutual TLS (--tls-client-ca), reloaded on SIGHUP; and the credentials TransferKV uses to reach its
targets (--transfer-tls-ca, --transfer-tls-cert, --transfer-tls-key).

A reload reads the files again and gRPC hands the new certificate to each later handshake: connections
already open, and their streams, go on with the one they have. A reload that cannot read or parse the files
keeps the old ones (and says why in the log).
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass

import grpc

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


@dataclass(frozen=True)
class _Files:
    cert: bytes
    key: bytes
    client_ca: bytes | None

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.client_ca)


class ServerTLS:
    """The server's TLS files; ``credentials()`` for add_secure_port, ``reload()`` on SIGHUP."""

    def __init__(self, cert: str, key: str, client_ca: str | None) -> None:
        self._paths = (cert, key, client_ca)
        self._files = self._read()
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None  # for the next handshake

    @property
    def mutual(self) -> bool:
        return self._paths[2] is not None

    def _read(self) -> _Files:
        cert, key, client_ca = self._paths
        files = _Files(
            read(cert, "--tls-cert"),
            read(key, "--tls-key"),
            None if client_ca is None else read(client_ca, "--tls-client-ca"),
        )
        # gRPC takes any bytes here and fails at the next handshake (keeping the old certificate, but after a
        # reload logged as done): Python's ssl checks the pair, and the CA, now.
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
        return files

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._files.configuration(),
            self._fetch,  # type: ignore[arg-type]  # None means "keep the current one" (gRPC's docs)
            require_client_authentication=self.mutual,
        )

    def reload(self) -> bool:
        """Read the files again for later handshakes; on an error keep the old ones. Returns whether the new
        ones were taken."""
        try:
            files = self._read()
        except ConfigError as e:
            log.error("TLS files not reloaded, the previous ones stay in force: %s", e)
            return False
        with self._lock:
            self._files = files
            self._pending = files.configuration()
        log.info("TLS certificate reloaded: new connections get it, open ones keep theirs")
        return True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks before each handshake: a new configuration once after a reload, else None (keep)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending


def channel_credentials(ca: str | None, cert: str | None, key: str | None, flag: str) -> grpc.ChannelCredentials | None:
    """Credentials for a client channel: TLS verified against ``ca`` (None: no TLS, unless a client certificate
    is given, then the system's roots), presenting ``cert`` and ``key`` when both are given. ConfigError
    naming ``flag`` (e.g. --transfer-tls) for a missing half of a pair or an unreadable file."""
    if (cert is None) != (key is None):
        raise ConfigError(f"{flag}-cert and {flag}-key go together: give both, or neither")
    if ca is None and cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca is None else read(ca, f"{flag}-ca"),
        private_key=None if key is None else read(key, f"{flag}-key"),
        certificate_chain=None if cert is None else read(cert, f"{flag}-cert"),
    )
