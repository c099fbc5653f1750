"""The engine against the float64 reference: random batches, and the cases the semantics hinge on."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkattn_client import BatchEntry
from chunkattn_server import LayerSpec, ModelShape
from tests.helpers.harness import MODELS, NATIVE, NATIVE_PROBLEM, Harness

DTYPE_NAMES = ["float32", "float16", "bfloat16"]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, str, str, list[list[tuple[str, int]]]]:
    """A model, a dtype, a backend path and a few steps; each step is a batch of (sequence, new tokens).

    Token counts mix decodes (1), short prefills and prefills that cross up to 3 chunk boundaries.
    """
    model = draw(st.sampled_from(sorted(MODELS)))
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    impl = draw(st.sampled_from(["auto", "math", *(() if NATIVE_PROBLEM else ("native",))]))
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
    # From position 5 to 8 * boundaries + 6: into chunk `boundaries` of the C = 8 layers.
    h.step([BatchEntry("s", 5, 8 * boundaries + 2)])


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


@pytest.mark.parametrize("impl", ["auto", "math", NATIVE])
@pytest.mark.parametrize(
    ("held_every", "min_view_tokens", "max_views"),
    [
        (2, 1, 64),  # every block its own run: many views, merged
        (2, 1, 2),  # too many runs: all gathered in one copy
        (5, 16, 8),  # runs of 4 blocks read as views, partial last runs gathered
        (5, 10**9, 8),  # nothing long enough for a view: all gathered
    ],
)
def test_fragmented_pool_reads_through_views_gathers_and_merges(
    impl: str, held_every: int, min_view_tokens: int, max_views: int
) -> None:
    """Someone else holds every n-th block, so each sequence's blocks come in short runs."""
    h = Harness.build(MODELS["gqa"], impl=impl, min_view_tokens=min_view_tokens, max_views=max_views)
    pool = h.engine.pool
    taken = pool.allocate(pool.num_free, account="")
    pool.free([b for i, b in enumerate(taken) if i % held_every])
    lengths = {"a": 0, "b": 0, "c": 0}
    for _ in range(4):
        for s in lengths:
            h.step([BatchEntry(s, lengths[s], 5)])
            lengths[s] += 5
    glob = next(g.index for g in h.engine.groups if g.chunk_size == 0)  # a global group keeps every block
    for s in lengths:
        blocks = sorted(h.engine.kv.sequence(s, tenant="").tables[glob].values())
        assert any(b - a != 1 for a, b in itertools.pairwise(blocks)), "the pool did not fragment"
    h.step([BatchEntry(s, n, 1) for s, n in lengths.items()])
    h.step([BatchEntry(s, n + 1, 3) for s, n in lengths.items()])


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_float32_inputs_into_a_half_precision_cache(cache_dtype: str) -> None:
    """CUDA's default: the client sends fp32, the cache (and the compute) is bf16; the output is fp32."""
    h = Harness.build(MODELS["gqa"], dtype="float32", cache_dtype=cache_dtype)
    h.step([BatchEntry("a", 0, 21), BatchEntry("b", 0, 1)])
    for i in range(10):
        h.step([BatchEntry("a", 21 + i, 1), BatchEntry("b", 1 + i, 1)])


def test_a_full_pool_keeps_serving_across_chunk_boundaries() -> None:
    """A pool of exactly one chunk per sequence: the old chunk goes back before the next one is needed."""
    model = ModelShape(num_heads=2, num_kv_heads=1, head_size=8, layers=(LayerSpec(16), LayerSpec(16)))
    h = Harness.build(model, num_blocks=8)  # one group of 2 layers: 16 / 4 = 4 blocks a sequence, 2 sequences
    h.step([BatchEntry("a", 0, 16), BatchEntry("b", 0, 16)])
    for i in range(40):
        h.step([BatchEntry("a", 16 + i, 1), BatchEntry("b", 16 + i, 1)])
    assert h.engine.stats().used_blocks <= 8


def test_inputs_that_require_grad_do_not_drag_the_cache_into_autograd() -> None:
    h = Harness.build(MODELS["gqa"])
    m = h.model
    for pos, n in ((0, 9), (9, 1)):
        q = torch.randn(n, m.num_heads, m.head_size, requires_grad=True)
        k = torch.randn(n, m.num_kv_heads, m.head_size, requires_grad=True)
        out = h.engine.attend(0, [BatchEntry("g", pos, n)], q, k, k, tenant="")
        assert not out.requires_grad
    assert not any(t.requires_grad for t in (*h.engine.cache.k, *h.engine.cache.v))
