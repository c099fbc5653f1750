"""How much work a call asks for (chunkattn_client.work), counted as the server bounds it (Info's
max_call_work) and as the clients cut their calls to fit: the pairs against the predicate, one query at a time,
and a piece's charge where the engine computes one apart."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from chunkattn_client import work
from chunkattn_client.reference import visible


def _brute(position: int, num_tokens: int, chunk_size: int) -> int:
    """The keys each new token's query sees, from the semantics' predicate (the reference's mask)."""
    end = position + num_tokens
    return int(visible(np.arange(position, end), np.arange(end), chunk_size).sum())


def test_the_docstrings_worked_example() -> None:
    assert work.scores(5, 6, 4) == 2 + 3 + 4 + 1 + 2 + 3


@given(st.integers(0, 200), st.integers(0, 120), st.sampled_from([0, 1, 2, 3, 4, 7, 16, 64]))
def test_scores_count_the_pairs_the_predicate_allows(position: int, num_tokens: int, chunk_size: int) -> None:
    assert work.scores(position, num_tokens, chunk_size) == _brute(position, num_tokens, chunk_size)


def test_scores_stay_exact_at_the_largest_positions() -> None:
    """Python integers: no overflow where a sequence ends at 2^31 - 1 (the protocol's longest)."""
    n = 1 << 20
    p = (1 << 31) - 1 - n
    assert work.scores(p, n, 0) == sum(range(p + 1, p + n + 1))
    assert work.scores(p, n, 8192) == (n // 8192) * 8192 * 8193 // 2 + work.scores(p + n - n % 8192, n % 8192, 8192)


@given(st.integers(0, 200), st.integers(0, 120), st.sampled_from([0, 1, 4, 16]))
def test_an_entry_of_two_or_more_tokens_pays_a_piece_per_chunk(position: int, num_tokens: int, chunk: int) -> None:
    pieces = len({p // chunk for p in range(position, position + num_tokens)}) if chunk else 1
    extra = work.PIECE_WORK * pieces if num_tokens >= 2 else 0
    assert work.entry_work(position, num_tokens, chunk) == work.scores(position, num_tokens, chunk) + extra
    assert work.entry_work(5, 6, 4) == 15 + 2 * work.PIECE_WORK  # the docstring's example


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 60)), min_size=1, max_size=10))
def test_block_rows_count_each_querys_keys(rows: list[tuple[int, int]]) -> None:
    q_lens = np.array([q for q, _ in rows], np.int64)
    seq_lens = q_lens + np.array([c for _, c in rows], np.int64)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    keys = work.keys_seen(starts, seq_lens)
    want = [c + j + 1 for q, c in rows for j in range(q)]  # the row's j-th query after c older keys
    assert keys.tolist() == want
    written = work.token_work(starts, seq_lens)
    pieces = sum(q >= 2 for q, _ in rows)
    assert int(written.sum()) == sum(want) + pieces * work.PIECE_WORK


def test_rows_of_the_longest_sequences_count_exactly() -> None:
    """int64 throughout: 4 rows of 3 queries over 2^31 - 1 keys each, counted exactly."""
    starts = np.arange(5, dtype=np.int64) * 3
    seq_lens = np.full(4, 2**31 - 1, np.int64)
    per_row = 3 * (2**31 - 1 - 3) + 6
    assert int(work.token_work(starts, seq_lens).sum()) == 4 * (per_row + work.PIECE_WORK)


@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=6),
    st.lists(st.integers(0, 100), min_size=6, max_size=6),
    st.sampled_from([0, 1, 4, 16]),
)
def test_entries_tokens_shares_add_up_to_each_entrys_work(lengths: list[int], positions: list[int], chunk: int) -> None:
    costs, pieces = work.entry_token_work(positions[: len(lengths)], lengths, chunk)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    assert len(costs) == starts[-1]
    assert pieces[-1] == starts[-1]
    for r, n in enumerate(lengths):
        assert int(costs[starts[r] : starts[r] + n].sum()) == work.entry_work(positions[r], n, chunk)
        # a piece starts at the entry's first token and at each first token of a chunk
        at = [starts[r] + i for i in range(n) if i == 0 or (chunk and (positions[r] + i) % chunk == 0)]
        assert [int(p) for p in pieces if starts[r] <= p < starts[r] + n] == at


def test_entry_token_work_worked_example() -> None:
    """C = 4: an entry of 6 tokens from 5 (keys 2, 3, 4 | 1, 2, 3; pieces at 5 and 8), a decode at 9 (2 keys, no
    piece), an entry with no tokens."""
    costs, pieces = work.entry_token_work([5, 9, 3], [6, 1, 0], 4)
    p = work.PIECE_WORK
    assert costs.tolist() == [2 + p, 3, 4, 1 + p, 2, 3, 2]
    assert pieces.tolist() == [0, 3, 6, 7]
