"""Chunked groups hold at most C / block_size blocks per sequence, whatever the sequence's length."""

from __future__ import annotations

import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape

TINY = {"num_heads": 1, "num_kv_heads": 1, "head_size": 4}  # the bound is about blocks, not compute


def _grow(engine: Engine, total: int, piece: int, layers: int) -> list[int]:
    """Prefill `total` tokens in pieces of `piece` through every layer; blocks held after each step."""
    held = []
    pos = 0
    g = torch.Generator().manual_seed(0)
    while pos < total:
        n = min(piece, total - pos)
        for layer in range(layers):
            q = torch.randn(n, 1, 4, generator=g)
            engine.attend(layer, [BatchEntry("long", pos, n)], q, q[:, :1], q[:, :1], tenant="")
        pos += n
        held.append(engine.kv.sequence("long", tenant="").num_blocks)
    return held


@pytest.mark.parametrize(
    ("total", "chunk", "piece"),
    [(200_000, 4096, 5000), pytest.param(1_000_000, 8192, 30_000, marks=pytest.mark.slow)],
)
def test_chunked_layers_hold_one_chunk(total: int, chunk: int, piece: int) -> None:
    """200,000 tokens with C = 4096 hold <= 256 blocks; 1,000,000 with C = 8192 hold <= 512."""
    model = ModelShape(layers=(LayerSpec(chunk), LayerSpec(chunk)), **TINY)
    engine = Engine(EngineConfig(model, CacheConfig(block_size=16, num_blocks=2 * (piece // 16 + 2)), device="cpu"))
    held = _grow(engine, total, piece, layers=2)
    bound = chunk // 16
    assert max(held) <= bound, f"held up to {max(held)} blocks, bound {bound}"
    assert engine.kv.sequence("long", tenant="").lengths == (total, total)
    assert engine.stats().used_blocks == held[-1]
    engine.kv.release(["long"], tenant="")
    assert engine.stats().used_blocks == 0


def test_a_long_single_call_prefill_allocates_only_its_last_chunk() -> None:
    """100,000 tokens in one call on a C = 8192 layer fit in a pool of 600 blocks (the prompt alone is 6250)."""
    model = ModelShape(layers=(LayerSpec(8192),), **TINY)
    engine = Engine(EngineConfig(model, CacheConfig(block_size=16, num_blocks=600), device="cpu"))
    assert _grow(engine, 100_000, 100_000, layers=1) == [-(-(100_000 - 98_304) // 16)]


def test_global_layers_keep_everything_and_release_returns_it() -> None:
    model = ModelShape(layers=(LayerSpec(64), LayerSpec(0)), **TINY)
    engine = Engine(EngineConfig(model, CacheConfig(block_size=16, num_blocks=200), device="cpu"))
    held = _grow(engine, 1000, 100, layers=2)
    tables = engine.kv.sequence("long", tenant="").tables
    assert len(tables[1]) == -(-1000 // 16)  # the global group: every block
    assert len(tables[0]) <= 64 // 16
    assert held[-1] == len(tables[0]) + len(tables[1])
    engine.kv.release(["long"], tenant="")
    assert engine.stats().free_blocks == 200
