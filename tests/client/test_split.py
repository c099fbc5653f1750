"""A step's tokens cut into calls (chunkattn_client.split): the message limit of both sides, the headroom, and the
sequence-addressed split of the transformers session within both budgets. (The block rows' split, as the vLLM
plugin uses it, is tests/client/test_vllm_split.py.)"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from chunkattn_client import split, work


def test_the_limit_is_the_smaller_sides() -> None:
    assert split.message_limit(4 << 20, 256 << 20) == 4 << 20
    assert split.message_limit(64 << 20, 1 << 20) == 1 << 20


def test_tokens_per_call_leave_the_headroom_and_the_fixed_bytes() -> None:
    limit = split.MESSAGE_HEADROOM + 100 + 3 * 520
    assert split.tokens_per_call(520, limit, fixed=100) == 3
    assert split.tokens_per_call(520, limit - 1, fixed=100) == 2
    assert split.tokens_per_call(520, limit) == 3  # 100 bytes to spare
    assert split.tokens_per_call(520, split.MESSAGE_HEADROOM + 519) == 0  # not even one
    assert split.tokens_per_call(520, split.MESSAGE_HEADROOM // 2) == 0  # below the headroom: none, not negative


def test_entries_fill_each_call_to_its_budget_in_row_order() -> None:
    """No work bound: consecutive ranges of 4 tokens over rows of 5, 0 and 7 tokens; the empty row is in none."""
    calls = split.entry_calls([5, 0, 7], 4, [0, 0, 0])
    assert calls == [[(0, 0, 4)], [(0, 4, 1), (2, 0, 3)], [(2, 3, 4)]]
    assert split.entry_calls([0, 0], 4, [3, 9]) == []


def test_entries_fit_the_work_bound_exactly() -> None:
    """C = 4: 6 tokens from position 5 are 15 pairs (2, 3, 4 | 1, 2, 3) in 2 pieces. A bound of exactly that is one
    call; one less leaves the last token (3 pairs) to a call of its own."""
    whole = work.entry_work(5, 6, 4)
    assert whole == 15 + 2 * work.PIECE_WORK
    assert split.entry_calls([6], 100, [5], 4, whole) == [[(0, 0, 6)]]
    assert split.entry_calls([6], 100, [5], 4, whole - 1) == [[(0, 0, 5)], [(0, 5, 1)]]


def test_a_token_past_the_bound_alone_is_a_call_of_its_own() -> None:
    """A decode at position 99 of a global layer sees 100 keys: past a bound of 10 it still goes, alone (the
    server refuses it, saying why); the next row's decode goes in the next call."""
    assert split.entry_calls([1, 1], 8, [99, 3], 0, 10) == [[(0, 0, 1)], [(1, 0, 1)]]


@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=6),
    st.lists(st.integers(0, 100), min_size=6, max_size=6),
    st.integers(1, 30),
    st.sampled_from([0, 4, 16]),
    st.sampled_from([0, 1, 10, 200, work.PIECE_WORK + 50]),
)
def test_the_transformers_split_keeps_each_call_within_both_budgets(
    lengths: list[int], positions: list[int], budget: int, chunk_size: int, max_work: int
) -> None:
    calls = split.entry_calls(lengths, budget, positions[: len(lengths)], chunk_size, max_work)
    covered: dict[int, list[tuple[int, int]]] = {}
    for pieces in calls:
        assert pieces
        assert len({r for r, _, _ in pieces}) == len(pieces)  # a sequence once per call
        tokens = sum(n for _, _, n in pieces)
        assert tokens <= budget
        done = sum(work.entry_work(positions[r] + at, n, chunk_size) for r, at, n in pieces)
        assert not max_work or done <= max_work or tokens == 1  # one token alone past the bound: its own call
        for r, at, n in pieces:
            assert n > 0
            covered.setdefault(r, []).append((at, n))
    for r, total in enumerate(lengths):  # every row's tokens once, in order
        spans = covered.get(r, [])
        assert [at for at, _ in spans] == list(np.cumsum([0, *[n for _, n in spans]])[:-1])
        assert sum(n for _, n in spans) == total
