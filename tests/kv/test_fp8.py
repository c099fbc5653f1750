"""A float8 KV cache (vLLM's kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2 with per-layer k/v scales).

The engine is held to the float64 reference computed on K/V as the cache gives them back (numpy's
rounding of x / scale to float8, not the engine's torch code), within the compute dtype's tolerance; and to
the unquantized reference within the bound documented in docs/server.md (``_BOUND``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from chunkattn_client import BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel, dtypes
from chunkattn_client.cli import main
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape, torchtypes
from chunkattn_server.errors import ConfigError, IncompatibleKV, InvalidTensor
from chunkattn_server.kv.manifest import BlockRecord, batches, checksum
from chunkattn_server.kv.scales import KVScales
from tests.helpers.harness import MODELS, NATIVE, Harness
from tests.helpers.server_process import SMALL, ServerProcess

FP8 = ["fp8_e4m3", "fp8_e5m2"]
SCALES = KVScales((0.05,), (0.02,))  # N(0, 1) K/V land well inside both formats' normal range


def _steps(h: Harness, long: int = 21) -> None:
    """A prefill across chunk boundaries beside a fresh decode, then decodes across the next boundary and a
    prefill piece after them: every path that reads the cache (views, gathers, KV sharing, global)."""
    h.step([BatchEntry("a", 0, long), BatchEntry("b", 0, 1)])
    for i in range(4):
        h.step([BatchEntry("a", long + i, 1), BatchEntry("b", 1 + i, 1)])
    h.step([BatchEntry("a", long + 4, 1), BatchEntry("b", 5, 7)])


# -- the format: torch's rounding is numpy's, bit for bit -----------------------------------------------


@pytest.mark.parametrize("name", FP8)
def test_torch_stores_what_numpy_rounds_bit_for_bit(name: str) -> None:
    d = dtypes.lookup(name)
    g = torch.Generator().manual_seed(1)
    values = torch.cat(
        [
            torch.randn(20_000, generator=g) * 10.0 ** torch.randint(-9, 6, (20_000,), generator=g),
            torch.tensor([0.0, -0.0, d.max, -d.max, d.max * 1.5, 1e30, -1e30, float("inf"), float("-inf")]),
            torch.from_numpy(dtypes.fp8_values(name)[np.isfinite(dtypes.fp8_values(name))].astype(np.float32)),
        ]
    )
    for scale in (1.0, 0.037, 3.0):
        stored = torchtypes.store(values, scale, torchtypes.of(name))
        want = dtypes.fp8_round(values.numpy() / np.float32(scale), name)
        got = stored.float().double().numpy()
        assert np.array_equal(got, want), f"scale {scale}: {np.flatnonzero(got != want)[:5]}"
        codes = stored.view(torch.uint8).numpy()
        assert np.array_equal(dtypes.fp8_decode(codes, name), want)


@pytest.mark.parametrize("name", FP8)
def test_writes_saturate_instead_of_overflowing(name: str) -> None:
    big = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), 3e38])
    stored = torchtypes.store(big, 1.0, torchtypes.of(name)).float()
    assert torch.equal(stored.abs(), torch.full_like(stored, dtypes.lookup(name).max))


# -- the engine against the references ------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["auto", "math", NATIVE])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("name", FP8)
def test_every_model_kind_matches_the_reference_on_the_cached_values(name: str, model: str, impl: str) -> None:
    """GQA, MQA, ALiBi, KV sharing and global layers; the CPU flash path and the float32 math path."""
    h = Harness.build(MODELS[model], cache_dtype=name, kv_scales=SCALES, impl=impl)
    assert h.engine.cache.k[0].dtype == torchtypes.of(name)
    _steps(h)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_queries_over_a_float8_cache(dtype: str) -> None:
    """q/k/v sent in half precision, computed in float32 (the CPU default) over the float8 cache; the
    output comes back in q's dtype."""
    h = Harness.build(MODELS["gqa"], dtype=dtype, cache_dtype="fp8", kv_scales=SCALES)
    _steps(h)


# Measured, not proved: the output against the unquantized reference stays within 2 eps * max |v|, with eps
# = 2^-(mantissa bits + 1) the format's relative rounding error (e4m3 1/16, e5m2 1/8). On these N(0, 1)
# shapes the error measured is about a third of it (e4m3 0.15, e5m2 0.30 with max |v| ~ 4.5).
def _bound(name: str, v_max: float) -> float:
    eps = 2.0 ** -(dtypes.lookup(name).mantissa_bits + 1)
    return 2 * eps * v_max


@pytest.mark.parametrize("name", FP8)
def test_against_the_unquantized_reference_within_the_documented_bound(name: str) -> None:
    model = MODELS["sharing"]
    h = Harness.build(model, cache_dtype=name, kv_scales=KVScales(calibrate=True))
    plain = ReferenceModel([s.chunk_size for s in model.layers], kv_sources=[s.kv_source for s in model.layers])
    worst = 0.0
    v_max = [0.0] * model.num_layers  # per writing layer: the largest |v| it was sent
    for entries in ([BatchEntry("a", 0, 30)], *([BatchEntry("a", 30 + i, 1)] for i in range(4))):
        for layer, spec in enumerate(model.layers):
            seed = h.seed
            q, k, v = h.tensors(layer, sum(e.num_tokens for e in entries))
            h.seed = seed  # h.call draws the same tensors again
            out = h.call(layer, entries).double().numpy()
            kd = None if k is None else k.double().numpy()
            vd = None if v is None else v.double().numpy()
            want = plain.attend(layer, entries, q.double().numpy(), kd, vd)
            source = layer if spec.kv_source is None else spec.kv_source
            if v is not None:
                v_max[layer] = max(v_max[layer], float(v.abs().max()))
            err = float(np.abs(out - want).max())
            assert err <= _bound(name, v_max[source]), f"layer {layer}: {err} > {_bound(name, v_max[source])}"
            worst = max(worst, err)
    assert worst > 0  # the cache did quantize


def test_large_values_saturate_and_stay_finite() -> None:
    """Scale 1 and K/V of standard deviation 1000: most values pass e4m3's 448 and are stored as +-448;
    outputs equal the reference on the saturated values (relative to their size: they are ~448)."""
    model = ModelShape(num_heads=2, num_kv_heads=1, head_size=8, layers=(LayerSpec(8),))
    engine = Engine(EngineConfig(model, CacheConfig(block_size=4, num_blocks=16, dtype="fp8"), device="cpu"))
    reference = ReferenceModel([8])
    g = torch.Generator().manual_seed(2)
    for position, n in ((0, 9), (9, 1), (10, 3)):
        q = torch.randn(n, 2, 8, generator=g) * 0.001  # scores of moderate size over huge keys
        k, v = (torch.randn(n, 1, 8, generator=g) * 1000 for _ in range(2))
        out = engine.attend(0, [BatchEntry("a", position, n)], q, k, v, tenant="").double().numpy()
        k8, v8 = (dtypes.fp8_round(x.numpy(), "float8_e4m3") for x in (k, v))
        assert np.abs(k8).max() == 448
        want = reference.attend(0, [BatchEntry("a", position, n)], q.double().numpy(), k8, v8)
        assert np.abs(out - want).max() <= 1e-6 * 448
    pages = engine.cache.k[0].float()
    assert torch.isfinite(pages).all()
    assert (pages.abs() == 448).any()


def test_blocks_per_mib_double_bfloat16_and_quadruple_float32() -> None:
    model = MODELS["gqa"]

    def blocks(cache: str) -> int:
        config = EngineConfig(model, CacheConfig(block_size=4, memory_bytes=1 << 20, dtype=cache), device="cpu")
        return Engine(config).pool.num_blocks

    assert blocks("fp8") == 2 * blocks("bfloat16") == 4 * blocks("float32")
    assert blocks("fp8_e5m2") == blocks("fp8")


# -- scales: a file, calibration ------------------------------------------------------------------------


def test_a_scales_file_gives_each_layer_its_scales(tmp_path: Path) -> None:
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [0.5, None, 2.0, 2.0], "v_scale": [0.125, None, 4.0, 4.0]}))
    config = EngineConfig(
        MODELS["sharing"],
        CacheConfig(block_size=4, num_blocks=64, dtype="fp8", scales=KVScales.read(str(path))),
        device="cpu",
    )
    engine = Engine(config)
    assert [engine.scales.of(i) for i in range(4)] == [(0.5, 0.125), (0.5, 0.125), (2.0, 4.0), (2.0, 4.0)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"k_scale": 1.0}', "expected a JSON object"),
        ('{"k_scale": [1, 2], "v_scale": 1}', "give one scale, or one per layer"),
        ('{"k_scale": -1, "v_scale": 1}', "positive finite"),
        ('{"k_scale": "big", "v_scale": 1}', "must be a number"),
        ('{"k_scale": [1, 2, 3, 4], "v_scale": [1, 2, 3, 4]}', "reads layer 0's cache"),
        ("not json", "--kv-scales"),
        # issue 27.3: each scale is checked as float32 holds it, and the file is strict
        ('{"k_scale": 1e-50, "v_scale": 1e-50}', r"at least 1.175e-38 .* got 0 as a float32 \(the file says 1e-50\)"),
        ('{"k_scale": 1e-39, "v_scale": 1}', r"got 1e-39 as a float32"),  # a denormal
        ('{"k_scale": 1e39, "v_scale": 1}', r"got inf as a float32 \(the file says 1e\+39\)"),
        ('{"k_scale": 1' + "0" * 400 + ', "v_scale": 1}', r"got inf as a float32 \(the file says 1000"),
        ('{"k_scale": 1, "kscale": 2, "v_scale": 1}', r"unknown keys \['kscale'\]"),
        ('{"k_scale": 1, "v_scale": 1, "calibrate": "no"}', '"calibrate" must be true or false, got "no"'),
        ('{"k_scale": [], "v_scale": 1}', "k_scale is an empty list"),
        ('{"k_scale": 1, "v_scale": 1, "k_scale": 2}', "'k_scale' is given twice at the top level"),
        ('{"k_scale": [1, null], "v_scale": null}', "must be a number or a list"),
    ],
)
def test_bad_scales_files_are_refused_at_start_up(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "scales.json"
    path.write_text(content)

    def start() -> None:
        scales = KVScales.read(str(path))
        EngineConfig(MODELS["sharing"], CacheConfig(block_size=4, num_blocks=64, dtype="fp8", scales=scales))

    with pytest.raises(ConfigError, match=message):
        start()


def test_every_dtype_names_its_largest_value_as_torch_does() -> None:
    for d in dtypes.TABLE:
        assert d.max == torch.finfo(torchtypes.TORCH[d.name]).max, d.name


@pytest.mark.parametrize(("compute", "cache", "largest"), [("float16", "fp8_e5m2", 1.1422), ("float16", "fp8", 146.21)])
def test_scales_whose_saturated_values_overflow_the_compute_dtype_are_refused(
    compute: str, cache: str, largest: float
) -> None:
    """Issue 27.4: 57344 (e5m2's largest) x 2 is past float16's 65504, so it would read back as inf."""
    model = MODELS["gqa"]
    with pytest.raises(ConfigError, match=rf"layer 0's k_scale 2000 .* at most {largest}"):
        Harness.build(
            model, dtype=compute, compute_dtype=compute, cache_dtype=cache, kv_scales=KVScales((2000.0,), (0.5,))
        )
    ok = Harness.build(
        model, dtype=compute, compute_dtype=compute, cache_dtype=cache, kv_scales=KVScales((largest,), (largest,))
    )
    q, k, v = ok.tensors(0, 3)
    assert k is not None
    assert v is not None
    k[0, 0, 0], v[1, 1, 1] = 65504.0, -62000.0  # saturate: stored as the format's largest, read back finite
    assert torch.isfinite(ok.engine.attend(0, [BatchEntry("a", 0, 3)], q, k, v, tenant="")).all()


def test_the_repro_of_issue_27_4_float16_over_e5m2_with_scale_2_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match=r"v_scale 2 times float8_e5m2's largest value 57344 is past float16's"):
        Harness.build(
            MODELS["gqa"],
            dtype="float16",
            compute_dtype="float16",
            cache_dtype="fp8_e5m2",
            kv_scales=KVScales((1.0,), (2.0,)),
        )


def test_a_calibrated_scale_never_overflows_the_compute_dtype() -> None:
    """A first write as large as float16 allows calibrates to the largest safe scale, not past it."""
    h = Harness.build(
        MODELS["gqa"],
        dtype="float16",
        compute_dtype="float16",
        cache_dtype="fp8_e5m2",
        kv_scales=KVScales(calibrate=True),
    )
    q, k, v = h.tensors(0, 4)
    assert k is not None
    assert v is not None
    k[0, 0, 0] = v[0, 0, 0] = 60000.0
    out = h.engine.attend(0, [BatchEntry("a", 0, 4)], q, k, v, tenant="")
    scales = h.engine.scales.of(0)
    assert scales is not None
    assert scales[0] == scales[1] < 1.1423
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("top", "ok"), [(1e-44, False), (1e-37, False), (1e-30, True), (0.0, True)])
def test_a_first_write_whose_scales_would_be_zero_or_denormal_is_refused_and_calibrates_nothing(
    top: float, ok: bool
) -> None:
    """Issue 27.2: K/V of zeros but one 1e-44 made every scale 0 and every later output 0."""
    h = Harness.build(MODELS["gqa"], cache_dtype="fp8", kv_scales=KVScales(calibrate=True))
    q, k, v = h.tensors(0, 4)
    assert k is not None
    assert v is not None
    k.zero_()
    v.zero_()
    k[2, 1, 3] = v[1, 0, 0] = top
    free = h.engine.pool.num_free
    if not ok:
        with pytest.raises(InvalidTensor, match=r"largest \|k\| is .* the smallest this cache can be read back over"):
            h.engine.attend(0, [BatchEntry("a", 0, 4)], q, k, v, tenant="")
        assert h.engine.scales.of(0) is None  # still to calibrate
        assert h.engine.pool.num_free == free  # nothing written
        assert not h.engine.kv.sequence_ids(tenant="")
        return
    h.engine.attend(0, [BatchEntry("a", 0, 4)], q, k, v, tenant="")
    scales = h.engine.scales.of(0)
    assert scales is not None
    assert all(s >= 2.0**-126 for s in scales)  # normal float32s: 1 where everything was 0


def test_a_stream_whose_scales_would_read_back_as_zero_or_inf_is_refused() -> None:
    """A KV stream's scales pass the checks a --kv-scales file does, against this server's compute dtype."""
    src = _engine("fp8")
    _fill(src)
    manifest = src.transfer.export_manifest("s", tenant="")
    dst = _engine("fp8", KVScales(calibrate=True), dtype="float16")
    free = dst.pool.num_free
    for bad, message in [((0.0, 1.0), "got 0"), ((1e-40, 1.0), "got 1e-40"), ((1.0, 2000.0), "past float16's")]:
        forged = dataclasses.replace(manifest, scales=tuple(bad for _ in manifest.scales))
        with pytest.raises(IncompatibleKV, match=message):
            dst.transfer.begin_import(forged, tenant="")
        assert dst.scales.of(0) is None
        assert dst.pool.num_free == free


def test_scales_too_small_for_the_compute_dtype_are_refused_everywhere() -> None:
    """Review of issue 27: with float16 compute a scale of 1e-20 passed (a normal float32), and every value
    read back as 0 in float16. The lowest scale is now compute.tiny / cache.max: in a file, at calibration
    (the largest |k| taken in the compute dtype, as it is stored), and in a KV stream."""
    model = MODELS["gqa"]
    with pytest.raises(ConfigError, match=r"k_scale 1e-20 times float8_e4m3's largest value 448 is below float16's"):
        Harness.build(
            model, dtype="float16", compute_dtype="float16", cache_dtype="fp8", kv_scales=KVScales((1e-20,), (1.0,))
        )
    h = Harness.build(
        model, dtype="float16", compute_dtype="float16", cache_dtype="fp8", kv_scales=KVScales(calibrate=True)
    )
    q, k, v = h.tensors(0, 2)
    assert k is not None
    assert v is not None
    k.zero_()
    k[0, 0, 0] = 1e-5  # a float16 subnormal: its scale (5e-8) reads 448 back as a float16 denormal
    with pytest.raises(InvalidTensor, match=r"largest \|k\| is 1.00136e-05.* at least 2.7248e-05"):
        h.engine.attend(0, [BatchEntry("a", 0, 2)], q, k, v, tenant="")
    assert h.engine.scales.of(0) is None
    src = _engine("fp8", KVScales((1e-20,), (1.0,)))  # float32 compute: a fine scale there
    _fill(src)
    dst = _engine("fp8", KVScales(calibrate=True), dtype="float16")
    with pytest.raises(IncompatibleKV, match="below float16's smallest normal number"):
        _move(src, dst)
    assert dst.scales.of(0) is None


@pytest.mark.parametrize("name", FP8)
def test_a_kv_stream_holding_a_nan_or_an_infinity_is_refused(name: str) -> None:
    """Review of issue 27: NaN codes in a KV stream were imported, and every later query of the sequence got
    a non-finite output. Records are now checked by their bits, as Attend checks q/k/v."""
    src = _engine(name)
    _fill(src)
    nan = {"float8_e4m3": 0x7F, "float8_e5m2": 0x7C}[dtypes.lookup(name).name]  # e4m3fn NaN; e5m2 +inf
    dst = _engine(name)
    free = dst.pool.num_free
    manifest = src.transfer.export_manifest("s", tenant="")
    session = dst.transfer.begin_import(manifest, tenant="")
    records = [r.copy() for r in src.transfer.export_views(manifest, manifest.expected())]
    k = bytearray(records[1].k)
    k[5] = nan
    r = records[1]
    records[1] = BlockRecord(r.layer, r.logical, bytes(k), r.v, checksum(r.layer, r.logical, (bytes(k), r.v)))
    with pytest.raises(IncompatibleKV, match=r"holds a NaN or an infinity"):
        dst.transfer.import_records(session, records)
    dst.transfer.abort_import(session)
    assert dst.pool.num_free == free
    assert not dst.kv.sequence_ids(tenant="")


def test_scales_files_name_every_writing_layer_unless_calibrating() -> None:
    model = MODELS["sharing"]  # layer 1 reads layer 0's cache

    def per_layer(
        k: tuple[float | None, ...], v: tuple[float | None, ...], calibrate: bool = False
    ) -> list[tuple[float, float] | None]:
        return KVScales(k, v, calibrate).per_layer(model.kv_sources)

    with pytest.raises(ConfigError, match="layer 2 writes its own cache but its scales are null"):
        per_layer((0.5, None, None, None), (0.5, None, None, None))
    assert per_layer((0.5, None, None, None), (0.5, None, None, None), calibrate=True)[2] is None
    with pytest.raises(ConfigError, match="layer 1: give both its k_scale and its v_scale"):
        per_layer((0.5, 0.7, 1.0, 1.0), (0.5, None, 1.0, 1.0))


def test_scales_need_a_float8_cache() -> None:
    with pytest.raises(ConfigError, match="float8 cache only"):
        CacheConfig(dtype="bfloat16", scales=SCALES)


def test_calibration_takes_each_layers_scales_from_its_first_write() -> None:
    h = Harness.build(MODELS["sharing"], cache_dtype="fp8", kv_scales=KVScales(calibrate=True))
    assert h.engine.scales.of(0) is None
    q, k, v = h.tensors(0, 12)
    h.engine.attend(0, [BatchEntry("a", 0, 12)], q, k, v, tenant="")
    assert k is not None
    assert v is not None
    want = (float(np.float32(k.abs().max() / 200)), float(np.float32(v.abs().max() / 100)))
    assert h.engine.scales.of(0) == h.engine.scales.of(1) == want  # layer 1 reads layer 0's cache
    assert h.engine.scales.of(2) is None
    h.engine.attend(0, [BatchEntry("a", 12, 1)], *h.tensors(0, 1), tenant="")
    assert h.engine.scales.of(0) == want  # set once


# -- KV transfer ----------------------------------------------------------------------------------------


def _engine(
    cache: str, scales: KVScales | None = SCALES, model: ModelShape = MODELS["gqa"], dtype: str = "auto"
) -> Engine:
    config = CacheConfig(block_size=4, num_blocks=256, dtype=cache, scales=scales if "fp8" in cache else None)
    return Engine(EngineConfig(model, config, device="cpu", dtype=dtype))


def _fill(engine: Engine, seq_id: str = "s", tokens: int = 19) -> None:
    g = torch.Generator().manual_seed(3)
    m = engine.config.model
    for layer, spec in enumerate(m.layers):
        q = torch.randn(tokens, m.num_heads, m.head_size, generator=g)
        k, v = (torch.randn(tokens, m.num_kv_heads, m.head_size, generator=g) for _ in range(2))
        engine.attend(
            layer,
            [BatchEntry(seq_id, 0, tokens)],
            q,
            *((None, None) if spec.kv_source is not None else (k, v)),
            tenant="",
        )


def _move(src: Engine, dst: Engine, seq_id: str = "s") -> None:
    manifest = src.transfer.export_manifest(seq_id, tenant="")
    session = dst.transfer.begin_import(manifest, tenant="")
    try:
        for batch in batches(manifest.expected(), 4):
            dst.transfer.import_records(session, [r.copy() for r in src.transfer.export_views(manifest, batch)])
        dst.transfer.commit_import(session)
    finally:
        dst.transfer.abort_import(session)


def _pages(engine: Engine, seq_id: str) -> list[bytes]:
    """The float8 bytes of every block the sequence holds, per plane, in logical order."""
    info = engine.kv.sequence(seq_id, tenant="")
    out = []
    for group, table in zip(engine.groups, info.tables, strict=True):
        for plane in range(len(group.layers)):
            for b in sorted(table):
                for pages in (engine.cache.k[plane], engine.cache.v[plane]):
                    out.append(pages[:, table[b]].view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("name", FP8)
def test_a_float8_export_imports_bit_exactly_into_another_float8_server(name: str) -> None:
    src, dst = _engine(name), _engine(name)
    _fill(src)
    _move(src, dst)
    assert _pages(dst, "s") == _pages(src, "s")
    q = torch.randn(1, 8, 16)
    kv = torch.randn(1, 2, 16)
    for layer in range(6):
        a = src.attend(layer, [BatchEntry("s", 19, 1)], q, kv, kv, tenant="")
        b = dst.attend(layer, [BatchEntry("s", 19, 1)], q, kv, kv, tenant="")
        assert torch.equal(a, b)


def test_a_bfloat16_server_refuses_a_float8_stream_naming_both() -> None:
    src, dst = _engine("fp8"), _engine("bfloat16")
    _fill(src)
    free = dst.pool.num_free
    with pytest.raises(IncompatibleKV, match="cache_dtype: bfloat16 here, float8_e4m3 in the stream"):
        _move(src, dst)
    assert dst.pool.num_free == free
    assert not dst.kv.sequence_ids(tenant="")


def test_other_scales_are_refused_and_a_calibrating_server_adopts_the_streams() -> None:
    src = _engine("fp8")
    _fill(src)
    other = _engine("fp8", KVScales((0.05,), (0.04,)))
    with pytest.raises(IncompatibleKV, match=r"layer 0's float8 KV is held over scales \(k, v\) = \(0.05"):
        _move(src, other)
    assert not other.kv.sequence_ids(tenant="")
    calibrating = _engine("fp8", KVScales(calibrate=True))
    _move(src, calibrating)
    assert [calibrating.scales.of(i) for i in range(6)] == [src.scales.of(i) for i in range(6)]
    assert _pages(calibrating, "s") == _pages(src, "s")


def test_e4m3_and_e5m2_are_different_caches() -> None:
    src, dst = _engine("fp8_e4m3"), _engine("fp8_e5m2")
    _fill(src)
    with pytest.raises(IncompatibleKV, match="float8_e5m2 here, float8_e4m3 in the stream"):
        _move(src, dst)


# -- through the service ---------------------------------------------------------------------------------


@pytest.mark.server
def test_info_and_a_transfer_between_two_float8_servers(tmp_path: Path) -> None:
    """Info reports both dtypes and the scales; TransferKV moves the float8 bytes and their scales (the
    protobuf path), and a bfloat16 server refuses them with INVALID_ARGUMENT naming both dtypes."""
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"k_scale": 0.05, "v_scale": 0.02}))
    fp8 = [*SMALL, "--kv-cache-dtype", "fp8", "--kv-scales", str(scales)]
    with (
        ServerProcess(*fp8) as a,
        ServerProcess(*fp8) as b,
        ServerProcess(*SMALL, "--dtype", "bfloat16") as c,
        ChunkAttnClient(a.target) as ca,
        ChunkAttnClient(b.target) as cb,
        ChunkAttnClient(c.target) as cc,
    ):
        info = ca.info()
        assert (info.cache_dtype, info.compute_dtype) == ("float8_e4m3", "float32")
        assert [(x.k_scale, x.v_scale) for x in info.layers] == [(float(np.float32(0.05)), float(np.float32(0.02)))] * 4
        assert cc.info().cache_dtype == "bfloat16"
        assert info.bytes_per_block * 2 == cc.info().bytes_per_block
        rng = np.random.default_rng(0)
        outs = []
        for layer in range(4):
            q = rng.standard_normal((20, 4, 16), dtype=np.float32)
            k, v = (rng.standard_normal((20, 2, 16), dtype=np.float32) for _ in range(2))
            ca.attend(layer, [BatchEntry("s", 0, 20)], q, k, v)
        moved = ca.transfer_kv("s", b.target)
        assert moved.records > 0
        for layer in range(4):
            q = rng.standard_normal((1, 4, 16), dtype=np.float32)
            k, v = (rng.standard_normal((1, 2, 16), dtype=np.float32) for _ in range(2))
            outs.append([x.attend(layer, [BatchEntry("s", 20, 1)], q, k, v) for x in (ca, cb)])
        for x, y in outs:
            assert np.array_equal(x, y)
        with pytest.raises(ChunkAttnError) as err:
            ca.transfer_kv("s", c.target)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT  # errors.py: IncompatibleKV
        assert "cache_dtype: bfloat16 here, float8_e4m3 in the stream" in str(err.value)


def test_a_float8_dtype_is_refused_for_tensors() -> None:
    from chunkattn_client import codec

    with pytest.raises(codec.CodecError, match="KV cache dtype only"):
        codec.dtype_name(dtypes.lookup("fp8").wire)


@pytest.mark.parametrize("name", FP8)
def test_the_triton_backend_serves_a_float8_cache_through_the_engine(name: str) -> None:
    """The kernels under the interpreter (fp32 compute): KV sharing, a global layer, chunk boundaries."""
    h = Harness.build(MODELS["sharing"], cache_dtype=name, kv_scales=KVScales((0.05,), (3.0,)), impl="triton")
    h.step([BatchEntry("a", 0, 10), BatchEntry("b", 0, 1)])
    h.step([BatchEntry("a", 10, 1), BatchEntry("b", 1, 7)])


@pytest.mark.server
@pytest.mark.parametrize("scales", ["file", "calibrate"])
def test_the_bench_verifies_against_a_float8_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scales: str
) -> None:
    """``chunkattn bench --verify`` computes its reference on K/V as the float8 cache holds them, with the
    scales Info reports (a calibrating server's once a layer has been written)."""
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": 0.02, "v_scale": [0.05, 0.03, 0.02, 0.01]}))
    flags = [*SMALL, "--kv-cache-dtype", "fp8", "--kv-scales", str(path) if scales == "file" else "calibrate"]
    out = tmp_path / "run.json"
    with ServerProcess(*flags) as server:
        args = ["bench", "--target", server.target, "--progress", "none", "--json", str(out), "--verify", "30"]
        rc = main([*args, "--sequences", "4", "--concurrency", "2", "--prompt-len", "20:40", "--output-len", "4"])
    capsys.readouterr()
    result = json.loads(out.read_text())["verify"]
    assert rc == 0
    assert result["checked"] >= 30
    assert result["mismatches"] == 0


@pytest.mark.parametrize("cache_dtype", ["float32", "fp8_e4m3"])
def test_a_servers_info_gives_the_fingerprint_a_kv_stream_would(cache_dtype: str) -> None:
    """TransferKV names a target's refusal that gRPC lost (grpc/grpc#36066) from the target's Info: it must
    read there what the target's own engine would compare a stream against."""
    from chunkattn_server.service.info import _static_info
    from chunkattn_server.service.kvwire import fingerprint_of_info

    scales = KVScales((0.05,), (0.02,)) if "fp8" in cache_dtype else None
    h = Harness.build(MODELS["sharing"], cache_dtype=cache_dtype, kv_scales=scales)
    assert fingerprint_of_info(_static_info(h.engine, 1 << 20)) == h.engine.fingerprint()
