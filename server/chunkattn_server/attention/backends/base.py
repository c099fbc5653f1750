"""What an attention backend receives for one call, and the interface every backend implements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from chunkattn_server.attention import plan
from chunkattn_server.attention.plan import Piece

# A sequence's logical -> physical blocks: a mapping (sparse: the sequence API frees blocks before the current
# chunk) or an int64 array (dense: a block row's table, through its space).
Table = Mapping[int, int] | np.ndarray


@dataclass(frozen=True)
class AttentionBatch:
    """One call's attention work, on the engine's device.

    q: [T, num_heads, head_size] the call's queries, packed in entry order, in the compute dtype.
    k, v: [T, num_kv_heads, head_size] the call's new keys/values in the compute dtype, as the cache gives
        them back (for a float8 cache: stored then read, so that they equal what later calls will read; for a
        KV-sharing layer: read back from its source's cache). A sequence's keys from its first new position
        on are these rows; earlier keys of the current chunk are in the paged cache.
    k_pages, v_pages: [num_kv_heads, num_blocks, block_size, head_size] the layer's paged cache, in the cache
        dtype: the compute dtype, or a float8 dtype whose values are read as ``stored * k_scale`` (K) and
        ``stored * v_scale`` (V) (see torchtypes.load).
    spans: per entry (first row, position of the first new token, number of new tokens).
    tables: per entry, its logical blocks' physical blocks: a mapping {logical: physical} (the sequence API:
        blocks before the current chunk may be gone) or an int64 array indexed by logical block (the block API's
        rows, every block present); ``physical`` reads a range of either without per-block Python for arrays.
    chunk_size: C (0: a global layer). block_size: tokens per block.
    scale: softmax scale.
    alibi_slopes: [num_heads] float32, or None.
    k_scale, v_scale: the float8 cache's scales (1.0 for any other cache dtype).
    unwritten: the single-token spans (indices) whose key was not written to the pages (the block API's
        padding tokens): they read it from k and v. Every other single-token span's key is in the pages too
        (written at its slot before the compute), so it may read it there; longer spans always read their new
        keys from k and v. Decided per span: one call's padding never changes how another's rows are computed.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    spans: Sequence[tuple[int, int, int]]
    tables: Sequence[Table]
    chunk_size: int
    block_size: int
    scale: float
    alibi_slopes: torch.Tensor | None
    k_scale: float = 1.0
    v_scale: float = 1.0
    unwritten: frozenset[int] = frozenset()

    @cached_property
    def pieces(self) -> list[Piece]:
        """The chunk split on the host (see attention.plan), for backends that work piece by piece."""
        tables = self.tables
        return plan.split(
            [(pos, n) for _, pos, n in self.spans],
            self.chunk_size,
            self.block_size,
            lambda i, first, last: tuple(physical(tables[i], first, last).tolist()),
            self.unwritten,
        )


def physical(table: Table, first: int, last: int) -> np.ndarray:
    """The physical blocks [last - first] int64 of logical blocks first .. last - 1 of ``table`` (a slice of an
    array table; a mapping looked up block by block: KeyError for one it lacks)."""
    if isinstance(table, np.ndarray):
        return table[first:last]
    return np.fromiter((table[b] for b in range(first, last)), dtype=np.int64, count=max(0, last - first))


class Backend(Protocol):
    """Writes K/V into the paged cache and computes chunked-local attention for a batch."""

    name: str

    def write(
        self, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k/v [n, Hkv, D] (the pages' dtype: already quantized for a float8 cache) at cache slots [n]
        int64 (block * block_size + offset)."""

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        """Write the output [T, num_heads, head_size] (the compute dtype) into ``out``."""


class FusedDecodes(Protocol):
    """A backend that serves a step of decodes only (every span one token) in one call, its K/V store included
    (native/backend.py); the engine sends it such steps when ``fused`` is true."""

    fused: bool

    def store_and_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        slots: np.ndarray | None,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        spans: Sequence[tuple[int, int, int]],
        tables: Sequence[Table],
        unwritten: Sequence[int],
        chunk_size: int,
        scale: float,
        alibi_slopes: torch.Tensor | None,
        scales: tuple[float, float],
        out: torch.Tensor,
    ) -> None:
        """Store k, v [T, Hkv, D] (the compute dtype; None: nothing to store) at ``slots`` [T] int64 (-1: not
        written; in the cache's dtype over ``scales``, as KVCache.write stores them), then write every span's
        attention ([T, H, D], the compute dtype) into ``out``; ``unwritten``, ``spans``, ``tables`` as in
        AttentionBatch, the cache read over ``scales``."""
