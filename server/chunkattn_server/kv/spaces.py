"""Block spaces: KV addressed by a serving engine's own block ids (the block API). Plain Python and numpy.

A serving engine such as vLLM runs its own KV cache manager: it decides which of its blocks holds which
token (chunked prefill, prefix caching, preemption), and its attention backend sees block tables and slots,
never sequence ids. A *block space* gives it blocks of this server to address that way: space block ids
0 .. num_blocks - 1, each backed by pool blocks taken when the space opens (charged to its tenant, bounded by
the pool and the tenant's quota).

No space ever reads a previous owner's K/V, yet opening one does not zero it: a space block is *stale* until
the first call that reads or writes it, which zeroes its pool blocks first (``zero_stale``). Opening a space
of the whole pool is then bookkeeping only, and the zeroing is spread over the calls that use the blocks,
bounded by what each reads anyway. Each tenant may open at most the pool's size (at least OPEN_FLOOR) in
pool blocks per ``OPEN_WINDOW_S`` (a token bucket): a client that loops OpenBlockSpace and CloseBlockSpace on
the largest space cannot keep the engine busy with bookkeeping (QuotaExceeded, saying when to retry).

One space block holds the K/V of ``num_planes`` layers (vLLM's KV cache tensors: layers whose blocks never
hold the same tokens at once share one, as vLLM's hybrid allocator lays them out; by default one plane per
writing layer). A pool block holds ``planes_per_block`` layers (the engine's KV group size, G), so a space
block is ``ceil(num_planes / G)`` pool blocks: plane p of space block b is plane ``p % G`` of pool block
``blocks[b, p // G]``. A KV-sharing layer has no plane of its own: it reads its source's.

Spaces belong to a tenant and are named by (tenant, space_id), ids this server issues (128 random bits): a
space id of another tenant is as unknown as one never issued. A space lives until it is closed, or until it
goes unused (no call, no renewal) for its lease: the ``lease_s`` it was opened with, the server's
--idle-timeout-s, whichever is shorter (``lease``); neither: until the server stops. A tenant lists its own
spaces (``of``), so an id its client lost can still be closed.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from chunkattn_client.limits import MAX_BLOCK_SPACES, MAX_LEASE_S, MIN_LEASE_S
from chunkattn_server.config import ModelShape
from chunkattn_server.errors import InvalidArgument, OutOfBlocks, QuotaExceeded, UnknownSpace
from chunkattn_server.kv.block_pool import BlockPool

MAX_SPACES_PER_TENANT = MAX_BLOCK_SPACES  # open spaces one tenant may hold (the client's limits say it too)
SPACE_ID_CHARS = 32  # hex digits of a space id
OPEN_WINDOW_S = 10.0  # a tenant opens at most the pool's size (or OPEN_FLOOR) in pool blocks per this long
OPEN_FLOOR = 1 << 16  # a small pool's allowance: that many blocks cost the engine ~20-40 ms to open and close


def lease(asked_s: float, idle_timeout_s: float) -> float:
    """How long a space may go unused before it is closed: the shorter of the lease it was opened with and the
    server's idle timeout, each 0 for none; 0: never."""
    limits = [x for x in (asked_s, idle_timeout_s) if x > 0]
    return min(limits) if limits else 0.0


def check_lease(lease_s: float) -> None:
    """InvalidArgument unless ``lease_s`` is 0 (none) or MIN_LEASE_S .. MAX_LEASE_S."""
    if lease_s != 0 and not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:  # NaN fails both
        raise InvalidArgument(
            f"lease_s is {lease_s}; expected 0 (no lease of its own: the server's --idle-timeout-s) or"
            f" {MIN_LEASE_S:g} .. {MAX_LEASE_S:g} seconds"
        )


@dataclass
class SpaceState:
    """One open space: its pool blocks [num_blocks, pool blocks per space block] int64, and per layer of the
    model the plane its K/V is in (a KV-sharing layer's: its source's); ``planes_per_block``: the pool's (G).
    ``stale`` [num_blocks] bool: space blocks no call has touched yet (their pool blocks still hold a previous
    owner's bytes). ``lease_s``: the lease it was opened with (0: none; see ``lease``)."""

    space_id: str
    tenant: str
    blocks: np.ndarray
    layer_planes: tuple[int, ...]
    num_planes: int
    planes_per_block: int
    lease_s: float = 0.0
    opened: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    stale: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.stale = np.ones(self.num_blocks, dtype=bool)

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    def pool_blocks(self) -> list[int]:
        return list(self.blocks.reshape(-1).tolist())

    def pages(self, layer: int) -> tuple[int, np.ndarray]:
        """Where ``layer``'s K/V are (the module doc's arithmetic): its plane of the pool's blocks, and each
        space block's pool block for it [num_blocks] int64."""
        p = self.layer_planes[layer]
        return p % self.planes_per_block, self.blocks[:, p // self.planes_per_block]

    def pool_slots(self, layer: int, slots: np.ndarray, block_size: int) -> np.ndarray:
        """``layer``'s pool slots [n] int64 of space slots ``slots`` [n] int64 (checked inside the space); a
        negative one (not written) stays -1."""
        pool = self.pages(layer)[1]
        physical = pool[np.where(slots >= 0, slots, 0) // block_size] * block_size + slots % block_size
        return np.where(slots >= 0, physical, -1)

    def zero_stale(self, ids: np.ndarray, zero: Callable[[list[int]], None]) -> None:
        """Zero (``zero``: the cache's) the pool blocks of those of space blocks ``ids`` (int64, in range) still
        stale, and only then count them as no longer stale: a zeroing that fails leaves them stale."""
        hit = ids[self.stale[ids]]
        if not len(hit):
            return
        hit = np.unique(hit)
        zero(list(self.blocks[hit].reshape(-1).tolist()))
        self.stale[hit] = False


def layer_planes(model: ModelShape, given: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Per layer, its plane in a space, and the number of planes: ``given`` (one per layer; a KV-sharing
    layer's entry is not read) or, empty, one plane per writing layer in layer order. InvalidArgument naming
    the first bad entry."""
    layers = model.layers
    writing = [i for i, spec in enumerate(layers) if spec.kv_source is None]
    if not given:
        planes = {layer: p for p, layer in enumerate(writing)}
        count = len(writing)
    else:
        if len(given) != len(layers):
            raise InvalidArgument(
                f"layer_planes has {len(given)} entries; the model has {len(layers)} layers (one per layer, or"
                " none for one plane per writing layer)"
            )
        for i in writing:
            if not 0 <= given[i] < len(layers):
                raise InvalidArgument(
                    f"layer_planes[{i}] is {given[i]}; a plane is 0 .. {len(layers) - 1} (at most one per layer)"
                )
        planes = {i: given[i] for i in writing}
        count = max(planes.values()) + 1
    resolved = tuple(planes[i if spec.kv_source is None else spec.kv_source] for i, spec in enumerate(layers))
    return resolved, count


class BlockSpaces:
    """The open spaces of one engine. ``check_quota(tenant, blocks, sequences)`` raises QuotaExceeded (the
    KV manager's); ``planes_per_block``: G, the pool's planes per block."""

    def __init__(
        self,
        pool: BlockPool,
        model: ModelShape,
        planes_per_block: int,
        check_quota: Callable[[str, int, int], None],
    ) -> None:
        self.pool = pool
        self.model = model
        self.planes_per_block = planes_per_block
        self._check_quota = check_quota
        self._spaces: dict[tuple[str, str], SpaceState] = {}
        self._count: dict[str, int] = {}  # tenant -> spaces open
        self._opening: dict[str, tuple[float, float]] = {}  # tenant -> (pool blocks it may open now, when)

    def __len__(self) -> int:
        return len(self._spaces)

    def open(
        self, num_blocks: int, planes: Sequence[int], *, tenant: str, lease_s: float = 0.0, now: float | None = None
    ) -> SpaceState:
        """A new space of ``num_blocks`` blocks (see ``layer_planes`` for ``planes``), its pool blocks taken,
        every space block stale (see the module doc). InvalidArgument for a size or lease out of range,
        OutOfBlocks (QuotaExceeded) when the pool (the tenant's quota, its MAX_SPACES_PER_TENANT, or its
        opening rate) cannot hold it; nothing is taken then."""
        now = time.monotonic() if now is None else now
        resolved, count = layer_planes(self.model, planes)
        per_block = math.ceil(count / self.planes_per_block)
        if not 1 <= num_blocks <= self.pool.num_blocks:
            raise InvalidArgument(
                f"num_blocks is {num_blocks}; a space has 1 .. {self.pool.num_blocks} blocks (the pool's size)"
            )
        check_lease(lease_s)
        needed = num_blocks * per_block
        if self._count.get(tenant, 0) >= MAX_SPACES_PER_TENANT:
            raise OutOfBlocks(
                f"your tenant has {MAX_SPACES_PER_TENANT} block spaces open, the most it may; close one first"
            )
        self._check_quota(tenant, needed, 0)
        if not self.pool.can_allocate(needed):
            raise OutOfBlocks(
                f"a space of {num_blocks} blocks of {count} planes needs {needed} pool blocks and the pool has"
                f" {self.pool.num_free} free of {self.pool.num_blocks}: open a smaller space, or start the server"
                " with a larger pool"
            )
        self.charge(tenant, needed, now=now, what="this space")
        taken = self.pool.allocate(needed, account=tenant)
        space_id = secrets.token_hex(SPACE_ID_CHARS // 2)
        blocks = np.array(taken, dtype=np.int64).reshape(num_blocks, per_block)
        space = SpaceState(
            space_id, tenant, blocks, resolved, count, self.planes_per_block, lease_s, opened=now, last_used=now
        )
        self._spaces[tenant, space_id] = space
        self._count[tenant] = self._count.get(tenant, 0) + 1
        return space

    def charge(self, tenant: str, needed: int, *, now: float | None = None, what: str = "this call") -> None:
        """Spend ``needed`` of ``tenant``'s allowance of pool blocks to take, zero or copy (a space opened, a
        grant parked or received, blocks copied), or QuotaExceeded saying when to retry, nothing spent."""
        now = time.monotonic() if now is None else now
        allowance = self._allowance(tenant, now)
        if needed > allowance:
            wait = (needed - allowance) / self.open_allowance * OPEN_WINDOW_S
            raise QuotaExceeded(
                f"your tenant may take, zero or copy {self.open_allowance} pool blocks per {OPEN_WINDOW_S:g} s"
                f" (block spaces opened, grants, copies) and has used that many lately; {what} needs {needed}:"
                f" retry in {wait:.1f} s"
            )
        self._opening[tenant] = (allowance - needed, now)

    @property
    def open_allowance(self) -> int:
        """Pool blocks a tenant may open per OPEN_WINDOW_S: the pool's size, at least OPEN_FLOOR."""
        return max(self.pool.num_blocks, OPEN_FLOOR)

    def _allowance(self, tenant: str, now: float) -> float:
        """Pool blocks ``tenant`` may open now: its bucket, refilled at ``open_allowance`` per OPEN_WINDOW_S up
        to ``open_allowance``."""
        size = float(self.open_allowance)
        left, since = self._opening.get(tenant, (size, now))
        return min(size, left + max(0.0, now - since) * size / OPEN_WINDOW_S)

    def get(self, space_id: str, *, tenant: str) -> SpaceState:
        """The tenant's space; UnknownSpace when it has none of that id (another tenant's included)."""
        space = self._spaces.get((tenant, space_id))
        if space is None:
            shown = space_id if len(space_id) <= SPACE_ID_CHARS else space_id[:SPACE_ID_CHARS] + "..."
            raise UnknownSpace(
                f"block space {shown!r} does not exist (closed, unused past its lease, or never opened);"
                " ListBlockSpaces shows your tenant's open spaces"
            )
        return space

    def renew(self, space_id: str, *, tenant: str, now: float | None = None) -> SpaceState:
        """The tenant's space, used now (its lease starts again). UnknownSpace."""
        space = self.get(space_id, tenant=tenant)
        space.last_used = time.monotonic() if now is None else now
        return space

    def of(self, tenant: str) -> list[SpaceState]:
        """The tenant's open spaces, oldest first."""
        return sorted((s for (t, _), s in self._spaces.items() if t == tenant), key=lambda s: s.opened)

    def close(self, space_id: str, *, tenant: str) -> int:
        """Close the tenant's space and free its blocks; returns how many pool blocks. UnknownSpace."""
        space = self.get(space_id, tenant=tenant)
        return self._drop(space)

    def _drop(self, space: SpaceState) -> int:
        del self._spaces[space.tenant, space.space_id]
        self._count[space.tenant] -= 1
        if not self._count[space.tenant]:
            del self._count[space.tenant]
        blocks = space.pool_blocks()
        self.pool.free(blocks)
        return len(blocks)

    def expire(self, idle_timeout_s: float, now: float | None = None) -> list[tuple[str, str]]:
        """Close every space unused for longer than its lease (``lease``: its own, or ``idle_timeout_s``,
        the shorter; 0 for none); returns their (tenant, space_id)."""
        now = time.monotonic() if now is None else now
        expired = []
        for space in self._spaces.values():
            limit = lease(space.lease_s, idle_timeout_s)
            if limit and now - space.last_used > limit:
                expired.append(space)
        for space in expired:
            self._drop(space)
        return [(space.tenant, space.space_id) for space in expired]

    def next_expiry(self, idle_timeout_s: float) -> float | None:
        """The earliest time (time.monotonic) a space could be closed for going unused, as things stand (a
        call or a renewal only puts it later); None when no space has a lease."""
        due = [s.last_used + limit for s in self._spaces.values() if (limit := lease(s.lease_s, idle_timeout_s))]
        return min(due, default=None)

    def by_tenant(self) -> dict[str, int]:
        """Open spaces per tenant (tenants with none left out)."""
        return dict(self._count)
