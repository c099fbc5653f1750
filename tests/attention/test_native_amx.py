"""The AMX build's tile path (attention/backends/native/decode.cpp, amx::attend_range): decodes in a bfloat16
compute over bfloat16 and float8 caches, on the tiles where a KV head has enough query heads (the module's
``amx_min_heads``), against the float64 reference through the harness; and a padded block-API decode (its own key
read from the call, not the pages) through the tiles against the vector units of the same build.

The shapes reach the tile path's cases: a head size that is a multiple of 32 over blocks of 16 (16 keys of one
block are loaded into a tile straight from the pages) and one that is not (20: rows copied into a scratch tile,
padded with zeros), float8 codes converted to bfloat16, 32-key tiles cut short at a chunk's end, chunk and global
layers, ALiBi, more query heads than one pass of 16 (17 per KV head), and NaN in every free block. On a CPU without
AMX (or where Linux refuses the tiles) the tile path cannot run and these tests skip, saying so;
test_native_isa.py checks the builds that CPU runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_server import LayerSpec, ModelShape
from chunkattn_server.attention.backends.native import build
from chunkattn_server.attention.backends.native.backend import NativeBackend
from chunkattn_server.kv.scales import KVScales
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.harness import NATIVE_PROBLEM, Harness

pytestmark = [
    pytest.mark.native,
    pytest.mark.skipif(bool(NATIVE_PROBLEM), reason=NATIVE_PROBLEM or "built"),
    pytest.mark.skipif(
        not NATIVE_PROBLEM and build.isa() != "AMX",
        reason=f"this process loads the {build.isa()} build (this CPU runs {build.cpu_isa()} at widest: without AMX"
        " tiles for bfloat16, or Linux refusing them, or CHUNKATTN_NATIVE_ISA forcing a narrower build): the tile"
        " path cannot run here",
    ),
]

CPU = torch.device("cpu")


def _alibi(heads: int) -> tuple[float, ...]:
    return tuple(2.0 ** -(1 + h / 4) for h in range(heads))


# 8 query heads per KV head (bfloat16 pages take the tiles from 8), head size 32.
BF16_TILES = ModelShape(
    num_heads=16,
    num_kv_heads=2,
    head_size=32,
    layers=(LayerSpec(32), LayerSpec(0, alibi_slopes=_alibi(16)), LayerSpec(64)),
)
# 17 query heads on one KV head (float8 pages take the tiles from 16; 17: a pass of 16 and one of 1), head size 20.
FP8_TILES = ModelShape(
    num_heads=17,
    num_kv_heads=1,
    head_size=20,
    layers=(LayerSpec(16), LayerSpec(0, alibi_slopes=_alibi(17))),
)
SCALES = KVScales((0.05,), (0.02,))

CASES = [
    ("bf16-direct", BF16_TILES, "bfloat16", 16),
    ("bf16-scratch", BF16_TILES, "bfloat16", 4),
    ("e4m3", FP8_TILES, "fp8_e4m3", 4),
    ("e5m2", FP8_TILES, "fp8_e5m2", 16),
    ("e4m3-direct-shape", dataclasses.replace(FP8_TILES, head_size=32), "fp8_e4m3", 16),
]


def _kernel(h: Harness) -> NativeBackend:
    backend = h.engine.backend
    assert isinstance(backend, NativeBackend)
    return backend


def _takes_tiles(h: Harness) -> None:
    """The harness's layers decode on the tiles: the AMX build, the tiles granted, enough heads per KV head."""
    kernel = _kernel(h)._kernel
    assert kernel.__name__ == build.module_name("AMX")
    assert kernel.amx
    pages = h.engine.cache.k[0]
    assert h.model.num_heads // h.model.num_kv_heads >= kernel.amx_min_heads[str(pages.dtype).removeprefix("torch.")]


def _poison(h: Harness) -> None:
    """NaN in every free block of every plane (float8: the NaN code), so that a read of one shows."""
    engine = h.engine
    free = torch.tensor([b for b in range(engine.pool.num_blocks) if engine.pool.is_free(b)], dtype=torch.int64)
    for pages in (*engine.cache.k, *engine.cache.v):
        if pages.dtype.itemsize == 1:
            pages.view(torch.uint8).index_fill_(1, free, 0x7F)
        else:
            pages.index_fill_(1, free, float("nan"))


@pytest.mark.parametrize(("name", "shape", "cache", "block_size"), CASES, ids=[c[0] for c in CASES])
def test_tile_decodes_match_the_reference(name: str, shape: ModelShape, cache: str, block_size: int) -> None:
    """Two sequences prefilled side by side (their blocks interleaved in the pool) across chunk boundaries, then
    decodes of both across the next ones, reading up to 51 keys (two 32-key tiles, the second cut short); the
    harness checks every call against the float64 reference."""
    scales = SCALES if cache.startswith("fp8") else None
    h = Harness.build(
        shape, dtype="bfloat16", compute_dtype="bfloat16", cache_dtype=cache, kv_scales=scales, impl="native",
        block_size=block_size,
    )  # fmt: skip
    _takes_tiles(h)
    long = 45
    h.step([BatchEntry("a", 0, 20), BatchEntry("b", 0, 1)])
    h.step([BatchEntry("a", 20, long - 20), BatchEntry("b", 1, 3)])
    _poison(h)
    for i in range(6):
        h.step([BatchEntry("a", long + i, 1), BatchEntry("b", 4 + i, 1)])


@pytest.mark.parametrize("cache", ["bfloat16", "fp8_e5m2"])
def test_a_padded_decode_on_the_tiles_equals_the_vector_units(cache: str) -> None:
    """Block calls whose first row is padding (slot -1: its key read from the call), on the tiles against the
    same build's vector units (``use_tiles("never")``), within bfloat16's tolerance of each other, the written row
    too; the vector units are checked against the reference in test_native_isa.py and test_native_fused.py."""
    shape = FP8_TILES if cache.startswith("fp8") else BF16_TILES
    scales = SCALES if cache.startswith("fp8") else None
    tiles, vectors = (
        Harness.build(shape, dtype="bfloat16", compute_dtype="bfloat16", cache_dtype=cache, kv_scales=scales,
                      impl="native", block_size=16)
        for _ in range(2)
    )  # fmt: skip
    _takes_tiles(tiles)
    kernel = _kernel(tiles)._kernel
    g = torch.Generator().manual_seed(5)
    spaces = [h.engine.open_space(16, [], tenant="t") for h in (tiles, vectors)]
    mgr = KVCacheManager(16, 16, seed=9)
    plan = [[("a", 0, 40), ("b", 0, 6)], *[[("a", 40 + i, 1), ("b", 6 + i, 1)] for i in range(4)]]
    for i, entries in enumerate(plan):
        mgr.schedule(entries)
        for layer, spec in enumerate(shape.layers):
            tokens = sum(n for _, _, n in entries)
            q, k, v = (torch.randn(tokens, heads, shape.head_size, generator=g).to(torch.bfloat16)
                       for heads in (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads))  # fmt: skip
            outs = []
            for h, space, on in zip((tiles, vectors), spaces, (True, False), strict=True):
                call = mgr.call(space.space_id, "t", entries, spec.chunk_size, q, k, v)
                if i:  # a's decode is padding
                    call = dataclasses.replace(call, slots=np.array([-1, call.slots[1]]))
                kernel.use_tiles("auto" if on else "never")
                try:
                    (out,) = h.engine.attend_blocks(layer, [call])
                finally:
                    kernel.use_tiles("auto")
                assert isinstance(out, torch.Tensor), out
                outs.append(out.float())
            assert torch.allclose(outs[0], outs[1], atol=2e-2, rtol=2e-2), (i, layer)


def test_sixteen_keys_over_small_scattered_blocks_are_not_read_as_one_run() -> None:
    """Blocks of 4, the table [0, 9, 10, 3, 5]: key 0 (block 0, row 0) and key 15 (block 3, row 3) are 15 page rows
    apart with blocks 9 and 10 between them in the table, so one tile load of 16 consecutive rows from key 0's
    would read blocks 1 and 2. The tiles (forced) give the vector units' answer, both near the float64 one."""
    kernel = build.load()
    gen = torch.Generator().manual_seed(0)
    heads, d, bs = 8, 64, 4
    k_pages, v_pages = (torch.randn(1, 16, bs, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(1, heads, d, generator=gen).to(torch.bfloat16)
    table = np.array([0, 9, 10, 3, 5], np.int64)
    keys = [table[j // bs] * bs + j % bs for j in range(16)]
    k = k_pages[0].reshape(-1, d)[keys].double()
    v = v_pages[0].reshape(-1, d)[keys].double()
    want = torch.softmax(q[0].double() @ k.T * d**-0.5, -1) @ v
    outs = {}
    for mode in ("never", "always"):
        kernel.use_tiles(mode)
        try:
            out = torch.empty(1, heads, d, dtype=torch.bfloat16)
            kernel.store_and_decode(
                q, None, None, None, k_pages, v_pages, [(0, 15, 1)], [table], None, [], 0, out, d**-0.5, 1.0, 1.0, None
            )
        finally:
            kernel.use_tiles("auto")
        outs[mode] = out[0].double()
    for out in outs.values():
        assert (out - want).abs().max() < 2e-2
