"""Who is calling: tenants, their credentials and quotas, from the operator's token file (--auth-tokens).

Without a token file every caller is the anonymous tenant "" with no quota (a server on a trusted network).
With one, every chunkattn RPC must name a tenant (health and reflection stay open):

- a bearer token, ``authorization: Bearer <token>`` call metadata: the file holds its SHA-256, never the
  token, and a presented token's digest is compared with every tenant's in constant time; or
- under mutual TLS (--tls-client-ca), a client certificate whose common name (CN) the file lists as one of
  the tenant's ``subjects``. A token, when sent, decides: a wrong token is refused whatever the certificate.

The file (JSON; reloaded on SIGHUP, a bad new file keeps the old one)::

    {"tenants": {
        "team-a": {"tokens_sha256": ["<64 hex digits>", ...],
                   "subjects": ["runner.team-a"],
                   "max_kv_blocks": 4096, "max_sequences": 256, "max_calls": 32,
                   "max_open_calls": 128},
        "team-b": {"tokens_sha256": ["..."]}}}

A tenant name is 1-64 of ``A-Z a-z 0-9 _ . -``, starting with a letter or digit; it needs a token or a
subject; each digest and subject is listed once, for one tenant; the quotas are optional positive integers
(KV blocks and sequences held at once, calls worked on at once, calls open at once with idle streams). A
key given twice in one object (a tenant, a quota, "tenants") is refused: JSON readers keep the last one.
``chunkattn-server --hash-token`` prints a token's digest. Tokens are never logged: messages name the
tenant, never the token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from chunkattn_server import jsonfile
from chunkattn_server.errors import ConfigError, Unauthenticated
from chunkattn_server.kv.records import Quota

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_QUOTAS = ("max_kv_blocks", "max_sequences", "max_calls", "max_open_calls")
_FIELDS = {"tokens_sha256", "subjects", *_QUOTAS}
BEARER = "bearer "


@dataclass(frozen=True)
class Tenant:
    """A caller's tenant: its name (namespace of its sequences; "" is anonymous) and its quotas."""

    name: str
    quota: Quota = field(default_factory=Quota)
    max_calls: int | None = None  # calls worked on at once
    max_open_calls: int | None = None  # calls open at once, idle streams included


ANONYMOUS = Tenant("")


@dataclass(frozen=True)
class Credential:
    """What a call presented, as kept to check again after a reload (a data-plane session's): the SHA-256 of
    its bearer token (never the token), or, without a token, its client certificate's common name."""

    token_sha256: bytes | None = None
    subject: str | None = None


def token_digest(token: str) -> str:
    """The SHA-256 of a token, in hex, as the token file lists it."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Tenants:
    """One reading of the token file."""

    by_name: Mapping[str, Tenant]
    digests: tuple[tuple[bytes, str], ...]  # (SHA-256 of a token, tenant)
    subjects: Mapping[str, str]  # certificate common name -> tenant

    @classmethod
    def load(cls, path: str) -> Tenants:
        """Read and check a token file; ConfigError saying what is wrong (never quoting a digest)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = jsonfile.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read the token file {path}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"the token file {path} is not valid JSON: {e}") from None
        except ValueError as e:  # a key given twice
            raise ConfigError(f"{path}: {e}") from None
        return cls.parse(data, path)

    @classmethod
    def parse(cls, data: Any, where: str = "the token file") -> Tenants:
        if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
            raise ConfigError(f'{where}: expected {{"tenants": {{"<name>": {{...}}, ...}}}}')
        by_name: dict[str, Tenant] = {}
        digests: dict[bytes, tuple[str, int]] = {}  # digest -> (tenant, index in its tokens_sha256)
        subjects: dict[str, str] = {}
        for name, spec in data["tenants"].items():
            if not _NAME.fullmatch(name):
                raise ConfigError(
                    f"{where}: tenant name {name[:70]!r} must be 1-64 of A-Z a-z 0-9 _ . -, starting with a"
                    " letter or digit"
                )
            if not isinstance(spec, dict):
                raise ConfigError(f"{where}: tenant {name!r} must be an object")
            unknown = sorted(set(spec) - _FIELDS)
            if unknown:
                raise ConfigError(f"{where}: tenant {name!r} has unknown fields {unknown}; known: {sorted(_FIELDS)}")
            tokens = _strings(spec.get("tokens_sha256", []), f"{where}: tokens_sha256 of tenant {name!r}")
            names = _strings(spec.get("subjects", []), f"{where}: subjects of tenant {name!r}")
            if not tokens and not names:
                raise ConfigError(f"{where}: tenant {name!r} needs a token (tokens_sha256) or a certificate subject")
            for i, digest in enumerate(tokens):
                if not _DIGEST.fullmatch(digest):
                    raise ConfigError(
                        f"{where}: token {i} of tenant {name!r} is not a SHA-256 in hex (64 digits); make one with"
                        " chunkattn-server --hash-token"
                    )
                raw = bytes.fromhex(digest)
                if raw in digests:
                    owner, j = digests[raw]
                    raise ConfigError(f"{where}: token {i} of tenant {name!r} is also token {j} of tenant {owner!r}")
                digests[raw] = (name, i)
            for subject in names:
                if subject in subjects:
                    owner = subjects[subject]
                    raise ConfigError(
                        f"{where}: subject {subject[:70]!r} is listed twice for tenant {name!r}"
                        if owner == name
                        else f"{where}: subject {subject[:70]!r} names two tenants, {owner!r} and {name!r}"
                    )
                subjects[subject] = name
            limit = {key: _positive(spec.get(key), f"{where}: {key} of tenant {name!r}") for key in _QUOTAS}
            quota = Quota(limit["max_kv_blocks"], limit["max_sequences"])
            by_name[name] = Tenant(name, quota, limit["max_calls"], limit["max_open_calls"])
        return cls(by_name, tuple((raw, owner) for raw, (owner, _) in digests.items()), subjects)


class Authenticator:
    """Names the tenant of each call (see the module docstring). ``path`` None: authentication is off."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.tenants = Tenants({}, (), {}) if path is None else Tenants.load(path)
        if path is not None:
            _warn_if_readable(path)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def reload(self) -> bool:
        """Read the token file again; on a bad file keep the tenants as they were and log why. Returns
        whether the new file was taken."""
        if self.path is None:
            return False
        try:
            tenants = Tenants.load(self.path)
        except ConfigError as e:
            log.error("the token file was not reloaded, the previous one stays in force: %s", e)
            return False
        self.tenants = tenants
        _warn_if_readable(self.path)
        log.info("token file reloaded: %d tenants", len(tenants.by_name))
        return True

    def tenant_of(
        self, metadata: Iterable[tuple[str, Any]] | None, auth_context: Mapping[str, Iterable[bytes]]
    ) -> Tenant:
        """The caller's tenant, from its call metadata and TLS peer; Unauthenticated when it has none."""
        if self.path is None:
            return ANONYMOUS
        return self.tenant_by(self.credential(metadata, auth_context))

    def credential(
        self, metadata: Iterable[tuple[str, Any]] | None, auth_context: Mapping[str, Iterable[bytes]]
    ) -> Credential:
        """What the call presents (its token decides when it sends one); Unauthenticated when it presents
        nothing, or a malformed authorization header."""
        header = None
        for key, value in metadata or ():
            if key == "authorization":
                header = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
                break
        if header is not None:
            if not header[: len(BEARER)].lower() == BEARER or not header[len(BEARER) :].strip():
                raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
            return Credential(token_sha256=hashlib.sha256(header[len(BEARER) :].strip().encode("utf-8")).digest())
        for common_name in auth_context.get("x509_common_name", ()):
            return Credential(subject=common_name.decode("utf-8", "replace"))
        raise Unauthenticated(
            "this server requires credentials: send 'authorization: Bearer <token>' call metadata"
            " (ChunkAttnClient(token=...), chunkattn --token or CHUNKATTN_TOKEN), or a client certificate that"
            " names a tenant"
        )

    def tenant_by(self, credential: Credential) -> Tenant:
        """The tenant the token file (as loaded now) gives ``credential``; Unauthenticated when none."""
        tenants = self.tenants  # one reading of the file for the whole decision
        if credential.token_sha256 is not None:
            found = ""
            for digest, name in tenants.digests:  # every digest, every time: the time says nothing
                if hmac.compare_digest(credential.token_sha256, digest):
                    found = name
            if not found:
                raise Unauthenticated("the token is not valid here (unknown, mistyped or revoked)")
            return tenants.by_name[found]
        subject = credential.subject or ""
        tenant = tenants.subjects.get(subject)
        if tenant is None:
            raise Unauthenticated(f"the client certificate's subject (CN {subject[:64]!r}) names no tenant here")
        return tenants.by_name[tenant]

    def current(self, tenant: Tenant, context: Any) -> Tenant:
        """The tenant of a call already under way (a stream), again: unchanged unless the token file was
        reloaded since, and then its credentials must still name the same tenant (Unauthenticated: revoked,
        or moved to another tenant)."""
        if self.path is None or self.tenants.by_name.get(tenant.name) is tenant:
            return tenant
        now = self.tenant_of(context.invocation_metadata(), context.auth_context())
        if now.name != tenant.name:
            raise Unauthenticated("the call's credentials name another tenant since the token file was reloaded")
        return now


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{what} must be a list of non-empty strings")
    return list(value)


def _positive(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer (or left out: no limit), got {value!r}")
    return value


def _warn_if_readable(path: str) -> None:
    """The file holds only digests, but who may read (or write) it should still be the operator alone."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the token file %s is readable or writable by others (mode %o): chmod 600 it", path, mode & 0o777)


class Gate(grpc.aio.ServerInterceptor):
    """(Installed with authentication on.) Refuse a call of ``prefix`` (the chunkattn service) at its headers when its
    token is missing or wrong, before gRPC waits for, and holds, its request: otherwise a client without
    credentials could open calls that never send and hold the server's call slots. Under mutual TLS a call
    without a token goes on (its certificate, already verified, may name its tenant; the handler decides).
    ``refused(rpc)`` counts a refusal here."""

    def __init__(self, auth: Authenticator, mutual: bool, prefix: str, refused: Callable[[str], None]) -> None:
        self._auth = auth
        self._mutual = mutual
        self._prefix = prefix
        self._refused = refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = details.method
        if method.startswith(self._prefix):
            metadata = details.invocation_metadata
            if not (self._mutual and not any(key == "authorization" for key, _ in metadata or ())):
                try:
                    self._auth.tenant_of(metadata, {})
                except Unauthenticated as e:
                    self._refused(method.rsplit("/", 1)[-1])
                    return _refusal(str(e))
        return await continuation(details)


def _refusal(message: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that answers UNAUTHENTICATED at once, reading nothing (a client-streaming one: gRPC then
    does not wait for a request message, whatever the method's own shape)."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_unary_rpc_method_handler(refuse)
