"""Batch metadata: each sequence's new tokens cut at chunk boundaries into pieces (vLLM's virtual batches).

A piece is one sequence's run of queries inside one chunk; it is plain causal attention over that chunk's
keys, bottom-right aligned: keys of the chunk before the piece's first query are its context. Built once
per call on the host, from positions alone; no torch here.

Worked example (C = 4, see docs/architecture.md): a sequence with 5 tokens that gets 6 new ones
(positions 5..10) gives pieces (queries 3, keys 4, first key 4) and (3, 3, 8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """One sequence's queries inside one chunk.

    row: first row of the piece in the call's packed q / k / v / output.
    num_queries: queries (rows) in the piece.
    position: absolute position of the first query; the rest follow one by one.
    key_start: absolute position of the chunk's first key (0 for a global layer).
    cache_end: keys [key_start, cache_end) are read from the paged cache; keys
        [cache_end, position + num_queries) are the call's own k/v rows, from row + cache_end - position.
    blocks: physical block ids holding positions [key_start, cache_end), one per block_size positions.
    """

    entry: int
    row: int
    num_queries: int
    position: int
    key_start: int
    cache_end: int
    blocks: tuple[int, ...]

    @property
    def num_keys(self) -> int:
        return self.position + self.num_queries - self.key_start


def split(
    spans: Sequence[tuple[int, int]],
    chunk_size: int,
    block_size: int,
    blocks_of: Callable[[int, int, int], tuple[int, ...]],
    unwritten: AbstractSet[int] = frozenset(),
) -> list[Piece]:
    """Cut each (position, num_tokens) span at chunk boundaries.

    A single-token span (a decode) reads all its keys, its own included, from the cache (unless it is in
    ``unwritten``: its key was not written there); longer spans read the context before their first query
    from the cache and their new keys from the call's rows.
    ``blocks_of(entry, first, last)`` returns the physical blocks of that sequence's logical blocks
    first..last-1.
    """
    pieces: list[Piece] = []
    row = 0
    for entry, (position, num_tokens) in enumerate(spans):
        end = position + num_tokens
        pos = position
        while pos < end:
            key_start = pos - pos % chunk_size if chunk_size else 0
            stop = min(end, key_start + chunk_size) if chunk_size else end
            # A later piece starts at a chunk boundary (no context); a decode reads its own key too.
            cached = pos == position and num_tokens == 1 and entry not in unwritten
            cache_end = pos + 1 if cached else pos
            blocks = blocks_of(entry, key_start // block_size, -(-cache_end // block_size))
            pieces.append(Piece(entry, row + pos - position, stop - pos, pos, key_start, cache_end, blocks))
            pos = stop
        row += num_tokens
    return pieces
