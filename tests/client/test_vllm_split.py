"""The vLLM plugin's split of a step too large for one message (chunkattn_client.vllm.offload): consecutive
token ranges, each row cut so that every token sees exactly the keys it saw in the whole step. Runs without
vLLM (the module imports torch, not vLLM)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from chunkattn_client.vllm.offload import block_part, token_ranges


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), min_size=1, max_size=12),
    st.integers(1, 50),
)
def test_every_token_sees_the_keys_it_saw_in_the_whole_step(rows: list[tuple[int, int]], budget: int) -> None:
    q_lens = np.array([n for n, _ in rows], np.int64)
    seq_lens = q_lens + np.array([c for _, c in rows], np.int64)  # context before the new tokens
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    tokens = int(starts[-1])
    # the whole step: token t of row r at local index i sees seq_len - q_len + i + 1 keys
    want = {}
    for r in range(len(rows)):
        for i in range(int(q_lens[r])):
            want[int(starts[r]) + i] = (r, int(seq_lens[r] - q_lens[r]) + i + 1)
    ranges = token_ranges(tokens, budget)
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
    assert got == want
