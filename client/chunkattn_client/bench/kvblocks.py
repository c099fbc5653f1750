"""A serving engine's KV cache manager over a block space, as vLLM's v1 KV cache manager keeps it: its KV cache
groups, block tables per request and group, allocation before each step and freeing, and each layer's attention
rows (the metadata its attention backend gets, chunked layers as vLLM's virtual batches). numpy only.

- Groups (vLLM's hybrid KV cache manager, ``_get_kv_cache_groups_uniform_page_size``): layers bucketed by kind
  (chunk size; a global layer is 0), each bucket cut into groups of the same size (the smallest bucket's, or the
  largest's when that is under 1.5x it), a bucket's i-th group taking every n-th of its layers. One kind of layer:
  one group. A KV-sharing layer is in no group; it reads its source's. Groups share one free list and each keeps
  its own table per request; the i-th layer of every group shares one KV tensor (a plane of the space).
- Block 0 is vLLM's null block: never handed out; a chunked group's table holds it where the blocks before the
  current chunk were freed (vLLM's ``remove_skipped_blocks``, done as a request is scheduled).
- Rows: a global layer gets one row per scheduled request (its new tokens, its keys from position 0, its whole
  table); a chunked layer of chunk size C gets vLLM's virtual batches (``make_local_attention_virtual_batches``):
  each request's new tokens cut at multiples of C, each piece a row whose keys count from its chunk's start and
  whose table starts at that chunk's first block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

NULL_BLOCK = 0


@dataclass(frozen=True)
class Group:
    """A KV cache group: its layers' chunk size (0: global) and its layers."""

    chunk_size: int
    layers: tuple[int, ...]


def kv_groups(chunk_sizes: Sequence[int], kv_sources: Sequence[int | None]) -> list[Group]:
    """vLLM's KV cache groups of a model whose layers have ``chunk_sizes`` and ``kv_sources`` (module doc)."""
    buckets: dict[int, list[int]] = {}
    for layer, (chunk, source) in enumerate(zip(chunk_sizes, kv_sources, strict=True)):
        if source is None:
            buckets.setdefault(chunk, []).append(layer)
    if len(buckets) <= 1:
        return [Group(chunk, tuple(layers)) for chunk, layers in buckets.items()]
    sizes = [len(layers) for layers in buckets.values()]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups: list[Group] = []
    for chunk, layers in buckets.items():
        n = -(-len(layers) // size)
        groups.extend(Group(chunk, tuple(layers[i::n])) for i in range(n))
    return groups


@dataclass(frozen=True)
class LayerRows:
    """One KV cache group's attention metadata for a step (vLLM's CommonAttentionMetadata, after its virtual
    batches): ``slots`` [T] int64 each new token's slot; ``starts`` [R + 1] int64 query_start_loc; ``seq_lens``
    [R] int64 each row's keys; ``tables`` [R, W] int64 each row's blocks (W: the widest row's; padded with the
    null block)."""

    slots: np.ndarray
    starts: np.ndarray
    seq_lens: np.ndarray
    tables: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])


class KVBlocks:
    """The block tables of one engine's requests over a space of ``num_blocks`` blocks of ``block_size``
    tokens, for the groups of ``chunk_sizes`` / ``kv_sources`` (one entry per model layer)."""

    def __init__(
        self, chunk_sizes: Sequence[int], kv_sources: Sequence[int | None], num_blocks: int, block_size: int
    ) -> None:
        self.groups = kv_groups(chunk_sizes, kv_sources)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._tables: dict[Hashable, list[list[int]]] = {}
        of = {layer: g for g, group in enumerate(self.groups) for layer in group.layers}
        # A KV-sharing layer reads its source's blocks (and plane).
        self.group_of = [of[layer if source is None else source] for layer, source in enumerate(kv_sources)]
        index = {layer: i for group in self.groups for i, layer in enumerate(group.layers)}
        self.planes = [index.get(layer, 0) if source is None else 0 for layer, source in enumerate(kv_sources)]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int, in_flight_tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens may hold, over every group, when at most ``in_flight_tokens`` are
        scheduled and not yet processed (vLLM's ``max_in_flight_tokens``: its token budget times the steps in
        flight): a chunked group holds at most ceil((C + in_flight_tokens) / block_size), the cap vLLM's
        ``ChunkedLocalAttentionSpec.max_admission_blocks_per_request`` sets."""
        per = -(-tokens // self.block_size)
        return sum(
            per if not g.chunk_size else min(per, -(-(g.chunk_size + in_flight_tokens) // self.block_size))
            for g in self.groups
        )

    def admits(self, tokens: int, in_flight_tokens: int) -> bool:
        """Whether a waiting request of ``tokens`` tokens (holding none) may be admitted: vLLM admits one only when
        its whole sequence's blocks (``blocks_for``) are free (its scheduler_reserve_full_isl, on by default)."""
        return self.blocks_for(tokens, in_flight_tokens) <= len(self._free)

    def allocate(self, request: Hashable, computed: int, new: int, processed: int | None = None) -> bool:
        """Blocks for a request's tokens [0, computed + new) in every group, the blocks of a chunked group before
        the chunk of its ``processed`` tokens (default: all ``computed``; fewer while a step is in flight) freed
        first, whether or not the rest fit (vLLM's allocate_slots); False, no block taken, when the space has too
        few."""
        tables = self._tables.setdefault(request, [[] for _ in self.groups])
        done = computed if processed is None else processed
        for group, table in zip(self.groups, tables, strict=True):
            if group.chunk_size:
                skipped = done // group.chunk_size * group.chunk_size // self.block_size
                for i in range(min(skipped, len(table))):
                    if table[i] != NULL_BLOCK:
                        self._free.append(table[i])
                        table[i] = NULL_BLOCK
        need = -(-(computed + new) // self.block_size)
        wanted = sum(max(0, need - len(table)) for table in tables)
        if wanted > len(self._free):
            return False
        for table in tables:
            table.extend(self._free.popleft() for _ in range(need - len(table)))
        return True

    def free(self, request: Hashable) -> None:
        """A finished or preempted request's blocks back to the free list (vLLM frees a request's blocks in reverse
        order, so that its tail is reused last)."""
        for table in self._tables.pop(request, []):
            self._free.extend(b for b in reversed(table) if b != NULL_BLOCK)

    def rows(self, group: int, scheduled: Sequence[tuple[Hashable, int, int]]) -> LayerRows:
        """The attention rows of group ``group`` for a step of ``scheduled`` (request, position of its first new
        token, new tokens), in that order (module doc)."""
        bs, chunk = self.block_size, self.groups[group].chunk_size
        slots: list[np.ndarray] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for request, position, n in scheduled:
            table = self._tables[request][group]
            pos = np.arange(position, position + n)
            slots.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            if not chunk:
                q_lens.append(n)
                seq_lens.append(position + n)
                tables.append(table)
                continue
            start, end = position, position + n
            while start < end:
                chunk_start = start // chunk * chunk
                stop = min(end, chunk_start + chunk)
                q_lens.append(stop - start)
                seq_lens.append(stop - chunk_start)
                tables.append(table[chunk_start // bs : chunk_start // bs + chunk // bs])
                start = stop
        width = -(-max(seq_lens, default=0) // bs)
        padded = np.full((len(tables), width), NULL_BLOCK, dtype=np.int64)
        for r, table in enumerate(tables):
            row = table[:width]
            padded[r, : len(row)] = row
        return LayerRows(
            np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64),
            np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int64),
            np.asarray(seq_lens, dtype=np.int64),
            padded,
        )
