"""The native prefill kernel (attention/backends/native/prefill.cpp), every ISA build this CPU runs.

Two levels. The kernel itself, called with hand-built pieces over a pool whose every block outside the pieces'
tables is NaN (a block read that is not the piece's would show), against a float64 reference written here from
the semantics (query at position i sees key j iff j <= i in its chunk; keys before a piece's first query from
the pages, the rest from the call's rows): GQA / MQA / MHA, head sizes 8, 20, 64 and 128 (one of 768 keys: more
than one 256-key tile), ALiBi, a global layer, float32 / bfloat16 / float16 compute over pages of the compute
dtype and both float8 formats, and chunk boundaries drawn by hypothesis. And the engine with impl="native"
(Harness: every call against the reference model): prefills across chunk boundaries, a continuing prefill (cached
keys and new ones in one piece), prefills beside decodes in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkattn_client import BatchEntry
from chunkattn_client.reference import within_tolerance
from chunkattn_server import LayerSpec, ModelShape, torchtypes
from chunkattn_server.attention.backends.native import build
from chunkattn_server.attention.backends.native.backend import NativeBackend
from chunkattn_server.kv.scales import KVScales
from tests.helpers.harness import MODELS, NATIVE_PROBLEM, Harness

pytestmark = pytest.mark.native

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, **FP8}


def _pieces(spans: Sequence[tuple[int, int]], chunk: int) -> list[tuple[int, int, int, int]]:
    """(row, num_queries, position, key_start) of each piece of prefills (position, new tokens), cut at chunk
    boundaries as attention/plan.py cuts them."""
    out = []
    row = 0
    for start, n in spans:
        pos = start
        while pos < start + n:
            key_start = pos - pos % chunk if chunk else 0
            stop = min(start + n, key_start + chunk) if chunk else start + n
            out.append((row + pos - start, stop - pos, pos, key_start))
            pos = stop
        row += n
    return out


def _run(
    heads: tuple[int, int],
    d: int,
    spans: Sequence[tuple[int, int]],
    chunk: int,
    *,
    compute: str = "float32",
    cache: str | None = None,
    bs: int = 4,
    alibi: bool = False,
    seed: int = 0,
) -> None:
    """Prefills of sequences holding `position` keys already (spans: (position, new tokens)) in one kernel
    call over a scattered, otherwise NaN pool, checked against float64."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    ct = DTYPES[compute]
    pt = DTYPES[cache or compute]
    fp8 = cache in FP8
    ks, vs = (0.05, 0.02) if fp8 else (1.0, 1.0)
    t = sum(n for _, n in spans)
    q = torch.randn(t, h, d, generator=g).to(ct)
    k = torch.randn(t, hkv, d, generator=g).to(ct)
    v = torch.randn(t, hkv, d, generator=g).to(ct)
    need = [-(-(p + n) // bs) for p, n in spans]
    nblocks = 2 * sum(need) + 3
    k_pages = torch.full((hkv, nblocks, bs, d), float("nan")).to(pt)
    v_pages = k_pages.clone()
    free = torch.randperm(nblocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(b)] for b in need]

    def stored(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torchtypes.store(x, scale, pt) if fp8 else x.to(pt)

    for (position, _), table in zip(spans, tables, strict=True):
        for b in table[: -(-position // bs)]:  # the blocks of the cached keys (the rest stay NaN)
            k_pages[:, b] = stored(torch.randn(hkv, bs, d, generator=g), ks)
            v_pages[:, b] = stored(torch.randn(hkv, bs, d, generator=g), vs)
    meta: list[tuple[int, int, int, int, int, int]] = []
    blocks: list[int] = []
    owner: list[int] = []
    rows = np.cumsum([0] + [n for _, n in spans])
    for row, nq, pos, key_start in _pieces(spans, chunk):
        s = int(np.searchsorted(rows, row, side="right")) - 1
        meta.append((row, nq, pos, key_start, pos, len(blocks)))
        blocks += tables[s][key_start // bs : -(-pos // bs)] if pos > key_start else []
        owner.append(s)
    slopes = torch.rand(h, generator=g) if alibi else None
    out = torch.full_like(q, float("nan"))
    kernel = build.load()
    kernel.prefill(
        q, k, v, k_pages, v_pages, torch.tensor(meta).view(-1, 6), torch.tensor(blocks, dtype=torch.int64), out,
        d**-0.5, ks, vs, slopes,
    )  # fmt: skip
    expected = torch.zeros(t, h, d, dtype=torch.float64)
    for (row, nq, pos, key_start, _, _), s in zip(meta, owner, strict=True):
        first_row = row - (pos - spans[s][0])  # the sequence's row of its first new token
        kk, vv = [], []
        for j in range(key_start, pos + nq):
            if j < spans[s][0]:  # cached: from the pages, as the cache gives it back
                b = tables[s][j // bs]
                kk.append(torchtypes.load(k_pages[:, b, j % bs], ks, ct).double())
                vv.append(torchtypes.load(v_pages[:, b, j % bs], vs, ct).double())
            else:
                kk.append(k[first_row + j - spans[s][0]].double())
                vv.append(v[first_row + j - spans[s][0]].double())
        keys, values = torch.stack(kk, 1), torch.stack(vv, 1)  # [Hkv, n, D]
        where = torch.arange(key_start, pos + nq)
        for i in range(nq):
            qi = q[row + i].double().view(hkv, h // hkv, d)
            score = torch.einsum("hgd,hnd->hgn", qi, keys) * d**-0.5
            if slopes is not None:
                score = score + slopes.double().view(hkv, -1, 1) * (where - pos - i).double()
            score = score.masked_fill(where > pos + i, float("-inf"))
            expected[row + i] = torch.einsum("hgn,hnd->hgd", torch.softmax(score, -1), values).reshape(h, d)
    ok, err = within_tolerance(out.double().numpy(), expected.numpy(), "float32" if compute == "float32" else compute)
    assert ok, f"error {err:.3g}"


CASES = [  # (heads, head size, spans (position, new tokens), chunk, compute, cache, block size, alibi)
    ((8, 2), 16, [(0, 37), (5, 1), (9, 30)], 16, "float32", None, 4, False),  # GQA, pieces across chunks
    ((4, 1), 8, [(13, 40)], 16, "float32", None, 4, True),  # MQA, a continuing prefill, ALiBi
    ((3, 3), 20, [(70, 9), (0, 3)], 0, "float32", None, 4, False),  # MHA, a global layer, head size 20
    ((18, 2), 20, [(21, 25)], 32, "float32", "bfloat16", 8, False),  # 9 query heads per KV head
    ((2, 1), 128, [(200, 568)], 0, "float32", None, 16, False),  # 768 keys: more than one tile
    ((8, 2), 64, [(300, 40), (1, 2)], 256, "bfloat16", None, 16, False),
    ((4, 2), 20, [(7, 30)], 16, "bfloat16", None, 4, True),
    ((8, 2), 64, [(100, 60)], 128, "float16", None, 16, False),
    ((4, 2), 8, [(10, 20)], 0, "float16", None, 4, True),
    *(((8, 2), 16, [(19, 30), (3, 2)], 16, c, f, 4, False) for c in ("float32", "bfloat16") for f in FP8),
    ((4, 1), 64, [(40, 30)], 32, "float16", "fp8_e4m3", 8, False),
]


@pytest.mark.parametrize(("heads", "d", "spans", "chunk", "compute", "cache", "bs", "alibi"), CASES)
def test_the_kernel_matches_float64(
    isa: str,
    heads: tuple[int, int],
    d: int,
    spans: list[tuple[int, int]],
    chunk: int,
    compute: str,
    cache: str | None,
    bs: int,
    alibi: bool,
) -> None:
    _run(heads, d, spans, chunk, compute=compute, cache=cache, bs=bs, alibi=alibi)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spans=st.lists(st.tuples(st.integers(0, 40), st.integers(2, 40)), min_size=1, max_size=3),
    chunk=st.sampled_from([0, 4, 8, 12, 32]),
    compute=st.sampled_from(["float32", "bfloat16"]),
)
def test_chunk_boundaries_anywhere(spans: list[tuple[int, int]], chunk: int, compute: str) -> None:
    """The widest build: any prefill positions and lengths against any chunk size."""
    _run((4, 2), 16, spans, chunk, compute=compute, bs=4)


def test_a_block_outside_the_pages_is_refused_before_anything_is_read() -> None:
    if NATIVE_PROBLEM:
        pytest.skip(NATIVE_PROBLEM)
    kernel = build.load()
    q = torch.randn(4, 2, 8)
    k = v = torch.randn(4, 1, 8)
    pages = torch.zeros(1, 2, 4, 8)
    meta = torch.tensor([[0, 4, 4, 0, 4, 0]])
    with pytest.raises(RuntimeError, match="not in the pages"):
        kernel.prefill(q, k, v, pages, pages, meta, torch.tensor([2]), torch.empty_like(q), 1.0, 1.0, 1.0, None)
    meta = torch.tensor([[1, 4, 4, 0, 4, 0]])
    with pytest.raises(RuntimeError, match="rows are not in q"):
        kernel.prefill(q, k, v, pages, pages, meta, torch.tensor([1]), torch.empty_like(q), 1.0, 1.0, 1.0, None)


TOP = 2**63 - 1


@pytest.mark.parametrize(
    ("piece", "blocks", "message"),
    [
        ([TOP, 1, 0, 0, 0, 0], [0], "rows are not in q"),  # row + num_queries would wrap past int64
        ([0, TOP, 0, 0, 0, 0], [0], "rows are not in q"),
        ([0, 1, 1, 0, 1, TOP], [0], "blocks are not in blocks"),  # first block + count would wrap
        ([0, 1, 2**63 - 2, 2**63 - 2, 2**63 - 2, 0], [0], r"is not in \[0, 2\^62\]"),
        ([0, 1, -1, -1, -1, 0], [0], r"is not in \[0, 2\^62\]"),
    ],
)
def test_pieces_near_int64s_end_are_refused(piece: list[int], blocks: list[int], message: str) -> None:
    """Found by an independent review: sums of a piece's fields that wrapped past int64 passed the checks (a write
    anywhere in memory, or another tenant's block read)."""
    if NATIVE_PROBLEM:
        pytest.skip(NATIVE_PROBLEM)
    kernel = build.load()
    q = torch.randn(2, 2, 8)
    k = v = torch.randn(2, 1, 8)
    pages = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=message):
        kernel.prefill(
            q, k, v, pages, pages, torch.tensor([piece]), torch.tensor(blocks), torch.empty_like(q), 1.0, 1.0, 1.0, None
        )


def test_empty_shapes_are_refused_not_divided_by() -> None:
    if NATIVE_PROBLEM:
        pytest.skip(NATIVE_PROBLEM)
    kernel = build.load()
    meta = torch.tensor([[0, 2, 2, 0, 2, 0]])
    k = v = torch.randn(2, 1, 8)
    no_rows = torch.zeros(1, 2, 0, 8)  # blocks of 0 tokens
    q = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="a block size"):
        kernel.prefill(q, k, v, no_rows, no_rows, meta, torch.tensor([0]), torch.empty_like(q), 1.0, 1.0, 1.0, None)
    headless = torch.randn(2, 0, 8)
    pages = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="heads and a head size"):
        kernel.prefill(
            headless, k, v, pages, pages, meta, torch.tensor([0]), torch.empty_like(headless), 1.0, 1.0, 1.0, None
        )


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_nan_key_makes_the_queries_that_see_it_nan(compute: torch.dtype) -> None:
    """Found by an independent review: the bfloat16 path on the AMX tiles clamped a NaN score to a zero weight. A
    NaN in the first key (seen by every query) now makes every row NaN on every path, as in float32 and SDPA."""
    if NATIVE_PROBLEM:
        pytest.skip(NATIVE_PROBLEM)
    kernel = build.load()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 32, generator=gen).to(compute)
    k = torch.randn(5, 2, 32, generator=gen).to(compute)
    v = torch.randn(5, 2, 32, generator=gen).to(compute)
    k[0] = float("nan")
    pages = torch.zeros(2, 1, 4, 32, dtype=compute)
    out = torch.empty_like(q)
    meta = torch.tensor([[0, 5, 0, 0, 0, 0]])
    kernel.prefill(q, k, v, pages, pages, meta, torch.zeros(0, dtype=torch.int64), out, 32**-0.5, 1.0, 1.0, None)
    assert out.float().isnan().all()


WIDE = ModelShape(
    num_heads=6,
    num_kv_heads=2,
    head_size=20,
    layers=(LayerSpec(8), LayerSpec(0, alibi_slopes=tuple(2.0 ** -(1 + h) for h in range(6)))),
)

ENGINE_CASES = [  # (model, q/k/v dtype, compute, cache)
    *((name, "float32", "auto", "float32") for name in sorted(MODELS)),
    ("wide", "float32", "auto", "float32"),
    ("wide", "bfloat16", "bfloat16", "bfloat16"),
    ("wide", "float16", "float16", "float16"),
    ("wide", "float32", "auto", "fp8_e4m3"),
    ("wide", "bfloat16", "bfloat16", "fp8_e5m2"),
]


@pytest.mark.parametrize(("model", "dtype", "compute", "cache"), ENGINE_CASES)
def test_the_engine_prefills_natively(isa: str, model: str, dtype: str, compute: str, cache: str) -> None:
    """Prefills across chunk boundaries, a continuing prefill (cached keys and new ones in one piece) beside
    decodes in one call, and a prefill beside a fresh sequence: every call against the reference."""
    scales = KVScales((0.05,), (0.02,)) if cache.startswith("fp8") else None
    shape = WIDE if model == "wide" else MODELS[model]
    h = Harness.build(shape, dtype=dtype, compute_dtype=compute, cache_dtype=cache, kv_scales=scales, impl="native")
    h.step([BatchEntry("a", 0, 19), BatchEntry("b", 0, 6)])
    h.step([BatchEntry("a", 19, 1), BatchEntry("b", 6, 13)])  # a decode beside a continuing prefill
    h.step([BatchEntry("b", 19, 22), BatchEntry("c", 0, 3), BatchEntry("a", 20, 1)])


def test_the_sdpa_path_is_kept_behind_a_flag() -> None:
    if NATIVE_PROBLEM:
        pytest.skip(NATIVE_PROBLEM)
    from chunkattn_server.attention.backends.native.backend import NativeBackend

    h = Harness.build(MODELS["gqa"], impl="native")
    backend = h.engine.backend
    assert isinstance(backend, NativeBackend)
    assert backend.prefill
    backend.prefill = False
    h.step([BatchEntry("a", 0, 21)])
    h.step([BatchEntry("a", 21, 9)])


class _Counting:
    """The kernel module, its prefill calls counted."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.prefills = 0

    def __getattr__(self, name: str) -> object:
        if name == "prefill":
            self.prefills += 1
        return getattr(self.kernel, name)


def test_a_piece_too_big_to_pack_goes_to_sdpa_over_views() -> None:
    """A piece whose keys would pack into more than max_packed_bytes (a few queries over a long global context)
    is served by SDPA over views of the pages, not copied: the same answers (the harness checks every call
    against the reference), and the kernel's prefill called only for the pieces under the bound."""
    if NATIVE_PROBLEM:
        pytest.skip(NATIVE_PROBLEM)
    h = Harness.build(MODELS["gqa"], impl="native")
    backend = h.engine.backend
    assert isinstance(backend, NativeBackend)
    counted = _Counting(backend._kernel)
    backend._kernel = counted  # type: ignore[assignment]
    h.step([BatchEntry("a", 0, 12)])
    packed = counted.prefills
    assert packed > 0
    backend.max_packed_bytes = 0  # every piece over the bound
    h.step([BatchEntry("a", 12, 5), BatchEntry("b", 0, 3)])
    assert counted.prefills == packed
