"""A step's tokens cut into calls: each call's request within the message limit of both sides, and its work
within the server's bound on one call (Info's max_call_work; ``chunkattn_client.work``). Written once for the
clients that cut: the transformers session (sequence entries, ``entry_calls``), the vLLM plugin (block rows,
``token_ranges`` and ``block_part``) and the bench (which checks that its largest call fits,
``tokens_per_call``). numpy only: no torch, gRPC or protobuf.

Calls are consecutive ranges of the step's tokens, rows packed in order, so a row is in a call once and its
tokens go in order: only a range's first and last row may be part of a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from chunkattn_client import work
from chunkattn_client.batch import BlockRows

# A request's bytes beyond its tensors (and, in the block API, its tables): its other fields and framing.
MESSAGE_HEADROOM = 64 << 10


def message_limit(server_max: int, client_max: int) -> int:
    """The largest message a call may be: the smaller of the server's (Info's max_message_bytes) and the client
    channel's (``ChunkAttnClient.max_message_bytes``) limits, in bytes."""
    return min(server_max, client_max)


def tokens_per_call(per_token: int, limit: int, fixed: int = 0) -> int:
    """How many tokens one request may carry: ``per_token`` bytes each (q, k, v and any per-token field), beside
    ``fixed`` bytes (per-row fields and tables) and MESSAGE_HEADROOM, in a message of at most ``limit`` bytes
    (``message_limit``). 0 when not even one fits."""
    return max(0, limit - MESSAGE_HEADROOM - fixed) // per_token


def token_ranges(costs: np.ndarray, starts: np.ndarray, budget: int, max_work: int = 0) -> list[tuple[int, int]]:
    """A step's tokens [0, T) in consecutive ranges (one call each) of at most ``budget`` tokens and, with
    ``max_work``, at most that much work (the server's Info.max_call_work). ``costs`` [T]: each token's share of
    the step's work (``work.token_work``, ``work.entry_token_work``); ``starts``: the token indices where a piece
    starts (a block row, or a sequence entry's chunk), T among them. A range that starts inside a piece counts
    PIECE_WORK more (that piece's rest is a piece of its own there). A token that alone costs more than
    ``max_work`` is a range of its own: the server refuses it, saying why. No tokens: one empty range."""
    tokens = len(costs)
    if not tokens:
        return [(0, 0)]
    total = np.concatenate([[0], np.cumsum(costs, dtype=np.float64)])  # float: no overflow, exact below 2^53
    piece_start = np.zeros(tokens + 1, dtype=bool)
    piece_start[starts] = True
    ranges, first = [], 0
    while first < tokens:
        last = min(tokens, first + budget)
        if max_work:
            room = max_work - (0 if piece_start[first] else work.PIECE_WORK)
            fits = int(np.searchsorted(total, total[first] + room, side="right")) - 1
            last = min(last, max(fits, first + 1))
        ranges.append((first, last))
        first = last
    return ranges


def entry_calls(
    lengths: Sequence[int], budget: int, positions: Sequence[int], chunk_size: int = 0, max_work: int = 0
) -> list[list[tuple[int, int, int]]]:
    """Sequence entries' tokens (row r: ``lengths[r]`` new tokens from ``positions[r]`` on, in a layer of chunk
    size ``chunk_size``) cut into calls of at most ``budget`` tokens and, with ``max_work``, at most that much
    work (``token_ranges``): per call, (row, first token, count) of each row with tokens in it, in row order.
    A row with no tokens is in none."""
    if sum(lengths) <= budget and (  # the usual case, a decode step: one call, no arrays (a few us per layer)
        not max_work
        or sum(work.entry_work(p, n, chunk_size) for p, n in zip(positions, lengths, strict=True)) <= max_work
    ):
        return [[(r, 0, n) for r, n in enumerate(lengths) if n]] if any(lengths) else []
    costs, pieces = work.entry_token_work(positions, lengths, chunk_size)
    starts = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    calls = []
    for first, last in token_ranges(costs, pieces, budget, max_work):
        lo, hi = np.maximum(starts[:-1], first), np.minimum(starts[1:], last)
        calls.append([(int(r), int(lo[r] - starts[r]), int(hi[r] - lo[r])) for r in np.flatnonzero(hi > lo)])
    return [call for call in calls if call]


class BlockPart(NamedTuple):
    """The rows of a step's tokens [first, last): which rows (indices), their query_start_loc rebased to the
    range, and their seq_lens cut after the range's last token."""

    rows: np.ndarray
    starts: np.ndarray
    seq_lens: np.ndarray


def block_part(starts: np.ndarray, seq_lens: np.ndarray, first: int, last: int) -> BlockPart:
    """The part of a step (rows with query_start_loc ``starts`` [R + 1] and ``seq_lens`` [R]) that its tokens
    [first, last) make: every row with a token there, each cut to those tokens. A row cut in two is two
    calls in order: the first writes its tokens' K/V, which the second reads back through the block table
    as the keys before its own (its seq_len counts them)."""
    ends = starts[1:]
    rows = np.flatnonzero((starts[:-1] < last) & (ends > first))
    if not len(rows):  # no tokens: the one empty row vLLM would send
        rows = np.array([0]) if len(seq_lens) else np.array([], dtype=np.int64)
    lo = np.maximum(starts[rows], first)
    hi = np.minimum(ends[rows], last)
    cut = seq_lens[rows] - (ends[rows] - hi)  # keys up to the range's last token of the row
    bounds = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
    return BlockPart(rows, bounds, cut)


def block_calls(
    space_id: str,
    slots: np.ndarray,
    starts: np.ndarray,
    seq_lens: np.ndarray,
    tables: np.ndarray,
    *,
    block_size: int,
    per_token: int,
    limit: int,
    max_work: int = 0,
) -> list[tuple[int, int, BlockRows]]:
    """One layer's step of a serving engine (its attention metadata: ``slots`` [T], ``starts`` [R + 1] =
    query_start_loc, ``seq_lens`` [R], ``tables`` [R, >= W] block ids) as the block calls that carry it:
    (first token, last token, rows) per call, in token order. The tables are cut to the widest row's blocks
    (W = ceil(max seq_len / block_size): columns past it are never read); a call carries at most what a message
    of ``limit`` bytes holds (``per_token`` bytes of tensors per token, beside the rows' fields and tables) and
    at most ``max_work`` work (Info's max_call_work). Written once for the vLLM plugin and the bench's engine."""
    rows = len(seq_lens)
    widest = -(-int(seq_lens.max(initial=0)) // block_size)
    tables = tables[:rows, :widest]
    budget = max(1, tokens_per_call(per_token + 8, limit, fixed=rows * (4 * widest + 16)))
    ranges = token_ranges(work.token_work(starts, seq_lens), starts, budget, max_work)
    calls = []
    for first, last in ranges:
        part = block_part(starts, seq_lens, first, last)
        calls.append(
            (first, last, BlockRows(space_id, slots[first:last], part.starts, part.seq_lens, tables[part.rows]))
        )
    return calls
