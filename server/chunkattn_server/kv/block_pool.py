"""The KV block allocator: which of the pool's block ids are free. Plain Python, no torch.

Callers ask before they act (``can_allocate`` then ``allocate``), so a request that cannot be served is
refused before anything changes.

A used block may have several owners (forked sequences share blocks copy-on-write): ``share`` adds an
owner, ``free`` drops one, and the block returns to the pool with its last owner. A shared block counts
once in ``num_used``. Each used block is charged to the *account* that allocated it (a tenant: forks
never cross tenants, so a block's owners all share its account); ``used_by`` says how many each holds.

Placement keeps each sequence's blocks contiguous where it can, because attention reads a run of
consecutive blocks as one strided view and must gather scattered ones (a copy):
- a sequence that grows continues its run (``after``) while the next ids are free;
- a new run starts in the middle of the largest free extent, so that runs started one after another
  (sequences prefilled in turn) leave each other room to grow in place during decode. Packing runs
  end to end instead would give every decode step's new block to a different place.

The largest extent comes from a heap kept beside the extents (entries of extents since merged or taken are
skipped when they surface), so a pool fragmented into tens of thousands of free runs costs an allocation
O(log runs) per run it takes, not a scan of them all: a whole-pool block space over a fragmented pool took
seconds of the engine's time when every run it took scanned every run left.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterable

from chunkattn_server.errors import OutOfBlocks


class BlockPool:
    """Free/used bookkeeping for block ids 0..num_blocks-1. Every id is either free or used (by one or more
    owners), never both."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: set[int] = set(range(num_blocks))
        # Free extents [start, start + length), kept merged: start -> length, and end -> start.
        self._extent: dict[int, int] = {0: num_blocks}
        self._extent_at_end: dict[int, int] = {num_blocks: 0}
        self._largest: list[tuple[int, int]] = [(-num_blocks, 0)]  # heap of (-length, start), stale ones too
        self._extra_owners: dict[int, int] = {}  # used blocks with more than one owner: owners - 1
        self._account: dict[int, str] = {}  # used block -> the account it is charged to
        self._used_by: dict[str, int] = {}  # account -> blocks charged to it

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def used_by(self, account: str) -> int:
        """Used blocks charged to ``account``."""
        return self._used_by.get(account, 0)

    def usage(self) -> dict[str, int]:
        """Used blocks per account (accounts holding none left out)."""
        return {a: n for a, n in self._used_by.items() if n}

    def owners(self, block: int) -> int:
        """How many owners a block has (0: free)."""
        return 0 if block in self._free else 1 + self._extra_owners.get(block, 0)

    def share(self, blocks: Iterable[int]) -> None:
        """Add an owner to each used block. A free or unknown id is a bug: ValueError, nothing changed."""
        blocks = list(blocks)
        bad = [b for b in blocks if not 0 <= b < self.num_blocks or b in self._free]
        if bad:
            raise ValueError(f"sharing blocks that are not in use: {sorted(bad)}")
        for b in blocks:
            self._extra_owners[b] = self._extra_owners.get(b, 0) + 1

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int, after: int | None = None, *, account: str) -> list[int]:
        """Take n free ids, charged to ``account``: after+1, after+2, ... while those are free, then new runs
        (see the module doc).

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
        if after is not None and after + 1 in self._extent:  # after is used, so a free after+1 starts an extent
            taken += self._take(after + 1, after + 1, n)
        while len(taken) < n:
            start, length = self._largest_extent()
            want = min(n - len(taken), length)
            taken += self._take(start, start + (length - want) // 2, want)
        self._account.update(dict.fromkeys(taken, account))
        self._used_by[account] = self._used_by.get(account, 0) + len(taken)
        return taken

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one owner of each id; an id whose last owner goes returns to the pool. A free, duplicate or
        unknown id is a bug: ValueError, nothing changed. Set operations and one pass per run of consecutive
        ids, not per-id Python work where it can be helped: a block space returns the whole pool at once."""
        blocks = list(blocks)
        unique = set(blocks)
        if (
            len(unique) != len(blocks)
            or not unique.isdisjoint(self._free)
            or (unique and (min(unique) < 0 or max(unique) >= self.num_blocks))
        ):
            bad = sorted(b for b in unique if not 0 <= b < self.num_blocks or b in self._free)
            raise ValueError(f"freeing blocks that are not in use (or twice): {bad or blocks}")
        returning = unique
        shared = unique.intersection(self._extra_owners) if self._extra_owners else ()
        if shared:
            for b in shared:
                extra = self._extra_owners.pop(b)
                if extra > 1:
                    self._extra_owners[b] = extra - 1
            returning = unique.difference(shared)
        self._free |= returning
        for account, n in collections.Counter(map(self._account.pop, returning)).items():
            self._used_by[account] -= n
        for start, end in _runs(sorted(returning)):
            if start in self._extent_at_end:  # merge with the extent that ends where this run starts
                start = self._extent_at_end.pop(start)
                del self._extent[start]
            if end in self._extent:  # merge with the extent that starts where this run ends
                end += self._extent.pop(end)
                del self._extent_at_end[end]
            self._add_extent(start, end)

    def _add_extent(self, start: int, end: int) -> None:
        """Record the free extent [start, end) (in both maps and the heap)."""
        self._extent[start] = end - start
        self._extent_at_end[end] = start
        heapq.heappush(self._largest, (start - end, start))
        if len(self._largest) > 4 * len(self._extent) + 64:  # mostly stale: rebuild
            self._largest = [(-n, s) for s, n in self._extent.items()]
            heapq.heapify(self._largest)

    def _largest_extent(self) -> tuple[int, int]:
        """(start, length) of the largest free extent, the lowest on a tie (with a free block)."""
        while True:
            negative, start = self._largest[0]
            if self._extent.get(start) == -negative:
                return start, -negative
            heapq.heappop(self._largest)  # merged or taken since it was pushed

    def _take(self, start: int, first: int, n: int) -> list[int]:
        """Take up to n ids from ``first`` on, inside the free extent that starts at ``start``."""
        end = start + self._extent.pop(start)
        del self._extent_at_end[end]
        stop = min(end, first + n)
        if start < first:
            self._add_extent(start, first)
        if stop < end:
            self._add_extent(stop, end)
        ids = list(range(first, stop))
        self._free.difference_update(ids)
        return ids


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of consecutive ids in a sorted list of distinct ids. Each run's end is found by
    galloping (ids[j] - ids[i] == j - i holds exactly inside a run), so a few long runs cost a few steps each,
    and a list of isolated ids one step per id."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        first, step, good = ids[i], 1, i  # ids[good] is in the run
        while good + step < n and ids[good + step] - first == good + step - i:
            good += step
            step *= 2
        while step > 1:  # the run ends before good + step: narrow it down
            step //= 2
            if good + step < n and ids[good + step] - first == good + step - i:
                good += step
        runs.append((first, ids[good] + 1))
        i = good + 1
    return runs
