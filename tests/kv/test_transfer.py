"""Moving a sequence's live KV between engines: export, import, and what a broken import leaves (nothing)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.errors import (
    DataLoss,
    IncompatibleKV,
    InvalidBatch,
    OutOfBlocks,
    SequenceChanged,
    SequenceExists,
)
from chunkattn_server.kv.manifest import BlockRecord, KVManifest, batches, checksum
from chunkattn_server.kv.scales import KVScales
from tests.helpers.harness import MODELS, snapshot


def engine(model: ModelShape, num_blocks: int = 512) -> Engine:
    return Engine(EngineConfig(model, CacheConfig(block_size=4, num_blocks=num_blocks), device="cpu"))


def move(src: Engine, dst: Engine, seq_id: str, *, new_id: str | None = None, per_batch: int = 3) -> KVManifest:
    """Export ``seq_id`` from src and import it into dst, a few records at a time, as a stream would."""
    manifest = src.transfer.export_manifest(seq_id, tenant="")
    session = dst.transfer.begin_import(dataclasses.replace(manifest, seq_id=new_id or seq_id), tenant="")
    try:
        for batch in batches(manifest.expected(), per_batch):
            dst.transfer.import_records(session, [r.copy() for r in src.transfer.export_views(manifest, batch)])
        dst.transfer.commit_import(session)
    finally:
        dst.transfer.abort_import(session)
    return manifest


class Feed:
    """The same random tensors for every engine it drives."""

    def __init__(self, model: ModelShape) -> None:
        self.model = model
        self.g = torch.Generator().manual_seed(0)

    def step(self, engines: list[Engine], seq_ids: list[str], position: int, n: int) -> list[list[torch.Tensor]]:
        outs: list[list[torch.Tensor]] = [[] for _ in engines]
        m = self.model
        for layer, spec in enumerate(m.layers):
            q = torch.randn(n, m.num_heads, m.head_size, generator=self.g)
            kv = [torch.randn(n, m.num_kv_heads, m.head_size, generator=self.g) for _ in range(2)]
            k, v = (None, None) if spec.kv_source is not None else kv
            for i, (e, s) in enumerate(zip(engines, seq_ids, strict=True)):
                outs[i].append(e.attend(layer, [BatchEntry(s, position, n)], q, k, v, tenant=""))
        return outs


@pytest.mark.parametrize("model", ["gqa", "sharing", "alibi"])
@pytest.mark.parametrize("prompt", [7, 16, 35])  # mid-chunk, on a boundary, across several
def test_decoding_after_a_transfer_equals_decoding_without_one_bit_for_bit(model: str, prompt: int) -> None:
    shape = MODELS[model]
    src, dst, twin = engine(shape), engine(shape), engine(shape)
    feed = Feed(shape)
    feed.step([src, twin], ["s", "s"], 0, prompt)
    before = snapshot(src)
    move(src, dst, "s", new_id="moved")
    assert snapshot(src) == before  # an export changes nothing
    for i in range(20):  # across the next chunk boundaries of every chunked layer
        ours, theirs = feed.step([dst, twin], ["moved", "s"], prompt + i, 1)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)


def test_chunked_layers_send_at_most_one_chunk_and_a_block_whatever_the_prompt() -> None:
    c, bs = 8, 4
    shape = ModelShape(num_heads=4, num_kv_heads=2, head_size=8, layers=(LayerSpec(c), LayerSpec(c), LayerSpec(0)))
    src, dst = engine(shape), engine(shape)
    Feed(shape).step([src], ["s"], 0, 10 * c + 3)
    manifest = move(src, dst, "s")
    per_layer = {layer: sum(1 for x, _ in manifest.expected() if x == layer) for layer in range(3)}
    assert per_layer[0] * bs <= c + bs
    assert per_layer[1] * bs <= c + bs
    assert per_layer[2] == -(-(10 * c + 3) // bs)  # the global layer sends everything
    assert dst.kv.sequence("s", tenant="").lengths == (83, 83, 83)


def _ready(shape: ModelShape = MODELS["gqa"]) -> tuple[Engine, Engine, KVManifest, list[BlockRecord]]:
    src, dst = engine(shape), engine(shape)
    Feed(shape).step([src], ["s"], 0, 21)
    manifest = src.transfer.export_manifest("s", tenant="")
    return src, dst, manifest, [r.copy() for r in src.transfer.export_views(manifest, manifest.expected())]


def test_an_export_reads_the_pages_in_place_and_checksums_the_bytes_it_sends() -> None:
    """Blocks the layer holds whole are views of the pages; the last, partly filled one is a copy whose
    positions past the sequence's length are zeros."""
    src, _, manifest, _ = _ready()  # 21 tokens: blocks of 4, the last holds 1
    shape = MODELS["gqa"]
    pages = [t.view(torch.uint8).numpy() for t in src.cache.k]
    views = src.transfer.export_views(manifest, manifest.expected())
    assert any(v.logical == 5 for v in views)
    assert any(v.logical < 5 for v in views)
    for view in views:
        if view.logical < 5:
            assert len(view.k) == len(view.v) == shape.num_kv_heads  # one piece per head, no copy yet
            k = [np.frombuffer(piece, np.uint8) for piece in view.k]
            assert all(any(np.shares_memory(piece, slot) for slot in pages) for piece in k)
        else:
            (k_bytes,) = view.k
            rows = np.frombuffer(k_bytes, np.float32).reshape(shape.num_kv_heads, 4, shape.head_size)
            assert rows[:, 0].any()
            assert not rows[:, 1:].any()
        record = view.copy()
        assert view.nbytes == len(record.k) + len(record.v)
        assert record.intact()  # the checksum over the pieces is the checksum of the bytes as sent
        assert checksum(view.layer, view.logical, (record.k, record.v)) == view.checksum


def test_the_device_path_reads_the_same_bytes_and_checksums_as_the_page_views() -> None:
    """KVCache.block_views on a device gathers the blocks and copies them to the host; run on CPU tensors,
    that branch must give the bytes and checksums of the CPU views."""
    src, _, manifest, _ = _ready()

    def read() -> list[tuple[bytes | memoryview, bytes | memoryview, int]]:
        return [
            (r.k, r.v, r.checksum) for r in (v.copy() for v in src.transfer.export_views(manifest, manifest.expected()))
        ]

    want = read()
    src.cache._host = None  # what a CUDA cache has: no numpy views of the pages
    got = read()
    assert got == want
    assert src.cache.block_views(0, []) == []


def _unchanged(dst: Engine) -> None:
    assert dst.pool.num_free == dst.pool.num_blocks
    assert dst.kv.sequence_ids(tenant="") == []


def test_a_damaged_record_is_data_loss_and_leaves_nothing() -> None:
    src, dst, manifest, records = _ready()
    before = snapshot(src)
    bad = dataclasses.replace(records[3], k=bytes([records[3].k[0] ^ 1]) + records[3].k[1:])
    session = dst.transfer.begin_import(manifest, tenant="")
    with pytest.raises(DataLoss, match="fails its checksum"):
        dst.transfer.import_records(session, [*records[:3], bad])
    dst.transfer.abort_import(session)
    _unchanged(dst)
    assert snapshot(src) == before


def test_a_truncated_stream_is_data_loss_and_leaves_nothing() -> None:
    _, dst, manifest, records = _ready()
    session = dst.transfer.begin_import(manifest, tenant="")
    dst.transfer.import_records(session, records[:-1])
    with pytest.raises(DataLoss, match=r"1 of \d+ records missing"):
        dst.transfer.commit_import(session)
    dst.transfer.abort_import(session)
    _unchanged(dst)


@pytest.mark.parametrize("which", ["unexpected", "twice", "size"])
def test_records_that_do_not_belong_are_refused(which: str) -> None:
    _, dst, manifest, records = _ready()
    session = dst.transfer.begin_import(manifest, tenant="")
    bad = {
        "unexpected": [dataclasses.replace(records[0], logical=999)],
        "twice": [records[0], records[0]],
        "size": [dataclasses.replace(records[0], k=records[0].k[:-2], v=records[0].v[:-2])],
    }[which]
    with pytest.raises(IncompatibleKV):
        dst.transfer.import_records(session, bad)
    dst.transfer.abort_import(session)
    _unchanged(dst)


def test_another_model_shape_is_refused_by_name() -> None:
    _, _, manifest, _ = _ready()
    other = engine(dataclasses.replace(MODELS["gqa"], head_size=32))
    with pytest.raises(IncompatibleKV, match="head_size: 32 here, 16 in the stream"):
        other.transfer.begin_import(manifest, tenant="")
    _unchanged(other)


def test_an_existing_id_and_a_full_pool_are_refused_before_anything_is_reserved() -> None:
    _, dst, manifest, _ = _ready()
    Feed(MODELS["gqa"]).step([dst], ["s"], 0, 3)
    before = snapshot(dst)
    with pytest.raises(SequenceExists, match="'s'"):
        dst.transfer.begin_import(manifest, tenant="")
    assert snapshot(dst) == before
    small = engine(MODELS["gqa"], num_blocks=4)
    with pytest.raises(OutOfBlocks, match="the import needs"):
        small.transfer.begin_import(manifest, tenant="")
    _unchanged(small)


def test_an_id_taken_during_the_import_fails_the_commit_and_leaves_the_other_sequence() -> None:
    _, dst, manifest, records = _ready()
    session = dst.transfer.begin_import(manifest, tenant="")
    dst.transfer.import_records(session, records)
    Feed(MODELS["gqa"]).step([dst], ["s"], 0, 2)
    before = snapshot(dst)
    with pytest.raises(SequenceExists, match="meanwhile"):
        dst.transfer.commit_import(session)
    dst.transfer.abort_import(session)
    after = snapshot(dst)
    assert after[0] == before[0]  # the other "s" is intact
    assert after[1].used_blocks == before[1].used_blocks - sum(len(t) for t in session.manifest.blocks)


def test_a_sequence_that_changes_during_its_export_is_reported() -> None:
    src, _, manifest, _ = _ready()
    Feed(MODELS["gqa"]).step([src], ["s"], 21, 1)
    with pytest.raises(SequenceChanged, match="export it again"):
        src.transfer.export_views(manifest, manifest.expected()[:1])


# The gqa model's KV groups: layers 0, 1 (C = 8); 2, 5 (global); 3, 4 (C = 16). 21 tokens in blocks of 4.
FORGED: dict[str, tuple[dict[str, object], str]] = {
    "a length past int64 arithmetic": ({"lengths": (21, 21, 2**63 - 1024, 21, 21, 21)}, "outside 0..2147483647"),
    "a length with no blocks for it": ({"lengths": (21, 21, 10**9, 21, 21, 10**9)}, "need exactly"),
    "a block listed twice": ({"blocks": "repeat"}, "need exactly"),
    "a block no length needs": ({"blocks": "extra"}, "need exactly"),
    # Blocks of a group none of whose layers is exported: nothing would write them, and an export of the new
    # sequence would have sent what their last holder left there.
    "blocks of a group nothing writes": ({"lengths": (21, 21, 21, 0, 0, 21), "layers": (0, 1, 2, 5)}, "need exactly"),
    "a layer exported 3,000 times": ({"layers": (0,) * 3000}, "twice"),
    "a layer that does not exist": ({"layers": (0, 1, 2, 3, 4, 5, 6)}, "distinct layers"),
    "lengths of the wrong count": ({"lengths": (21,) * 5}, "this model has 6 layers"),
    "a layer whose KV is not sent": ({"layers": (0, 1, 2, 3)}, "layer 4 has 21 tokens but its KV is not in the stream"),
    "an empty id": ({"seq_id": ""}, "non-empty"),
    "an id too long": ({"seq_id": "x" * 300}, "too long: at most 256 bytes of UTF-8, got 300"),
    # kept_from (the first position each layer holds, 16 for the chunked layers at 21 tokens) must cover
    # what every layer reads again, or an import would hand a layer keys nobody sent.
    "a kept_from past a layer's chunk": ({"kept_from": (20, 16, 0, 16, 16, 0)}, "reads layer 0's positions from 16"),
    "a global layer's kept_from": ({"kept_from": (16, 16, 4, 16, 16, 0)}, "reads layer 2's positions from 0"),
    "kept_from of the wrong count": ({"kept_from": (16,) * 5}, "kept_from has 5 values for 6 layers"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_manifests_are_refused_before_anything_is_reserved(case: str) -> None:
    _, dst, manifest, _ = _ready()
    change, message = FORGED[case]
    if change.get("blocks") in ("repeat", "extra"):
        first = manifest.blocks[0]
        more = first[0] if change["blocks"] == "repeat" else max(first) + 1
        change = {"blocks": ((*first, more), *manifest.blocks[1:])}
    if "lengths" in change:  # forged lengths come without kept_from (each layer's current chunk, then)
        change = {**change, "kept_from": ()}
    with pytest.raises((IncompatibleKV, InvalidBatch), match=message):
        dst.transfer.begin_import(dataclasses.replace(manifest, **change), tenant="")  # type: ignore[arg-type]
    _unchanged(dst)


def test_release_after_an_export_refuses_a_sequence_that_changed_since() -> None:
    src, _, manifest, _ = _ready()
    Feed(MODELS["gqa"]).step([src], ["s"], 21, 1)
    with pytest.raises(SequenceChanged, match="not released"):
        src.transfer.release_exported(manifest)
    assert "s" in src.kv.sequence_ids(tenant="")
    src.transfer.release_exported(src.transfer.export_manifest("s", tenant=""))
    assert src.kv.sequence_ids(tenant="") == []


@pytest.mark.parametrize(("which", "value", "bound"), [("k", 1e20, "2^48"), ("v", 3e38, "2^64")])
def test_a_record_past_the_value_bounds_is_refused_as_attend_would_refuse_it(
    which: str, value: float, bound: str
) -> None:
    """Issue 35.3: Attend refuses q, k and v past the bounds that keep attention finite; an import of K/V past
    them, finite and intact (its checksum matches), would make the same NaN later, and is refused too."""
    _, dst, manifest, records = _ready()
    r = records[3]
    k, v = np.frombuffer(r.k, np.float32).copy(), np.frombuffer(r.v, np.float32).copy()
    (k if which == "k" else v)[5] = value
    bad = dataclasses.replace(
        r, k=k.tobytes(), v=v.tobytes(), checksum=checksum(r.layer, r.logical, (k.tobytes(), v.tobytes()))
    )
    assert bad.intact()
    session = dst.transfer.begin_import(manifest, tenant="")
    with pytest.raises(IncompatibleKV, match=rf"holds a {which.upper()} of .* past .* \({re.escape(bound)}\)"):
        dst.transfer.import_records(session, [*records[:3], bad])
    dst.transfer.abort_import(session)
    _unchanged(dst)


@pytest.mark.parametrize("cache", ["fp8_e4m3", "fp8_e5m2"])
def test_kv_written_at_the_bound_moves_to_a_twin_though_float8_rounded_it_up(cache: str) -> None:
    """Found by the review of issue 35: a k of 2^48 (the bound) over a k_scale of 2^48 / 310 is stored as the
    float8 number nearest 310, which can read back a little past 2^48; the twin took it for KV past the bound.
    An import allows the cache's rounding, half a float8 step."""
    shape = MODELS["gqa"]  # head size 16, scale 0.25: |k| at most 2^48
    scales = KVScales(k=(2.0**48 / 310,), v=(1.0,))

    def fp8_engine() -> Engine:
        return Engine(
            EngineConfig(shape, CacheConfig(block_size=4, num_blocks=64, dtype=cache, scales=scales), device="cpu")
        )

    src, dst = fp8_engine(), fp8_engine()
    for layer, spec in enumerate(shape.layers):
        q = torch.ones(5, shape.num_heads, shape.head_size)
        k = torch.full((5, shape.num_kv_heads, shape.head_size), 2.0**48) if spec.kv_source is None else None
        src.attend(layer, [BatchEntry("s", 0, 5)], q, k, None if k is None else torch.ones_like(k), tenant="")
    move(src, dst, "s")
    assert dst.kv.sequence_ids(tenant="") == ["s"]


def test_an_import_past_what_the_compute_dtype_holds_is_refused() -> None:
    """Found by the second review of issue 35: a float32 cache read in float16 compute gives back what it holds,
    so an imported K or V of 1e5 (which Attend refuses as past float16's 65504) read back as inf: NaN after."""
    shape = MODELS["gqa"]

    def half_engine() -> Engine:
        config = EngineConfig(
            shape, CacheConfig(block_size=4, num_blocks=64, dtype="float32"), device="cpu", dtype="float16"
        )
        return Engine(config)

    src, dst = half_engine(), half_engine()
    Feed(shape).step([src], ["s"], 0, 9)  # float32 tensors, computed in float16
    manifest = src.transfer.export_manifest("s", tenant="")
    records = [r.copy() for r in src.transfer.export_views(manifest, manifest.expected())]
    r = records[1]
    k = np.frombuffer(r.k, np.float32).copy()
    k[3] = 1e5
    bad = dataclasses.replace(r, k=k.tobytes(), checksum=checksum(r.layer, r.logical, (k.tobytes(), r.v)))
    session = dst.transfer.begin_import(manifest, tenant="")
    with pytest.raises(IncompatibleKV, match=r"holds a K of 100000, past 65504"):
        dst.transfer.import_records(session, [records[0], bad])
    dst.transfer.abort_import(session)
    _unchanged(dst)
