"""Block spaces: KV addressed by a serving engine's own block ids (the block API). Plain Python and numpy.

A serving engine such as vLLM runs its own KV cache manager: it decides which of its blocks holds which
token (chunked prefill, prefix caching, preemption), and its attention backend sees block tables and slots,
never sequence ids. A *block space* gives it blocks of this server to address that way: space block ids
0 .. num_blocks - 1, each backed by pool blocks taken when the space opens (charged to its tenant, bounded by
the pool and the tenant's quota) and zeroed then, so that no space ever reads a previous owner's K/V.

One space block holds the K/V of ``num_planes`` layers (vLLM's KV cache tensors: layers whose blocks never
hold the same tokens at once share one, as vLLM's hybrid allocator lays them out; by default one plane per
writing layer). A pool block holds ``planes_per_block`` layers (the engine's KV group size, G), so a space
block is ``ceil(num_planes / G)`` pool blocks: plane p of space block b is plane ``p % G`` of pool block
``blocks[b, p // G]``. A KV-sharing layer has no plane of its own: it reads its source's.

Spaces belong to a tenant and are named by (tenant, space_id), ids this server issues (128 random bits): a
space id of another tenant is as unknown as one never issued.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from chunkattn_server.config import ModelShape
from chunkattn_server.errors import InvalidArgument, OutOfBlocks, UnknownSpace
from chunkattn_server.kv.block_pool import BlockPool

MAX_SPACES_PER_TENANT = 64  # open spaces one tenant may hold (a serving engine needs one per instance)
SPACE_ID_CHARS = 32  # hex digits of a space id


@dataclass
class BlockSpace:
    """One open space: its pool blocks [num_blocks, pool blocks per space block] int64, and per layer of the
    model the plane its K/V is in (a KV-sharing layer's: its source's)."""

    space_id: str
    tenant: str
    blocks: np.ndarray
    layer_planes: tuple[int, ...]
    num_planes: int
    last_used: float = field(default_factory=time.monotonic)

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    def pool_blocks(self) -> list[int]:
        return [int(b) for b in self.blocks.reshape(-1)]


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
        self._spaces: dict[tuple[str, str], BlockSpace] = {}
        self._count: dict[str, int] = {}  # tenant -> spaces open

    def __len__(self) -> int:
        return len(self._spaces)

    def open(self, num_blocks: int, planes: Sequence[int], *, tenant: str) -> BlockSpace:
        """A new space of ``num_blocks`` blocks (see ``layer_planes`` for ``planes``), its pool blocks taken
        (zeroing them is the cache's: the caller's next step). InvalidArgument for a size out of range,
        OutOfBlocks (QuotaExceeded) when the pool (the tenant's quota, or its MAX_SPACES_PER_TENANT) cannot
        hold it; nothing is taken then."""
        resolved, count = layer_planes(self.model, planes)
        per_block = math.ceil(count / self.planes_per_block)
        if not 1 <= num_blocks <= self.pool.num_blocks:
            raise InvalidArgument(
                f"num_blocks is {num_blocks}; a space has 1 .. {self.pool.num_blocks} blocks (the pool's size)"
            )
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
        taken = self.pool.allocate(needed, account=tenant)
        space_id = secrets.token_hex(SPACE_ID_CHARS // 2)
        blocks = np.array(taken, dtype=np.int64).reshape(num_blocks, per_block)
        space = BlockSpace(space_id, tenant, blocks, resolved, count)
        self._spaces[tenant, space_id] = space
        self._count[tenant] = self._count.get(tenant, 0) + 1
        return space

    def get(self, space_id: str, *, tenant: str) -> BlockSpace:
        """The tenant's space; UnknownSpace when it has none of that id (another tenant's included)."""
        space = self._spaces.get((tenant, space_id))
        if space is None:
            shown = space_id if len(space_id) <= SPACE_ID_CHARS else space_id[:SPACE_ID_CHARS] + "..."
            raise UnknownSpace(f"block space {shown!r} does not exist (closed, evicted idle, or never opened)")
        return space

    def close(self, space_id: str, *, tenant: str) -> int:
        """Close the tenant's space and free its blocks; returns how many pool blocks. UnknownSpace."""
        space = self.get(space_id, tenant=tenant)
        return self._drop(space)

    def _drop(self, space: BlockSpace) -> int:
        del self._spaces[space.tenant, space.space_id]
        self._count[space.tenant] -= 1
        if not self._count[space.tenant]:
            del self._count[space.tenant]
        blocks = space.pool_blocks()
        self.pool.free(blocks)
        return len(blocks)

    def evict_idle(self, max_idle_s: float, now: float | None = None) -> list[tuple[str, str]]:
        """Close every space unused for more than ``max_idle_s`` seconds; returns their (tenant, space_id)."""
        now = time.monotonic() if now is None else now
        idle = [space for space in self._spaces.values() if now - space.last_used > max_idle_s]
        for space in idle:
            self._drop(space)
        return [(space.tenant, space.space_id) for space in idle]

    def by_tenant(self) -> dict[str, int]:
        """Open spaces per tenant (tenants with none left out)."""
        return dict(self._count)
