"""The vLLM plugin's split of a step too large for one message, or for the server's bound on one call's work
(chunkattn_client.split, as chunkattn_client.vllm.offload uses it): consecutive token ranges within both budgets,
each row cut so that every token sees exactly the keys it saw in the whole step. Runs without vLLM or torch."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from chunkattn_client.split import block_part, token_ranges
from chunkattn_client.work import PIECE_WORK, keys_seen, token_work


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), min_size=1, max_size=12),
    st.integers(1, 50),
    st.sampled_from([0, 1, 7, 100, PIECE_WORK + 300, 3 * PIECE_WORK]),
)
def test_every_token_sees_the_keys_it_saw_in_the_whole_step(
    rows: list[tuple[int, int]], budget: int, max_work: int
) -> None:
    q_lens = np.array([n for n, _ in rows], np.int64)
    seq_lens = q_lens + np.array([c for _, c in rows], np.int64)  # context before the new tokens
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    tokens = int(starts[-1])
    # the whole step: token t of row r at local index i sees seq_len - q_len + i + 1 keys
    want = {}
    for r in range(len(rows)):
        for i in range(int(q_lens[r])):
            want[int(starts[r]) + i] = (r, int(seq_lens[r] - q_lens[r]) + i + 1)
    keys = keys_seen(starts, seq_lens)
    assert keys.tolist() == [want[t][1] for t in range(tokens)]
    costs = token_work(starts, seq_lens)
    ranges = token_ranges(costs, starts, budget, max_work)
    assert ranges[0][0] == 0
    assert ranges[-1][1] == tokens
    assert all(b[0] == a[1] for a, b in itertools.pairwise(ranges))
    assert all(0 <= last - first <= budget for first, last in ranges)
    got = {}
    for first, last in ranges:
        part = block_part(starts, seq_lens, first, last)
        assert part.starts[0] == 0
        assert part.starts[-1] == last - first
        for j, r in enumerate(part.rows):
            n = int(part.starts[j + 1] - part.starts[j])
            assert part.seq_lens[j] >= n
            for i in range(n):
                got[first + int(part.starts[j]) + i] = (int(r), int(part.seq_lens[j]) - n + i + 1)
        # the server's count of the call: within the bound, unless one token alone is past it
        work = int(token_work(part.starts, part.seq_lens).sum()) if last > first else 0
        assert not max_work or work <= max_work or last - first == 1, (first, last, work)
    assert got == want


def test_a_rows_cost_counts_a_piece_where_the_engine_computes_it_apart() -> None:
    """Row 0 and row 1: decodes (their keys only, padding or not: one kernel call for all); row 2: a prefill of
    3 (its keys, and a piece); row 3: no new tokens."""
    starts = np.array([0, 1, 2, 5, 5])
    seq_lens = np.array([10, 4, 3, 7])
    assert token_work(starts, seq_lens).tolist() == [10, 4, 1 + PIECE_WORK, 2, 3]
