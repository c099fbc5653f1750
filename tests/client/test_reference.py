"""The reference itself, checked against a loop written independently from the predicate."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkattn_client import BatchEntry, ReferenceModel, chunked_attention, visible


def _loop(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, qpos: list[int], c: int, slopes: list[float] | None
) -> np.ndarray:
    """One query and one head at a time, in plain Python floats."""
    _, heads, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for t, i in enumerate(qpos):
        keys = [j for j in range(i + 1) if c == 0 or j // c == i // c]
        for h in range(heads):
            kh = h // group
            scores = [
                sum(q[t, h, d] * k[j, kh, d] for d in range(dim)) / math.sqrt(dim)
                + (slopes[h] * (j - i) if slopes else 0.0)
                for j in keys
            ]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for d in range(dim):
                out[t, h, d] = sum(w * v[j, kh, d] for w, j in zip(weights, keys, strict=True)) / total
    return out


def test_mask_of_the_worked_example() -> None:
    """C = 4: position 5 sees 4 and 5; position 8 sees only itself; C = 0 is causal."""
    m = visible([5, 8], range(10), 4)
    assert np.flatnonzero(m[0]).tolist() == [4, 5]
    assert np.flatnonzero(m[1]).tolist() == [8]
    assert np.flatnonzero(visible([5], range(10), 0)[0]).tolist() == [0, 1, 2, 3, 4, 5]


@given(
    seq_len=st.integers(1, 12),
    chunk=st.sampled_from([0, 1, 2, 4, 5]),
    heads=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
    alibi=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_an_independent_loop(
    seq_len: int, chunk: int, heads: tuple[int, int], alibi: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    h, hkv = heads
    q = rng.standard_normal((seq_len, h, 3))
    k = rng.standard_normal((seq_len, hkv, 3))
    v = rng.standard_normal((seq_len, hkv, 3))
    slopes = [0.5, 0.25, 0.125, 0.0625][:h] if alibi else None
    qpos = list(range(seq_len))
    got = chunked_attention(q, k, v, qpos, chunk_size=chunk, alibi_slopes=slopes)
    np.testing.assert_allclose(got, _loop(q, k, v, qpos, chunk, slopes), rtol=1e-12, atol=1e-12)


def test_first_query_of_a_chunk_returns_its_own_value() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((8, 2, 4)), rng.standard_normal((8, 1, 4)), rng.standard_normal((8, 1, 4))
    out = chunked_attention(q, k, v, range(8), chunk_size=4)
    np.testing.assert_allclose(out[4], np.repeat(v[4], 2, axis=0))


def test_reference_model_tracks_history_and_refuses_wrong_positions() -> None:
    ref = ReferenceModel([4, 0])
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((6, 2, 4)), rng.standard_normal((6, 1, 4)), rng.standard_normal((6, 1, 4))
    whole = ref.attend(0, [BatchEntry("s", 0, 6)], q, k, v)
    ref.release("s")
    part1 = ref.attend(0, [BatchEntry("s", 0, 5)], q[:5], k[:5], v[:5])
    part2 = ref.attend(0, [BatchEntry("s", 5, 1)], q[5:], k[5:], v[5:])
    np.testing.assert_allclose(np.concatenate([part1, part2]), whole)
    with pytest.raises(ValueError, match="has 6 tokens in layer 0, not 3"):
        ref.attend(0, [BatchEntry("s", 3, 1)], q[:1], k[:1], v[:1])
