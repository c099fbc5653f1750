"""Certificates for the TLS tests, made on the spot with `cryptography`: a CA, and certificates it signs for a
server (valid for 127.0.0.1 and localhost) and for clients (their common name names a tenant)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, PEM, and where they were written."""

    cert: bytes
    key: bytes
    cert_path: Path
    key_path: Path


class CA:
    """A certificate authority that signs the certificates of one test."""

    def __init__(self, directory: Path, name: str = "test-ca") -> None:
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._subject = subject
        self.cert = (
            _builder(subject, subject, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)
        self.path = directory / f"{name}.pem"
        self.path.write_bytes(self.pem)

    def server(self, name: str = "server") -> Pair:
        """A server certificate for 127.0.0.1 and localhost."""
        import ipaddress

        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return self._issue(name, [ExtendedKeyUsageOID.SERVER_AUTH], x509.SubjectAlternativeName(names))

    def client(self, common_name: str) -> Pair:
        """A client certificate whose CN is ``common_name``."""
        return self._issue(common_name, [ExtendedKeyUsageOID.CLIENT_AUTH], None)

    def _issue(self, name: str, usages: list[x509.ObjectIdentifier], san: x509.SubjectAlternativeName | None) -> Pair:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = _builder(subject, self._subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage(usages), critical=False
        )
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        cert = builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        pem_key = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        stem = f"{self.name}-{name}"
        cert_path, key_path = self.directory / f"{stem}.crt", self.directory / f"{stem}.key"
        cert_path.write_bytes(cert)
        key_path.write_bytes(pem_key)
        key_path.chmod(0o600)
        return Pair(cert, pem_key, cert_path, key_path)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
