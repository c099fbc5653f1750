"""How much work a call asks of the server, as Info's max_call_work bounds it: the query-key pairs its queries
score (per query head), plus PIECE_WORK for each piece of attention the engine computes apart. Written once,
for the server that enforces the bound and the clients that cut their calls to fit it.

A *piece* is one sequence's queries inside one chunk (attention/plan.py), or one block row, of 2 or more new
tokens: the engine computes each apart (a gather of its keys, kernel launches, a merge), a cost that does not
shrink with its keys. A one-token decode is not one: the whole step's decodes go in one call of the native
kernel (or one kernel launch on a GPU). So a call's work is

- sequence API: per entry, the keys each new token sees, plus PIECE_WORK per chunk its new tokens fall in when it
  brings 2 or more;
- block API: per row, the keys each of its new tokens sees, plus PIECE_WORK when it brings 2 or more.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# What a piece computed apart costs, in query-key pairs: ~0.5 ms on the dev machines' CPU, about what 8,192 pairs
# cost on the fast paths (docs/results.md, "Neighbours").
PIECE_WORK = 1 << 13


def scores(position: int, num_tokens: int, chunk_size: int) -> int:
    """The query-key pairs (scores per query head) of ``num_tokens`` new tokens from ``position`` on: the query
    at position i sees i - chunk_start(i) + 1 keys (i + 1 on a global layer). Closed form, O(1).

    Worked example, C = 4: positions 5..10 see 2, 3, 4 keys (chunk 4..7), then 1, 2, 3 (chunk 8..11): 15.
    """
    end = position + num_tokens
    if num_tokens <= 0:
        return 0
    if not chunk_size:
        return (position + 1 + end) * num_tokens // 2  # 1 + position .. end keys
    total = 0
    first = position
    while first < end:  # at most three parts: the first chunk's tail, whole chunks, the last chunk's head
        start = first - first % chunk_size
        if first == start and end - first >= chunk_size:  # whole chunks, all at once
            whole = (end - first) // chunk_size
            total += whole * chunk_size * (chunk_size + 1) // 2
            first += whole * chunk_size
            continue
        stop = min(end, start + chunk_size)
        total += (stop - first) * (first - start + 1 + stop - start) // 2
        first = stop
    return total


def entry_work(position: int, num_tokens: int, chunk_size: int) -> int:
    """A sequence entry's work: its pairs, plus PIECE_WORK per chunk its tokens fall in when it brings 2 or more
    (worked example, C = 4: positions 5..10 are 15 pairs in 2 pieces, 15 + 2 * 8192)."""
    if num_tokens < 2:
        return scores(position, num_tokens, chunk_size)
    pieces = (position + num_tokens - 1) // chunk_size - position // chunk_size + 1 if chunk_size else 1
    return scores(position, num_tokens, chunk_size) + PIECE_WORK * pieces


def keys_seen(starts: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Per token of block-addressed rows (query_start_loc ``starts`` [R + 1], ``seq_lens`` [R], checked), the
    keys its query sees [T] int64: a row's j-th query sees seq_len - q_len + j + 1 (however the rows are
    later cut into calls)."""
    q_lens = np.diff(starts)
    row = np.repeat(np.arange(len(q_lens)), q_lens)
    return seq_lens[row] - (starts[1:][row] - np.arange(int(starts[-1]))) + 1


def token_work(starts: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Per token of block-addressed rows (as ``keys_seen``), its share of the call's work [T] int64: the keys it
    sees, and PIECE_WORK on the first token of each row of 2 or more. Its sum is the rows' work."""
    cost = keys_seen(starts, seq_lens)
    cost[starts[:-1][np.diff(starts) > 1]] += PIECE_WORK
    return cost


def entry_token_work(
    positions: Sequence[int], lengths: Sequence[int], chunk_size: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Per token of sequence entries (entry r: ``lengths[r]`` new tokens from ``positions[r]`` on, packed in
    entry order, in a layer of chunk size ``chunk_size``), its share of the work [T] int64, and the tokens where
    a piece starts [P + 1] int64 (each entry's first token and each first token of a chunk, then T).

    A token's share: the keys it sees, and PIECE_WORK on each piece's first token when its entry brings 2 or
    more. Their sum over an entry is its ``entry_work``; over a part of it, that part's work or more (a part of one
    token pays no piece), when the part starts where a piece does (``split.token_ranges`` counts PIECE_WORK more
    for one that does not).
    """
    counts = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tokens = int(starts[-1])
    row = np.repeat(np.arange(len(counts)), counts)
    index = np.arange(tokens, dtype=np.int64)
    position = np.asarray(positions, dtype=np.int64)[row] + index - starts[row]
    into_chunk = position % chunk_size if chunk_size else position  # keys before it in its chunk
    first = (index == starts[row]) | (into_chunk == 0)
    cost = into_chunk + 1 + PIECE_WORK * (first & (counts[row] >= 2))
    return cost, np.append(np.flatnonzero(first), tokens).astype(np.int64)
