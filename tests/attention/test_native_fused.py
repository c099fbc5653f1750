"""The native backend's fused path (store_and_decode: a step of decodes stored, planned and computed in one native
call) against its unfused path (the K/V written by torch, the kernel's metadata in numpy: NativeBackend(fused=False))
and the torch backend, on the same calls: the pages bit for bit (the float8 store included), the outputs bit for
bit where the arithmetic is the same (every decode whose key is in the pages), within the dtype's tolerance where
it is not (a padded decode's own key: folded in by log-sum-exp there, read as the last key here). Both sequence and
block calls, several calls in one step, chunk boundaries, GQA / MQA / ALiBi / KV sharing, float32, bfloat16 and
float8 caches. The float64 reference checks the fused path through the harness (tests/engine, tests/kv)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_server.attention.backends import TorchBackend
from chunkattn_server.attention.backends.native.backend import NativeBackend
from chunkattn_server.engine.types import AttendCall
from chunkattn_server.kv.scales import KVScales
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.harness import MODELS, NATIVE_PROBLEM, Harness

pytestmark = [pytest.mark.native, pytest.mark.skipif(bool(NATIVE_PROBLEM), reason=NATIVE_PROBLEM or "built")]

CPU = torch.device("cpu")
CACHES = ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"]


def _three(model: str, cache: str, compute: str = "auto") -> tuple[Harness, Harness, Harness]:
    """The same engine thrice: the fused native path, the unfused one, and the torch backend."""
    scales = KVScales(calibrate=True) if cache.startswith("fp8") else None
    built = [
        Harness.build(MODELS[model], cache_dtype=cache, compute_dtype=compute, kv_scales=scales, impl=impl)
        for impl in ("native", "native", "auto")
    ]
    built[1].engine.backend = NativeBackend(CPU, fused=False)
    fused = built[0].engine.backend
    assert isinstance(fused, NativeBackend)
    assert fused.fused
    assert isinstance(built[2].engine.backend, TorchBackend)
    FUSED_CALLS[built[0].engine] = 0
    served = fused.store_and_decode

    def counted(*args: Any, **kwargs: Any) -> None:
        FUSED_CALLS[built[0].engine] += 1
        served(*args, **kwargs)

    fused.store_and_decode = counted  # type: ignore[method-assign]
    return built[0], built[1], built[2]


FUSED_CALLS: dict[object, int] = {}  # per fused engine: the steps it served in one native call


def _same_pages(a: Harness, b: Harness) -> None:
    for x, y in zip((*a.engine.cache.k, *a.engine.cache.v), (*b.engine.cache.k, *b.engine.cache.v), strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def _tensors(
    g: torch.Generator, h: Harness, layer: int, tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    model = h.model
    q = torch.randn(tokens, model.num_heads, model.head_size, generator=g).to(dtype)
    if model.layers[layer].kv_source is not None:
        return q, None, None
    k = torch.randn(tokens, model.num_kv_heads, model.head_size, generator=g).to(dtype)
    v = torch.randn(tokens, model.num_kv_heads, model.head_size, generator=g).to(dtype)
    return q, k, v


def _close(a: torch.Tensor, b: torch.Tensor, dtype: str) -> bool:
    tol = 1e-5 if dtype == "float32" else 2e-2
    return bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_sequence_steps_of_several_calls_equal_the_unfused_path_bit_for_bit(model: str, cache: str) -> None:
    """Prefills (the mixed path), then decode steps of two calls each (a, b | c), across chunk boundaries (C = 4,
    8, 16 and global layers), every layer in order: outputs and pages equal the unfused path's exactly, and the
    torch backend's within tolerance."""
    fused, unfused, torch_h = _three(model, cache)
    g = torch.Generator().manual_seed(7)
    steps = [[[("a", 0, 6), ("b", 0, 3)], [("c", 0, 10)]]]
    steps += [[[("a", 6 + i, 1), ("b", 3 + i, 1)], [("c", 10 + i, 1)]] for i in range(19)]
    for step in steps:
        for layer in range(fused.model.num_layers):
            calls = []
            for entries in step:
                tensors = _tensors(g, fused, layer, sum(n for _, _, n in entries), torch.float32)
                calls.append(AttendCall(tuple(BatchEntry(*e) for e in entries), *tensors, ""))
            outs = [h.engine.attend_step(layer, calls) for h in (fused, unfused, torch_h)]
            for got, want, loose in zip(*outs, strict=True):
                assert isinstance(got, torch.Tensor), got
                assert torch.equal(got, want), f"layer {layer}, step {step}"
                assert _close(got, loose, "float32" if cache == "float32" else "bfloat16")
        _same_pages(fused, unfused)
        _same_pages(fused, torch_h)  # the torch backend's store is the unfused path's: the same bytes
    assert FUSED_CALLS[fused.engine] == 19 * fused.model.num_layers  # every decode step, never the prefill


@pytest.mark.parametrize("cache", ["bfloat16", "fp8_e4m3"])
def test_a_bfloat16_compute_stores_and_decodes_as_the_unfused_path(cache: str) -> None:
    fused, unfused, _ = _three("gqa", cache, compute="bfloat16")
    g = torch.Generator().manual_seed(3)
    for i, (position, n) in enumerate([(0, 13), *((13 + j, 1) for j in range(12))]):
        for layer in range(fused.model.num_layers):
            q, k, v = _tensors(g, fused, layer, n, torch.bfloat16 if i % 2 else torch.float32)
            entries = [BatchEntry("s", position, n)]
            got, want = (h.engine.attend(layer, entries, q, k, v, tenant="") for h in (fused, unfused))
            assert got.dtype == q.dtype
            assert torch.equal(got, want)
    _same_pages(fused, unfused)
    assert FUSED_CALLS[fused.engine] == 12 * fused.model.num_layers


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("model", ["gqa", "alibi", "sharing"])
def test_block_calls_with_padded_decodes_equal_the_unfused_path(model: str, cache: str) -> None:
    """Block calls: decode rows beside padded ones (slot -1: the key read from the call, not the pages), a
    padded row at its chunk's first position included. The pages equal the unfused path's exactly, the written
    rows' outputs too, the padded rows' within tolerance (the own key is folded in differently)."""
    fused, unfused, _ = _three(model, cache)
    g = torch.Generator().manual_seed(5)
    spaces = [h.engine.open_space(16, [], tenant="t") for h in (fused, unfused)]
    mgr = KVCacheManager(16, 4, seed=9)
    padded_seen = 0
    plan = [[("a", 0, 8), ("b", 0, 6)], *[[("a", 8 + i, 1), ("b", 6 + i, 1)] for i in range(6)]]
    for i, entries in enumerate(plan):
        mgr.schedule(entries)
        for layer, spec in enumerate(fused.model.layers):
            q, k, v = _tensors(g, fused, layer, sum(n for _, _, n in entries), torch.float32)
            outs = []
            for h, space in zip((fused, unfused), spaces, strict=True):
                call = mgr.call(space.space_id, "t", entries, spec.chunk_size, q, k, v)
                pad = i % 2 == 1 and k is not None  # a's decode is padding (a KV-sharing layer refuses it)
                if pad:
                    call = dataclasses.replace(call, slots=np.array([-1, call.slots[1]]))
                (out,) = h.engine.attend_blocks(layer, [call])
                assert isinstance(out, torch.Tensor), out
                outs.append(out)
            if i and k is not None and i % 2 == 1:
                padded_seen += 1
                assert torch.equal(outs[0][1], outs[1][1])
                assert _close(outs[0][0], outs[1][0], "float32" if cache == "float32" else "bfloat16")
            else:
                assert torch.equal(outs[0], outs[1])
        _same_pages(fused, unfused)
    assert padded_seen
    assert FUSED_CALLS[fused.engine] == 6 * fused.model.num_layers


def test_a_slot_outside_the_pages_is_refused_before_anything_is_written() -> None:
    fused, _, _ = _three("mqa", "float32")
    engine = fused.engine
    backend = engine.backend
    assert isinstance(backend, NativeBackend)
    q = torch.randn(1, 4, 8)
    k = torch.randn(1, 1, 8)
    before = [t.clone() for t in (*engine.cache.k, *engine.cache.v)]
    out = torch.empty(q.shape)
    pages = engine.cache.k[0], engine.cache.v[0]
    slots = np.array([engine.cache.num_blocks * 4], np.int64)
    with pytest.raises(RuntimeError, match=r"slot \d+ of row 0 is not in the pages"):
        backend.store_and_decode(q, k, k, slots, *pages, [(0, 0, 1)], [{0: 0}], [], 4, 1.0, None, (1.0, 1.0), out)
    with pytest.raises(RuntimeError, match="its table has no logical block 1"):
        backend.store_and_decode(
            q, k, k, np.array([0]), *pages, [(0, 5, 1)], [{0: 0}], [], 8, 1.0, None, (1.0, 1.0), out
        )
    assert all(torch.equal(a, b) for a, b in zip(before, (*engine.cache.k, *engine.cache.v), strict=True))
