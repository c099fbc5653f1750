"""Finite inputs always give finite attention (issue 35.3): q, k and v are bounded (config.ModelShape.value_limits)
so that no score, weight or weighted sum can overflow float32 in any backend, and a value past a bound is refused
before anything is written, naming the tensor, its row and the bound.

Covered:

* the review's cases: q = k = 1e20 (every output was NaN, prefill and decode, both backends) and q = 3e38 (decode
  NaN) are INVALID_ARGUMENT now, as is v = 3e38 (its weighted sum overflowed); nothing is written;
* values at the bounds themselves, every sign pattern that maximises a score, in every backend (torch's flash and
  float32 paths, native, triton under the interpreter), compute dtype and cache dtype (float8 calibrated to them),
  prefill and decode, GQA, ALiBi and KV sharing: every output finite and inside its values' range (a weighted
  average of v), and prefill and decode agree where they see the same keys;
* random magnitudes up to the bounds (hypothesis): the same, and equal to the float64 reference wherever scores
  stay small enough for float32 to tell them apart;
* the math path's softmax keeps its weights summing to 1 however large the scores (it used exp(s - logsumexp),
  whose weights added up to the key count once a score absorbed the log of the sum);
* what could move the bounds is refused at start: a softmax scale past 2^8, ALiBi slopes past 2^32, float8
  scales past 2^48; an imported KV record past the bounds is refused as Attend would refuse its k or v.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkattn_client import BatchEntry
from chunkattn_client.reference import chunked_attention
from chunkattn_server import LayerSpec, ModelShape
from chunkattn_server.config import V_LIMIT, qk_limit
from chunkattn_server.errors import ConfigError, InvalidTensor
from chunkattn_server.kv.scales import MAX_SCALE, KVScales
from chunkattn_server.torchtypes import storable
from tests.helpers.harness import MODELS, NATIVE, Harness, snapshot

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ["auto", "math", NATIVE]


def _build(model: str, impl: str, dtype: str, cache: str | None = None) -> Harness:
    scales = KVScales(calibrate=True) if cache and "fp8" in cache else None
    # float16 compute on the CPU only when asked; a float cache other than the wire dtype computes in the wire's
    compute = dtype if dtype == "float16" or cache in ("float16", "bfloat16") else "auto"
    return Harness.build(
        MODELS[model], impl=impl, dtype=dtype, cache_dtype=cache, kv_scales=scales, compute_dtype=compute
    )


def _limits(h: Harness, layer: int) -> tuple[float, float, float]:
    """The largest |q|, |k| and |v| the layer takes in the harness's dtypes."""
    largest = min(torch.finfo(DT[h.dtype]).max, torch.finfo(h.engine.dtype).max)
    qk, v = h.model.value_limits(layer)
    held = storable(h.engine.cache_dtype, h.engine.dtype)
    return min(qk, largest), min(qk, largest, held), min(v, largest, held)


def _inside_values(out: torch.Tensor, v: torch.Tensor, h: Harness) -> bool:
    """Every output element within [min v, max v] of its KV head's values (a softmax weighting of them), with
    room for the output dtype's rounding."""
    q_per_kv = h.model.num_heads // h.model.num_kv_heads
    vv = v.float().repeat_interleave(q_per_kv, dim=1)  # [T, H, D]
    low, high = vv.amin(dim=0), vv.amax(dim=0)
    slack = (high - low).abs() * 1e-2 + high.abs().maximum(low.abs()) * 1e-2
    o = out.float()
    return bool(torch.isfinite(o).all() and ((o >= low - slack) & (o <= high + slack)).all())


# -- the review's cases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize(
    ("name", "q", "k", "v", "bound"),
    [
        ("q", 1e20, 1e20, 1.0, "2^48"),  # every output was NaN
        ("q", 3e38, 1.0, 1.0, "2^48"),  # decode NaN
        ("k", 1.0, -3e30, 1.0, "2^48"),
        ("v", 1.0, 1.0, 3e38, "2^64"),  # a sum of values overflowed
    ],
)
def test_values_past_the_bounds_are_refused_naming_them_and_write_nothing(
    impl: str, name: str, q: float, k: float, v: float, bound: str
) -> None:
    h = _build("gqa", impl, "float32")
    m = h.model
    first = [BatchEntry("s", 0, 5)]
    h.engine.attend(
        2, first, *(torch.ones(5, n, m.head_size) for n in (m.num_heads, m.num_kv_heads, m.num_kv_heads)), tenant=""
    )
    before, pages = snapshot(h.engine), [t.clone() for t in (*h.engine.cache.k, *h.engine.cache.v)]
    for position, n in ((5, 7), (5, 1)):  # a prefill and a decode
        tensors = [torch.ones(n, heads, m.head_size) for heads in (m.num_heads, m.num_kv_heads, m.num_kv_heads)]
        for t, x in zip(tensors, (q, k, v), strict=True):
            t[-1, 0, 1] = x
        with pytest.raises(InvalidTensor) as e:
            h.engine.attend(2, [BatchEntry("s", position, n)], *tensors, tenant="")
        message = str(e.value)
        assert message.startswith(f"{name} row {n - 1} (sequence 's' at position {position + n - 1}) holds"), message
        assert f"({bound}), the largest |{name}| this layer takes" in message
        assert snapshot(h.engine) == before
        assert all(torch.equal(a, b) for a, b in zip(pages, (*h.engine.cache.k, *h.engine.cache.v), strict=True))


def test_the_bounds_follow_the_head_size_and_the_scale() -> None:
    assert qk_limit(128, 128**-0.5) == 2.0**46  # 128 * 2^92 <= 2^100
    assert qk_limit(16, 0.25) == 2.0**48
    assert qk_limit(1024, 1.0) == 2.0**45
    assert qk_limit(128, 256.0) == 2.0**42  # a scale above 1 counts
    for d in (1, 7, 64, 128, 1000, 4096):
        for scale in (1e-3, 0.1, 1.0, 3.0, 256.0):
            b = qk_limit(d, scale)
            assert d * b * b * max(1.0, scale) <= 2.0**100 < d * (2 * b) ** 2 * max(1.0, scale)
    assert V_LIMIT == 2.0**64


# -- at the bounds ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [None, "fp8_e4m3", "fp8_e5m2", "float16", "bfloat16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("model", ["gqa", "alibi", "sharing"])
def test_inputs_at_the_bounds_give_finite_outputs_within_their_values(
    model: str, impl: str, dtype: str, cache: str | None
) -> None:
    """q and k at +-bound with the signs that make every score as large as it can be (all alike), or alternate
    (scores of both signs, the largest differences), v at its bound: prefill, then decodes."""
    h = _build(model, impl, dtype, cache)
    m, dt = h.model, DT[dtype]
    for layer, spec in enumerate(m.layers):
        ql, kl, vl = _limits(h, layer)
        writes = spec.kv_source is None
        for position, n, alternate in ((0, 9, False), (9, 1, True), (10, 1, False)):
            q = torch.full((n, m.num_heads, m.head_size), ql)
            k = torch.full((n, m.num_kv_heads, m.head_size), kl)
            v = torch.full((n, m.num_kv_heads, m.head_size), vl)
            if alternate:
                k[:, :, 1::2], v[:, 1::2] = -kl, -vl
            entries = [BatchEntry("s", position, n)]
            out = h.engine.attend(
                layer, entries, q.to(dt), k.to(dt) if writes else None, v.to(dt) if writes else None, tenant=""
            )
            assert torch.isfinite(out.float()).all(), (layer, position)
            assert out.float().abs().max() <= vl * 1.01, (layer, position)


@pytest.mark.parametrize("impl", ["math", "auto", NATIVE])
def test_equal_scores_of_any_size_weigh_each_key_alike(impl: str) -> None:
    """Scores of 2^34 (q = k = 2^14 in float16 compute, 16 dims): 9 keys of value 1 give 1, not 9 (the float32
    path's weights summed to the key count)."""
    h = _build("gqa", impl, "float16")
    m = h.model
    q = torch.full((9, m.num_heads, m.head_size), 2.0**14, dtype=torch.float16)
    k = torch.full((9, m.num_kv_heads, m.head_size), 2.0**14, dtype=torch.float16)
    v = torch.ones(9, m.num_kv_heads, m.head_size, dtype=torch.float16)
    out = h.engine.attend(0, [BatchEntry("s", 0, 9)], q, k, v, tenant="")
    assert torch.equal(out, torch.ones_like(out))


def test_the_triton_kernels_stay_finite_at_the_bounds() -> None:
    h = Harness.build(MODELS["gqa"], impl="triton")
    m = h.model
    qk, _, vl = _limits(h, 2)
    for position, n in ((0, 5), (5, 1)):
        q = torch.full((n, m.num_heads, m.head_size), qk)
        k = torch.full((n, m.num_kv_heads, m.head_size), qk)
        k[:, :, 1::2] = -qk
        out = h.engine.attend(2, [BatchEntry("s", position, n)], q, k, torch.full_like(k, vl), tenant="")
        assert torch.isfinite(out).all()
        assert out.abs().max() <= vl * 1.01


# -- random magnitudes ---------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["auto", "math"]),
    st.sampled_from(["float32", "bfloat16"]),
    st.floats(-3, 46),
    st.floats(-3, 64),
    st.integers(0, 2**32 - 1),
)
def test_random_magnitudes_up_to_the_bounds(impl: str, dtype: str, qk_log2: float, v_log2: float, seed: int) -> None:
    """q, k ~ N(0, 1) * 2^qk_log2, v ~ N(0, 1) * 2^v_log2 (clipped to the bounds), one prefill and one decode
    on a global layer: finite, within the values, and the reference's answer where float32 scores can still
    tell the keys apart (every score below 2^20)."""
    h = _build("gqa", impl, dtype)
    m, layer, dt = h.model, 2, DT[dtype]
    qk, _, vl = _limits(h, layer)
    g = torch.Generator().manual_seed(seed)

    def sample(n: int, heads: int, log2: float, limit: float) -> torch.Tensor:
        x: torch.Tensor = torch.randn(n, heads, m.head_size, generator=g) * 2.0**log2
        return x.clamp(-limit, limit).to(dt)

    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for position, n in ((0, 6), (6, 1)):
        q, k, v = (sample(n, m.num_heads, qk_log2, qk), sample(n, m.num_kv_heads, qk_log2, qk),
                   sample(n, m.num_kv_heads, v_log2, vl))  # fmt: skip
        out = h.engine.attend(layer, [BatchEntry("s", position, n)], q, k, v, tenant="")
        ks.append(k)
        vs.append(v)
        assert _inside_values(out, torch.cat(vs), h)
        if 2 * qk_log2 + math.log2(m.head_size) < 18:  # small scores: float32 resolves them
            want = chunked_attention(
                q.double().numpy(), torch.cat(ks).double().numpy(), torch.cat(vs).double().numpy(),
                list(range(position, position + n)), chunk_size=0,
            )  # fmt: skip
            scale = float(np.abs(want).max()) or 1.0
            assert np.abs(out.double().numpy() - want).max() <= 2e-2 * scale


# -- what could move the bounds -------------------------------------------------------------------------------


def test_a_scale_or_slopes_that_would_let_scores_overflow_stop_the_start() -> None:
    with pytest.raises(ConfigError, match=r"scale must be a number in \(0, 256\]"):
        ModelShape(num_heads=2, num_kv_heads=1, head_size=8, layers=(LayerSpec(0, scale=1000.0),))
    with pytest.raises(ConfigError, match=r"alibi_slopes must be finite numbers of at most 4.29497e\+09"):
        ModelShape(num_heads=2, num_kv_heads=1, head_size=8, layers=(LayerSpec(0, alibi_slopes=(1.0, 1e10)),))
    with pytest.raises(ConfigError, match=r"alibi_slopes must be finite"):
        ModelShape(num_heads=2, num_kv_heads=1, head_size=8, layers=(LayerSpec(0, alibi_slopes=(1.0, math.nan)),))
    with pytest.raises(ConfigError, match=r"k_scale 1e\+20 is past 2.81475e\+14 \(2\^48\)"):
        Harness.build(MODELS["mqa"], cache_dtype="fp8_e4m3", kv_scales=KVScales((1e20,), (1.0,)))
    assert MAX_SCALE == 2.0**48


@pytest.mark.parametrize(("compute", "cache", "value"), [("float32", "float16", 1e5), ("bfloat16", "float16", 7e4),
                                                         ("float16", "bfloat16", 65504.0)])  # fmt: skip
def test_k_or_v_the_cache_would_store_as_inf_is_refused(compute: str, cache: str, value: float) -> None:
    """Found by the review of issue 35: a float16 cache stored a float32 1e5 as inf, and a bfloat16 cache
    rounded float16's 65504 to 65536, inf once read back in float16: NaN from there on. K and V are bounded by
    what the cache holds too (the largest power of two both dtypes hold: 2^15 for these)."""
    h = Harness.build(MODELS["gqa"], dtype=compute, cache_dtype=cache, compute_dtype=compute)
    m = h.model
    assert storable(h.engine.cache_dtype, h.engine.dtype) == 2.0**15
    q = torch.ones(3, m.num_heads, m.head_size, dtype=DT[compute])
    for which in ("k", "v"):
        k, v = (torch.ones(3, m.num_kv_heads, m.head_size, dtype=DT[compute]) for _ in range(2))
        (k if which == "k" else v)[1, 0, 0] = value
        with pytest.raises(
            InvalidTensor, match=rf"{which} row 1 .* \(2\^15\), the largest \|{which}\| the server's {cache}"
        ):
            h.engine.attend(0, [BatchEntry("s", 0, 3)], q, k, v, tenant="")
    k = torch.full((3, m.num_kv_heads, m.head_size), 2.0**15, dtype=DT[compute])
    out = h.engine.attend(0, [BatchEntry("s", 0, 3)], q, k, k, tenant="")
    assert torch.isfinite(out.float()).all()
