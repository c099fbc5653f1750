"""The KV block allocator: which of the pool's block ids are free. Plain Python, no torch.

Callers ask before they act (``can_allocate`` then ``allocate``), so a request that cannot be served is
refused before anything changes. Allocation prefers ids that continue a run (``after``) and otherwise
the lowest free id, so a sequence's blocks tend to be contiguous and attention can read them as one
strided view instead of gathering them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from chunkattn_server.errors import OutOfBlocks


class BlockPool:
    """Free/used bookkeeping for block ids 0..num_blocks-1. Every id is either free or used, never both."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: set[int] = set(range(num_blocks))
        # Min-heap of candidate free ids; may hold stale ids (taken through ``after``), skipped on pop.
        self._heap: list[int] = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take n free ids: after+1, after+2, ... while those are free, then the lowest free ids.

        Raises OutOfBlocks (and takes nothing) when fewer than n are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(
                f"the KV pool has {len(self._free)} free blocks of {self.num_blocks}; {n} are needed."
                " Release finished sequences, retry later, or start the server with a larger pool"
            )
        taken: list[int] = []
        if after is not None:
            nxt = after + 1
            while len(taken) < n and nxt in self._free:
                self._free.remove(nxt)
                taken.append(nxt)
                nxt += 1
        while len(taken) < n:
            block = heapq.heappop(self._heap)
            if block in self._free:
                self._free.remove(block)
                taken.append(block)
        return taken

    def free(self, blocks: Iterable[int]) -> None:
        """Return used ids to the pool. A free, duplicate or unknown id is a bug: ValueError, nothing changed."""
        blocks = list(blocks)
        bad = [b for b in blocks if not 0 <= b < self.num_blocks or b in self._free]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"freeing blocks that are not in use (or twice): {sorted(bad) or blocks}")
        for b in blocks:
            self._free.add(b)
            heapq.heappush(self._heap, b)
        if len(self._heap) > 2 * self.num_blocks:
            # Drop stale entries so the heap stays O(num_blocks).
            self._heap = sorted(self._free)
