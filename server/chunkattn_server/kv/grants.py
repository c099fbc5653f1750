"""Grants: blocks of a block space handed over (GrantBlocks), parked until another space takes them
(CopyBlocks). Plain Python and numpy; the engine copies the pages (engine/core.py).

Disaggregated prefill/decode hands a request's KV from the engine that computed its prompt to the engine that
decodes it. The prefill engine frees the request's blocks when it finishes and reuses them (with prefix
caching it also keeps them cached and reads them again), so the handoff cannot name them in place: a grant is
a *copy* of them, in pool blocks of its own laid out as its space's rows were ([n, pool blocks per space
block], the same ``layer_planes``), charged to the grantor's tenant (its max_kv_blocks) until it ends. It ends
when CopyBlocks takes it (single use: the claimant's space holds its copy then), when its ttl passes, or when
the server stops.

A grant's name is the grantor's (32 to 64 characters of [A-Za-z0-9_-], random; no message echoes it): the
scheduler that decides on a handoff names it before the worker parks the blocks, and hands the name to the
decode side. The name is a capability, but not the only check: a grant is taken only by its grantor's tenant
or the one ``to_tenant`` names; to anyone else it does not exist (UnknownGrant, as for a name never issued).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from chunkattn_server.errors import GrantExists, InvalidArgument, OutOfBlocks, UnknownGrant
from chunkattn_server.kv.block_pool import BlockPool
from chunkattn_server.kv.spaces import SpaceState

GRANT_ID = re.compile(r"[A-Za-z0-9_-]{32,64}")
MAX_GRANTS_PER_TENANT = 4096  # open grants one tenant may hold (a prefill engine's requests in flight, with room)
DEFAULT_TTL_S = 60.0
MAX_TTL_S = 3600.0
MAX_TENANT_BYTES = 256
MAX_TAG_BYTES = 128
LEAVING_GRACE_S = 60.0  # a grant on its way to another server is ended this long after its push's deadline


@dataclass
class GrantState:
    """One grant: its parked pool blocks [n, pool blocks per space block] int64, the layout of the space they
    came from (per layer its plane, and the plane count), the tokens they hold and what they are (the grantor's
    words: num_tokens, tag), who may take it, and when it ends (time.monotonic)."""

    grant_id: str
    tenant: str
    to_tenant: str
    blocks: np.ndarray
    layer_planes: tuple[int, ...]
    num_planes: int
    num_tokens: int
    expires: float
    tag: str = ""

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    def may_take(self, tenant: str) -> bool:
        return tenant == self.tenant or (bool(self.to_tenant) and tenant == self.to_tenant)


def block_ids(field: str, values: Sequence[int], limit: int, *, unique: bool) -> np.ndarray:
    """``values`` as int64 [n], checked: at least one, each 0 .. limit - 1 and, when ``unique``, listed once.
    InvalidArgument naming ``field`` and the first bad entry."""
    ids = np.asarray(values, dtype=np.int64).reshape(-1)
    if not len(ids):
        raise InvalidArgument(f"{field} is empty; expected at least one block id")
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    if len(bad):
        i = int(bad[0])
        raise InvalidArgument(f"{field}[{i}] is {int(ids[i])}; expected a block id 0 .. {limit - 1}")
    if unique and len(np.unique(ids)) != len(ids):
        seen: set[int] = set()
        for i, b in enumerate(ids.tolist()):
            if b in seen:
                raise InvalidArgument(f"{field}[{i}] is {b}, listed before; expected each block once")
            seen.add(b)
    return ids


def check_grant_id(grant_id: str) -> None:
    """InvalidArgument unless ``grant_id`` is 32 to 64 characters of [A-Za-z0-9_-]."""
    if not GRANT_ID.fullmatch(grant_id):  # never echoed: a grant's name is a secret
        raise InvalidArgument(
            f"grant_id ({len(grant_id)} characters) is not a grant name: expected 32 to 64 characters of"
            " [A-Za-z0-9_-], chosen at random (secrets.token_hex(16) gives one)"
        )


def same_layout(source: tuple[int, ...], source_planes: int, dest: SpaceState, what: str) -> None:
    """InvalidArgument unless ``dest`` lays out its layers as ``source`` does (per layer its plane)."""
    if source != dest.layer_planes or source_planes != dest.num_planes:
        raise InvalidArgument(
            f"{what} and the destination space are laid out otherwise: layer_planes {list(source)} ({source_planes}"
            f" planes) against {list(dest.layer_planes)} ({dest.num_planes} planes); blocks copy only between"
            " spaces opened with the same layer_planes"
        )


class Grants:
    """The grants of one engine, over ``pool`` and the KV manager's ``check_quota``; ``planes_per_block``: G,
    the pool's planes per block."""

    def __init__(
        self,
        pool: BlockPool,
        check_quota: Callable[[str, int, int], None],
        block_size: int,
        planes_per_block: int,
        charge: Callable[[str, int, float], None] = lambda tenant, blocks, now: None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.planes_per_block = planes_per_block
        self._check_quota = check_quota
        self._charge = charge
        self._grants: dict[str, GrantState] = {}
        self._reserved: dict[str, GrantState] = {}  # being parked here or arriving from another server
        self._leaving: dict[str, GrantState] = {}  # on their way to another server (expires: the push's end)
        self._count: dict[str, int] = {}  # tenant -> grants held, in any state
        self._parked = 0  # pool blocks they hold

    def __len__(self) -> int:
        """Grants held, in any state (open, being parked, arriving, leaving)."""
        return len(self._grants) + len(self._reserved) + len(self._leaving)

    def parked_blocks(self) -> int:
        """Pool blocks the grants hold, in any state."""
        return self._parked

    def reserve_from(
        self,
        space: SpaceState,
        ids: Sequence[int],
        grant_id: str,
        *,
        num_tokens: int,
        ttl_s: float,
        to_tenant: str,
        tag: str = "",
        now: float | None = None,
    ) -> tuple[GrantState, np.ndarray]:
        """A new grant of ``space``'s blocks ``ids`` (its tenant's), reserved (``reserve``: not open yet); and
        the space blocks' ids checked [n] int64. The caller copies their pages into the grant's, having zeroed
        any still stale, then opens it (``insert``), or ``release``s it if that fails. InvalidArgument,
        GrantExists, OutOfBlocks / QuotaExceeded; nothing is taken then."""
        checked = block_ids("block_ids", ids, space.num_blocks, unique=True)
        grant = self.reserve(
            grant_id,
            space.tenant,
            len(checked),
            space.layer_planes,
            space.num_planes,
            num_tokens=num_tokens,
            ttl_s=ttl_s,
            to_tenant=to_tenant,
            tag=tag,
            now=now,
        )
        return grant, checked

    def add(
        self,
        space: SpaceState,
        ids: Sequence[int],
        grant_id: str,
        *,
        num_tokens: int,
        ttl_s: float,
        to_tenant: str,
        tag: str = "",
        now: float | None = None,
    ) -> tuple[GrantState, np.ndarray]:
        """``reserve_from`` and open the grant at once (for a caller with nothing to copy in between)."""
        grant, checked = self.reserve_from(
            space, ids, grant_id, num_tokens=num_tokens, ttl_s=ttl_s, to_tenant=to_tenant, tag=tag, now=now
        )
        self.insert(grant)
        return grant, checked

    def reserve(
        self,
        grant_id: str,
        tenant: str,
        num_blocks: int,
        layer_planes: tuple[int, ...],
        num_planes: int,
        *,
        num_tokens: int,
        ttl_s: float,
        to_tenant: str,
        tag: str = "",
        now: float | None = None,
    ) -> GrantState:
        """A grant checked and its pool blocks taken (``num_blocks`` rows of this pool's pool blocks per space
        block for ``num_planes``), its name held, not yet open (``insert`` opens it, ``release`` gives all
        back). InvalidArgument, GrantExists, OutOfBlocks / QuotaExceeded; nothing is taken then."""
        now = time.monotonic() if now is None else now
        check_grant_id(grant_id)
        held = num_blocks * self.block_size
        if not 0 <= num_tokens <= held:
            raise InvalidArgument(
                f"num_tokens is {num_tokens}; {num_blocks} blocks of {self.block_size} tokens hold 0 .. {held}"
            )
        if ttl_s != 0 and not 1 <= ttl_s <= MAX_TTL_S:  # NaN fails
            raise InvalidArgument(f"ttl_s is {ttl_s}; expected 0 ({DEFAULT_TTL_S:g} s) or 1 .. {MAX_TTL_S:g} seconds")
        if len(to_tenant.encode("utf-8", "surrogatepass")) > MAX_TENANT_BYTES:
            raise InvalidArgument(f"to_tenant is longer than {MAX_TENANT_BYTES} bytes")
        if len(tag.encode("utf-8", "surrogatepass")) > MAX_TAG_BYTES:
            raise InvalidArgument(f"tag is longer than {MAX_TAG_BYTES} bytes")
        if grant_id in self._grants or grant_id in self._reserved or grant_id in self._leaving:
            raise GrantExists("a grant of that name exists; name each grant anew, at random")
        if self._count.get(tenant, 0) >= MAX_GRANTS_PER_TENANT:
            raise OutOfBlocks(
                f"your tenant has {MAX_GRANTS_PER_TENANT} grants open, the most it may; let them be taken or expire"
            )
        per_block = math.ceil(num_planes / self.planes_per_block)
        needed = num_blocks * per_block
        self._check_quota(tenant, needed, 0)
        if not self.pool.can_allocate(needed):
            raise OutOfBlocks(
                f"a grant of {num_blocks} blocks parks {needed} pool blocks and the pool has {self.pool.num_free}"
                f" free of {self.pool.num_blocks}: grant fewer at once, or let open grants be taken first"
            )
        self._charge(tenant, needed, now)  # the tenant's allowance of blocks to take and zero (kv/spaces.py)
        taken = self.pool.allocate(needed, account=tenant)
        self._parked += needed
        grant = GrantState(
            grant_id,
            tenant,
            to_tenant,
            np.array(taken, dtype=np.int64).reshape(num_blocks, per_block),
            layer_planes,
            num_planes,
            num_tokens,
            now + (ttl_s or DEFAULT_TTL_S),
            tag,
        )
        self._reserved[grant_id] = grant
        self._count[tenant] = self._count.get(tenant, 0) + 1
        return grant

    def insert(self, grant: GrantState) -> None:
        """Open a reserved grant: from now on it can be taken (``get``), and ends at its expiry."""
        del self._reserved[grant.grant_id]
        self._grants[grant.grant_id] = grant

    def release(self, grant: GrantState) -> int:
        """Give back what a grant holds, in any state: its name and its pool blocks; how many (0 when it was
        given back before)."""
        held = [d for d in (self._grants, self._reserved, self._leaving) if d.get(grant.grant_id) is grant]
        if not held:
            return 0
        del held[0][grant.grant_id]
        self._parked -= int(grant.blocks.size)
        self._count[grant.tenant] -= 1
        if not self._count[grant.tenant]:
            del self._count[grant.tenant]
        blocks = grant.blocks.reshape(-1).tolist()
        self.pool.free(blocks)
        return len(blocks)

    def detach(self, grant: GrantState, within_s: float, now: float | None = None) -> None:
        """Close an open grant to takers (a grant on its way to another server), holding its name and blocks
        until ``release``, or until ``within_s`` (the push's deadline) and LEAVING_GRACE_S have passed."""
        now = time.monotonic() if now is None else now
        del self._grants[grant.grant_id]
        grant.expires = now + within_s + LEAVING_GRACE_S
        self._leaving[grant.grant_id] = grant

    def get(self, grant_id: str, *, tenant: str, now: float | None = None) -> GrantState:
        """The open grant ``tenant`` may take; UnknownGrant for any other name (taken, expired, never issued,
        or another tenant's), the same words for each."""
        now = time.monotonic() if now is None else now
        grant = self._grants.get(grant_id) if GRANT_ID.fullmatch(grant_id) else None
        if grant is None or not grant.may_take(tenant) or now >= grant.expires:
            raise UnknownGrant(  # the name never echoed: it is a secret
                "the grant named does not exist for your tenant: taken already (a grant is taken once), past its"
                " ttl, never issued, or issued to another tenant"
            )
        return grant

    def expire(self, now: float | None = None) -> int:
        """End every open grant past its ttl, and every leaving one past its push's deadline (a push that never
        came back); how many."""
        now = time.monotonic() if now is None else now
        ended = [g for g in (*self._grants.values(), *self._leaving.values()) if now >= g.expires]
        for grant in ended:
            self.release(grant)
        return len(ended)

    def next_expiry(self) -> float | None:
        """When the earliest open or leaving grant ends (time.monotonic), None for none."""
        return min((g.expires for g in (*self._grants.values(), *self._leaving.values())), default=None)

    def by_tenant(self) -> dict[str, int]:
        """Grants per tenant, open, arriving or leaving (tenants with none left out)."""
        return dict(self._count)


def live_spans(
    layer_planes: Sequence[int], chunk_sizes: Sequence[int], num_tokens: int, num_blocks: int, block_size: int
) -> dict[int, tuple[int, int]]:
    """Per plane, the blocks [first, end) a grant of ``num_blocks`` blocks holding ``num_tokens`` tokens sends to
    another server: for each layer using it (``layer_planes``: its plane, a KV-sharing layer's being its
    source's), the blocks a query at position num_tokens - 1 or later reads (a chunked layer's from that
    position's chunk on, a global layer's all), up to the last block holding a token. Planes with none left out.
    Arithmetic: the work is per layer, whatever the counts."""
    end = min(num_blocks, -(-num_tokens // block_size))
    spans: dict[int, int] = {}
    for plane, chunk in zip(layer_planes, chunk_sizes, strict=True):
        first = (max(num_tokens, 1) - 1) // chunk * chunk // block_size if chunk else 0
        spans[plane] = min(first, spans.get(plane, first))
    return {p: (first, end) for p, first in sorted(spans.items()) if first < end}


def whole_spans(num_planes: int, num_blocks: int) -> dict[int, tuple[int, int]]:
    """Every plane's every block (a grant sent whole)."""
    return {p: (0, num_blocks) for p in range(num_planes)}


def span_records(spans: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """The (plane, block) records of ``spans``, in order."""
    return [(p, b) for p, (first, end) in spans.items() for b in range(first, end)]


def span_count(spans: dict[int, tuple[int, int]]) -> int:
    return sum(end - first for first, end in spans.values())
