"""The data plane's sessions (OpenDataPlane): key -> the tenant it serves, the credential that opened it, its
expiry. Plain Python, event-loop only (not thread-safe).

A session is opened by an authenticated gRPC call and lives until its expiry, until a reload of the token file
no longer gives its credential the same tenant (revoked), or until its tenant opens more than
MAX_SESSIONS_PER_TENANT (the oldest ends). An ended session is kept a while (KEPT_S) so that its key is told
why it no longer works (expired, revoked) rather than that it is unknown; then it is forgotten.

Keys are looked up in a dict. That leaks no usable timing: the dict finds the slot by the key's hash, which
Python computes with SipHash under a per-process random secret (a guesser cannot choose keys that land next
to a live one), and compares bytes only against entries of the same hash; guessing a live key is a 256-bit
guess whatever the timing of one comparison says.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from chunkattn_client.dataplane import KEY_BYTES
from chunkattn_server.errors import Unauthenticated
from chunkattn_server.service.auth import Credential, Tenant

MAX_SESSIONS_PER_TENANT = 1024  # sessions of one tenant at once; opening one more ends its oldest
KEPT_S = 600.0  # an ended session's key is told why (expired, revoked) this long, then it is unknown
OPEN_ONE = "open one with OpenDataPlane (the client does so when it connects)"


@dataclass
class Session:
    """One session: its key (KEY_BYTES random bytes), its tenant (refreshed on reload: its quotas), the
    credential that opened it (None without authentication), its expiry (``clock`` seconds), and why it ended
    early ("" while it has not)."""

    key: bytes
    tenant: Tenant
    credential: Credential | None
    expires: float
    ended: str = ""


class Sessions:
    """The session table. ``ttl_s``: how long a session lives; ``clock``: monotonic seconds."""

    def __init__(
        self, ttl_s: float, max_per_tenant: int = MAX_SESSIONS_PER_TENANT, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_per_tenant = max_per_tenant
        self._clock = clock
        self._by_key: dict[bytes, Session] = {}
        self._by_tenant: dict[str, OrderedDict[bytes, None]] = {}  # each tenant's keys, oldest first
        self._next_sweep = 0.0

    def open(self, tenant: Tenant, credential: Credential | None) -> Session:
        """A new session of ``tenant`` (its oldest ended when the tenant holds max_per_tenant)."""
        self.sweep()
        keys = self._by_tenant.setdefault(tenant.name, OrderedDict())
        while len(keys) >= self.max_per_tenant:
            self._forget(next(iter(keys)))
            keys = self._by_tenant.setdefault(tenant.name, OrderedDict())
        key = secrets.token_bytes(KEY_BYTES)
        session = Session(key, tenant, credential, self._clock() + self.ttl_s)
        self._by_key[key] = session
        keys[key] = None
        return session

    def lookup(self, key: bytes) -> Tenant:
        """The tenant of the live session ``key`` names; Unauthenticated saying why when there is none."""
        session = self._by_key.get(key)  # by hash: see the module docstring
        if session is None:
            raise Unauthenticated(
                f"no live data-plane session for this key: unknown, or ended more than {KEPT_S:g} s ago; {OPEN_ONE}"
            )
        if session.ended:
            raise Unauthenticated(f"this data-plane session was {session.ended}; {OPEN_ONE}")
        if self._clock() >= session.expires:
            raise Unauthenticated(f"this data-plane session expired (sessions live {self.ttl_s:g} s); {OPEN_ONE}")
        return session.tenant

    def recheck(self, tenant_by: Callable[[Credential], Tenant]) -> int:
        """After a reload of the token file: each live session whose credential ``tenant_by`` no longer maps to
        its tenant (Unauthenticated, or another tenant) ends as revoked; the others take their tenant anew (its
        quotas). Returns how many ended."""
        revoked = 0
        for session in self._by_key.values():
            if session.ended or session.credential is None:
                continue
            try:
                now = tenant_by(session.credential)
            except Unauthenticated:
                now = None
            if now is None or now.name != session.tenant.name:
                session.ended = "revoked: its credentials name no tenant, or another, since the token file was reloaded"
                revoked += 1
            else:
                session.tenant = now
        return revoked

    def sweep(self) -> None:
        """Forget sessions ended (expired or revoked) more than KEPT_S ago (a scan of the table at most once a
        second)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        stale = [k for k, s in self._by_key.items() if now >= s.expires + KEPT_S]
        for key in stale:
            self._forget(key)

    def end_all(self, why: str) -> None:
        """End every session (the server stops)."""
        for session in self._by_key.values():
            session.ended = session.ended or why

    def live(self) -> int:
        """Sessions that still serve (neither ended nor expired)."""
        now = self._clock()
        return sum(1 for s in self._by_key.values() if not s.ended and now < s.expires)

    def __len__(self) -> int:
        """Sessions held, ended ones not yet forgotten included."""
        return len(self._by_key)

    def _forget(self, key: bytes) -> None:
        session = self._by_key.pop(key)
        keys = self._by_tenant[session.tenant.name]
        del keys[key]
        if not keys:
            del self._by_tenant[session.tenant.name]
