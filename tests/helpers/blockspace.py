"""A serving engine's side of the block API, written from vLLM's behaviour and not from the server's code.

``KVCacheManager`` plays vLLM's KV cache manager and attention metadata builder: it hands out a space's
block ids to sequences on demand from a shuffled free list (so that tables are not runs of consecutive
ids), and for one step of one layer builds the ``BlockCall`` vLLM's attention backend would send:

* a global layer (C == 0): one row per entry, q_len = n, seq_len = p + n, the sequence's whole table;
* a chunked layer (C > 0): vLLM's "virtual batches": each entry is split at chunk boundaries and each piece
  is a row whose seq_len counts keys from its chunk's start and whose table starts at that chunk's first
  block (``chunk_start // block_size``);
* slot_mapping: each new token's slot, ``table[pos // bs] * bs + pos % bs``, by absolute position.

Tables are padded to a common width (``pad``: -1 or 0; entries past a row's blocks are never read).

Block tables belong to *groups*. vLLM's usual layout is one group shared by every layer (``group_chunks=
(0,)``): every sequence keeps all its blocks. Its hybrid layout gives each kind of layer a group of its own
(``group_chunks=(8, 16, 0)``, say): the groups' block ids are disjoint (one free list), and a chunked
group frees the blocks before the current chunk when a step is scheduled, so that another group may reuse
them at once. ``used_by`` records which groups ever held each block id.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from chunkattn_server.engine.types import BlockCall

FREED = -1  # a table entry whose block went back to the free list (vLLM's null block)


@dataclass(frozen=True)
class Row:
    """One row of a call: its sequence, its tokens [start, end) and the position its keys count from."""

    seq_id: str
    key_start: int
    start: int
    end: int


def rows_for(entries: Iterable[tuple[str, int, int]], chunk_size: int) -> list[Row]:
    """The rows of a step for a layer of chunk size C: one per entry (C == 0) or one per chunk piece."""
    rows: list[Row] = []
    for seq_id, position, num_tokens in entries:
        end = position + num_tokens
        if not chunk_size:
            rows.append(Row(seq_id, 0, position, end))
            continue
        start = position
        while start < end:
            chunk_start = start // chunk_size * chunk_size
            stop = min(end, chunk_start + chunk_size)
            rows.append(Row(seq_id, chunk_start, start, stop))
            start = stop
    return rows


@dataclass
class KVCacheManager:
    """Space block ids handed to sequences, per group; see the module docstring."""

    num_blocks: int
    block_size: int
    group_chunks: Sequence[int] = (0,)
    seed: int = 0
    free: list[int] = field(init=False)
    tables: dict[tuple[int, str], list[int]] = field(init=False, default_factory=dict)
    used_by: dict[int, set[int]] = field(init=False, default_factory=dict)  # block id -> groups that held it

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)
        for c in self.group_chunks:
            assert c % self.block_size == 0, "vLLM requires the chunk size to be a multiple of the block size"

    def schedule(self, entries: Iterable[tuple[str, int, int]]) -> None:
        """Before a step: per group, free blocks before each entry's chunk (chunked groups), then allocate
        blocks to cover its new tokens."""
        bs = self.block_size
        for group, chunk in enumerate(self.group_chunks):
            for seq_id, position, num_tokens in entries:
                table = self.tables.setdefault((group, seq_id), [])
                if chunk:
                    first_kept = position // chunk * chunk // bs
                    for i in range(min(first_kept, len(table))):
                        if table[i] != FREED:
                            self.free.append(table[i])
                            table[i] = FREED
                while len(table) * bs < position + num_tokens:
                    assert self.free, "the space is full: the test's space is too small"
                    block = self.free.pop(0)
                    self.used_by.setdefault(block, set()).add(group)
                    table.append(block)

    def release(self, seq_id: str) -> None:
        for group in range(len(self.group_chunks)):
            table = self.tables.pop((group, seq_id), [])
            self.free.extend(b for b in table if b != FREED)

    def slot(self, seq_id: str, position: int, group: int = 0) -> int:
        block = self.tables[group, seq_id][position // self.block_size]
        assert block != FREED, f"position {position} of {seq_id!r} is out of its chunk"
        return block * self.block_size + position % self.block_size

    def call(
        self,
        space_id: str,
        tenant: str,
        entries: Sequence[tuple[str, int, int]],
        chunk_size: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        *,
        group: int = 0,
        pad: int = -1,
        extra_width: int = 0,
    ) -> BlockCall:
        """The call of one layer for a scheduled step (tokens packed in entry order, as q/k/v are)."""
        bs = self.block_size
        rows = rows_for(entries, chunk_size)
        starts = [0]
        seq_lens: list[int] = []
        narrowed: list[list[int]] = []
        for r in rows:
            starts.append(starts[-1] + r.end - r.start)
            seq_lens.append(r.end - r.key_start)
            first = r.key_start // bs
            narrowed.append(self.tables[group, r.seq_id][first : first + -(-seq_lens[-1] // bs)])
        width = max(len(t) for t in narrowed) + extra_width
        tables = np.full((len(rows), width), pad, dtype=np.int64)
        for i, t in enumerate(narrowed):
            tables[i, : len(t)] = t
        slots = [self.slot(s, p, group) for s, position, n in entries for p in range(position, position + n)]
        return BlockCall(
            space_id=space_id,
            q=q,
            k=k,
            v=v,
            slots=np.array(slots, dtype=np.int64),
            starts=np.array(starts, dtype=np.int64),
            seq_lens=np.array(seq_lens, dtype=np.int64),
            tables=tables,
            tenant=tenant,
        )
