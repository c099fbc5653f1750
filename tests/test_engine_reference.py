"""The engine against the float64 reference: random batches, and the cases the semantics hinge on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkattn_client import BatchEntry
from tests.harness import MODELS, Harness

DTYPE_NAMES = ["float32", "float16", "bfloat16"]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, str, str, list[list[tuple[str, int]]]]:
    """A model, a dtype, a backend path and a few steps; each step is a batch of (sequence, new tokens).

    Token counts mix decodes (1), short prefills and prefills that cross up to 3 chunk boundaries.
    """
    model = draw(st.sampled_from(sorted(MODELS)))
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    impl = draw(st.sampled_from(["auto", "math"]))
    max_chunk = max(s.chunk_size for s in MODELS[model].layers) or 8
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        ids = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True))
        steps.append(
            [(i, draw(st.one_of(st.just(1), st.integers(1, 4), st.integers(1, 3 * max_chunk + 3)))) for i in ids]
        )
    return model, dtype, impl, steps


@settings(max_examples=60)
@given(scenarios())
def test_random_batches_match_reference(scenario: tuple[str, str, str, list[list[tuple[str, int]]]]) -> None:
    model, dtype, impl, steps = scenario
    h = Harness.build(MODELS[model], dtype=dtype, impl=impl)
    lengths: dict[str, int] = {}
    for step in steps:
        entries = [BatchEntry(s, lengths.get(s, 0), n) for s, n in step]
        h.step(entries)
        for s, n in step:
            lengths[s] = lengths.get(s, 0) + n


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("boundaries", [0, 1, 2, 3])
def test_one_call_crosses_chunk_boundaries(dtype: str, boundaries: int) -> None:
    """A prefill that starts mid-chunk and crosses 0-3 chunk boundaries in one call (C = 8)."""
    h = Harness.build(MODELS["gqa"], dtype=dtype)
    h.step([BatchEntry("s", 0, 5)])
    # From position 5, reaching into chunk `boundaries` (chunks of 8 in layers 0-1, 16 in 3-4).
    h.step([BatchEntry("s", 5, 8 * boundaries + 1)])


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("start", [7, 8, 9, 15, 16, 17])
def test_decodes_at_and_after_a_boundary(dtype: str, start: int) -> None:
    """Decodes that end a chunk (7, 15), start one (8, 16) and follow a start (9, 17), with a neighbour."""
    h = Harness.build(MODELS["gqa"], dtype=dtype)
    h.step([BatchEntry("s", 0, start), BatchEntry("t", 0, 3)])
    for i in range(3):
        h.step([BatchEntry("t", 3 + i, 1), BatchEntry("s", start + i, 1)])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_prefill_then_many_decodes(model: str) -> None:
    """A prefill and 40 decodes for two sequences of different lengths, crossing several boundaries."""
    h = Harness.build(MODELS[model])
    h.step([BatchEntry("a", 0, 11), BatchEntry("b", 0, 2)])
    for i in range(40):
        h.step([BatchEntry("a", 11 + i, 1), BatchEntry("b", 2 + i, 1)])


def test_mixed_prefill_and_decode_in_one_batch() -> None:
    h = Harness.build(MODELS["gqa"])
    h.step([BatchEntry("old", 0, 6)])
    h.step([BatchEntry("new", 0, 19), BatchEntry("old", 6, 1), BatchEntry("other", 0, 1)])
    h.step([BatchEntry("old", 7, 1), BatchEntry("new", 19, 12), BatchEntry("other", 1, 1)])


@pytest.mark.parametrize("impl", ["auto", "math"])
def test_fragmented_pool_reads_through_gathers_and_merges(impl: str) -> None:
    """Interleaved growth scatters each sequence's blocks; with tiny views and with none, results hold."""
    for min_view_tokens, max_views in [(1, 64), (1, 2), (10**9, 8)]:
        h = Harness.build(MODELS["gqa"], impl=impl, min_view_tokens=min_view_tokens, max_views=max_views)
        lengths = {"a": 0, "b": 0, "c": 0}
        for _ in range(12):
            for s in lengths:  # one block (4 tokens) each in turn, so no two of a sequence's blocks touch
                h.step([BatchEntry(s, lengths[s], 4)])
                lengths[s] += 4
        h.step([BatchEntry(s, n, 1) for s, n in lengths.items()])
        h.step([BatchEntry(s, n + 1, 3) for s, n in lengths.items()])
