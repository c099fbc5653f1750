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

import numpy as np

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
