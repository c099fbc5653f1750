"""The block API (Engine.open_space / attend_blocks), driven as vLLM drives it (tests/helpers/blockspace.py).

Covered:

* parity: every model of the harness (GQA, MQA, ALiBi, KV sharing; torch backend, and one tiny triton
  case): sequences whose prefills cross chunk boundaries, then decodes and mixed steps, every layer in order,
  match the float64 reference of chunked attention on the same entries; the engine's sequence API is never
  used. Also vLLM's hybrid layout (custom layer_planes: chunked and global layers share a plane with
  disjoint block ids, freed out-of-chunk blocks reused by other layers at once);
* several calls of one layer in one step (two tenants, two spaces of one tenant, a failing call beside
  them) give what each gives alone;
* hostile calls: each raises the right error naming the field and changes nothing (pages, pool, spaces);
* no stale bytes: a space's blocks are zero when it opens, even where a released sequence wrote, and a row
  reading slots never written attends over zeros; negative slots are not written, and their rows attend
  over the call's own k/v (one-token rows too, on both backends);
* the chunk size is not applied (the caller windows); padding past a row's blocks is never read;
* the pool and quotas: a space past the free pool or the tenant's quota takes nothing; close gives its
  blocks back; idle spaces are evicted, used ones kept; a tenant's 65th space is refused;
* a float8 cache: the block API's outputs equal the sequence API's for the same tokens, and the reference
  on the values the cache holds.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_client.limits import MAX_LEASE_S
from chunkattn_client.reference import chunked_attention, within_tolerance
from chunkattn_client.work import PIECE_WORK
from chunkattn_server import CacheConfig, EngineConfig
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.types import BlockCall
from chunkattn_server.errors import (
    InvalidArgument,
    InvalidBatch,
    InvalidTensor,
    OutOfBlocks,
    PositionMismatch,
    QuotaExceeded,
    UnknownLayer,
    UnknownSpace,
)
from chunkattn_server.kv import spaces as spaces_module
from chunkattn_server.kv.records import Quota
from chunkattn_server.kv.scales import KVScales
from chunkattn_server.kv.spaces import MAX_SPACES_PER_TENANT, OPEN_WINDOW_S, SpaceState
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.harness import MODELS, NATIVE, Harness

Entries = list[tuple[str, int, int]]

# Three sequences: prefills that cross chunk boundaries (C = 4, 8, 16), a newcomer beside a decode and a
# prefill piece, decodes across the next boundaries, then a prefill piece that starts mid-chunk and crosses one.
STEPS: list[Entries] = [
    [("a", 0, 11), ("b", 0, 2)],
    [("c", 0, 19), ("a", 11, 1), ("b", 2, 7)],
    *[[("a", 12 + i, 1), ("b", 9 + i, 1), ("c", 19 + i, 1)] for i in range(5)],
    [("b", 14, 9), ("a", 17, 1), ("c", 24, 1)],
]
SPACE_BLOCKS = 24  # the STEPS' sequences end at 18, 23 and 25 tokens: 5 + 6 + 7 blocks of 4


def _check(
    h: Harness, layer: int, entries: Entries, out: torch.Tensor | Exception, q: torch.Tensor, k: Any, v: Any
) -> None:
    """Asserts ``out`` is the reference's answer for the call (the reference records the call's K/V)."""
    assert isinstance(out, torch.Tensor), f"layer {layer}: {out!r}"
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    kr, vr = (None, None) if k is None else h.expected_kv(layer, k, v)
    batch = [BatchEntry(*e) for e in entries]
    expected = h.reference.attend(layer, batch, q.to(h.engine.dtype).double().numpy(), kr, vr)
    ok, err = within_tolerance(out.double().numpy(), expected, h.tolerance)
    assert ok, f"layer {layer}, entries {entries}: error {err:.3g}"


def _tokens(entries: Entries) -> int:
    return sum(n for _, _, n in entries)


def _run_step(
    h: Harness,
    mgr: KVCacheManager,
    space: SpaceState,
    entries: Entries,
    *,
    tenant: str,
    layer_group: Sequence[int] | None = None,
    pad: int = -1,
    layers: Sequence[int] | None = None,
) -> None:
    """One step of ``entries`` through the layers (all, in order), each checked against the reference."""
    mgr.schedule(entries)
    for layer in range(h.model.num_layers) if layers is None else layers:
        q, k, v = h.tensors(layer, _tokens(entries))
        group = 0 if layer_group is None else layer_group[layer]
        call = mgr.call(
            space.space_id, tenant, entries, h.model.layers[layer].chunk_size, q, k, v, group=group, pad=pad
        )
        (out,) = h.engine.attend_blocks(layer, [call])
        _check(h, layer, entries, out, q, k, v)


def _pages(engine: Engine) -> list[torch.Tensor]:
    return [t.clone() for t in (*engine.cache.k, *engine.cache.v)]


def _same_pages(engine: Engine, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, (*engine.cache.k, *engine.cache.v), strict=True))


# -- parity with the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", [-1, 0])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_matches_the_reference_through_block_tables(model: str, pad: int) -> None:
    h = Harness.build(MODELS[model])
    space = h.engine.open_space(SPACE_BLOCKS + 4, [], tenant="t")
    mgr = KVCacheManager(SPACE_BLOCKS + 4, h.engine.block_size, seed=1)
    for entries in STEPS:
        _run_step(h, mgr, space, entries, tenant="t", pad=pad)
    assert h.engine.kv.num_sequences == 0  # the sequence API was never used
    assert h.engine.pool.num_used == space.blocks.size
    assert h.engine.stats().spaces_by_tenant == {"t": 1}


def test_the_triton_kernels_serve_block_calls() -> None:
    h = Harness.build(MODELS["mqa"], impl="triton")  # C = 4 and global
    space = h.engine.open_space(6, [], tenant="t")
    mgr = KVCacheManager(6, h.engine.block_size, seed=2)
    for entries in ([("a", 0, 6), ("b", 0, 1)], [("a", 6, 1), ("b", 1, 4)]):
        _run_step(h, mgr, space, entries, tenant="t")


def test_the_hybrid_layout_shares_planes_between_groups_of_disjoint_blocks() -> None:
    """vLLM's hybrid allocator on the gqa model (C = 8: layers 0, 1; C = 16: 3, 4; global: 2, 5): three
    groups of two layers, each group its own block tables, and two planes, each shared by one layer of each
    group. Chunked groups free the blocks before their chunk, and other groups take them at once."""
    h = Harness.build(MODELS["gqa"])
    planes = (0, 1, 0, 0, 1, 1)
    layer_group = (0, 0, 2, 1, 1, 2)
    space = h.engine.open_space(40, planes, tenant="t")
    assert space.num_planes == 2
    assert space.layer_planes == planes
    assert space.blocks.shape == (40, 1)  # two planes fit one pool block (G = 2)
    assert h.engine.pool.num_used == 40
    mgr = KVCacheManager(40, h.engine.block_size, group_chunks=(8, 16, 0), seed=3)
    for entries in STEPS:
        _run_step(h, mgr, space, entries, tenant="t", layer_group=layer_group)
    assert any(len(groups) > 1 for groups in mgr.used_by.values()), "no block id changed group: nothing shared"


# -- several calls in one step --------------------------------------------------------------------------------

OTHER_STEPS: list[Entries] = [
    [("x", 0, 3)],
    [("x", 3, 14), ("y", 0, 1)],
    *[[("y", 1 + i, 1), ("x", 17 + i, 1)] for i in range(5)],
    [("y", 6, 5)],
]


@pytest.mark.parametrize("model", ["gqa", "sharing"])
def test_calls_of_one_step_give_what_each_gives_alone(model: str) -> None:
    """Tenant a's two spaces (the second with its planes in reverse: other pages of the pool for some layers,
    so a step's calls take two backend calls), tenant b's one and a failing call (a slot past its space) in
    every step of one engine; each space alone in its own steps on another engine (and the first checked
    against the reference)."""
    together, alone = Harness.build(MODELS[model]), Harness.build(MODELS[model])
    reverse = list(reversed(range(together.model.num_layers)))
    owners = [("a", STEPS, []), ("b", OTHER_STEPS, []), ("a", OTHER_STEPS, reverse)]
    spaces = [
        (
            together.engine.open_space(SPACE_BLOCKS, planes, tenant=t),
            alone.engine.open_space(SPACE_BLOCKS, planes, tenant=t),
        )
        for t, _, planes in owners
    ]
    mgrs = [KVCacheManager(SPACE_BLOCKS, 4, seed=i) for i in range(len(owners))]
    for step in range(len(STEPS)):
        for (_, steps, _), mgr in zip(owners, mgrs, strict=True):
            mgr.schedule(steps[step])
        for layer, spec in enumerate(together.model.layers):
            calls, solo = [], []
            for (tenant, steps, _), (s1, s2), mgr in zip(owners, spaces, mgrs, strict=True):
                q, k, v = together.tensors(layer, _tokens(steps[step]))
                call = mgr.call(s1.space_id, tenant, steps[step], spec.chunk_size, q, k, v)
                calls.append(call)
                solo.append(dataclasses.replace(call, space_id=s2.space_id))
            bad = dataclasses.replace(calls[0], slots=calls[0].slots + SPACE_BLOCKS * 4)
            outs = together.engine.attend_blocks(layer, [calls[0], bad, *calls[1:]])
            assert isinstance(outs[1], InvalidBatch)
            assert "slot_mapping" in str(outs[1])
            del outs[1]
            for out, call in zip(outs, solo, strict=True):
                (want,) = alone.engine.attend_blocks(layer, [call])
                assert isinstance(out, torch.Tensor), out
                assert isinstance(want, torch.Tensor), want
                assert torch.allclose(out, want, rtol=0, atol=1e-6), float((out - want).abs().max())
            # the first space against the reference (its sequences' ids are its own)
            first = calls[0]
            _check(together, layer, STEPS[step], outs[0], first.q, first.k, first.v)
    for s1, s2 in spaces:  # and wrote the same
        for a, b in zip(
            (*together.engine.cache.k, *together.engine.cache.v),
            (*alone.engine.cache.k, *alone.engine.cache.v),
            strict=True,
        ):
            assert torch.equal(a[:, s1.pool_blocks()], b[:, s2.pool_blocks()])


# -- hostile calls -----------------------------------------------------------------------------------------------

NEXT: Entries = [("a", 10, 7), ("b", 3, 1)]  # a: [10, 16) in chunk 8, [16, 17) in chunk 16 (C = 8 layers: 3 rows)


def _closed(engine: Engine, call: BlockCall) -> BlockCall:
    space = engine.open_space(2, [], tenant=call.tenant)
    engine.kv.spaces.close(space.space_id, tenant=call.tenant)
    return dataclasses.replace(call, space_id=space.space_id)


def _set(name: str, index: Any, value: int | list[int]) -> Callable[[Engine, BlockCall], BlockCall]:
    def mutate(engine: Engine, call: BlockCall) -> BlockCall:
        array = getattr(call, name).copy()
        array[index] = value
        return dataclasses.replace(call, **{name: array})

    return mutate


def _nan_k(engine: Engine, call: BlockCall) -> BlockCall:
    assert call.k is not None
    k = call.k.clone()
    k[2, 0, 1] = float("nan")
    return dataclasses.replace(call, k=k)


def _short_k(engine: Engine, call: BlockCall) -> BlockCall:
    assert call.k is not None
    return dataclasses.replace(call, k=call.k[:-1])


def _with_kv(engine: Engine, call: BlockCall) -> BlockCall:
    m = engine.config.model
    kv = torch.zeros(call.q.shape[0], m.num_kv_heads, m.head_size)
    return dataclasses.replace(call, k=kv, v=kv)


# (layer of the sharing model, how the valid call is spoiled, the error, a regex its message must match)
HOSTILE: dict[str, tuple[int, Callable[[Engine, BlockCall], BlockCall], type[Exception], str]] = {
    "slot past the space": (0, _set("slots", 3, 12 * 4), InvalidBatch, r"slot_mapping\[3\]"),
    "slot far past the space": (2, _set("slots", 0, 2**62), InvalidBatch, r"slot_mapping\[0\]"),
    "block id past the space": (0, _set("tables", (0, 0), 12), InvalidBatch, r"block_table row 0 entry 0"),
    "negative block id, used": (0, _set("tables", (1, 0), -1), InvalidBatch, r"block_table row 1 entry 0"),
    "negative block id, global": (2, _set("tables", (0, 2), -5), InvalidBatch, r"block_table row 0 entry 2"),
    "starts not at 0": (0, _set("starts", 0, 1), InvalidBatch, r"query_start_loc"),
    "starts not ending at T": (2, _set("starts", -1, 7), InvalidBatch, r"query_start_loc"),
    "starts decreasing": (0, _set("starts", slice(1, 3), [7, 6]), InvalidBatch, r"query_start_loc\[2\] decreases"),
    "seq_len < q_len": (0, _set("seq_lens", 0, 5), InvalidBatch, r"seq_lens\[0\] is less than"),
    "seq_len past the table": (2, _set("seq_lens", 1, 4 * 5 + 1), InvalidBatch, r"seq_lens\[1\].*block_table_width"),
    "slot_mapping too short": (
        0,
        lambda e, c: dataclasses.replace(c, slots=c.slots[:-1]),
        InvalidBatch,
        r"slot_mapping",
    ),
    "slot_mapping too long": (
        2,
        lambda e, c: dataclasses.replace(c, slots=np.append(c.slots, 0)),
        InvalidBatch,
        r"slot_mapping",
    ),
    "table rows != rows": (0, lambda e, c: dataclasses.replace(c, tables=c.tables[:-1]), InvalidBatch, r"block_table"),
    "no rows": (
        2,
        lambda e, c: dataclasses.replace(c, seq_lens=c.seq_lens[:0], starts=c.starts[:1], tables=c.tables[:0]),
        InvalidBatch,
        r"seq_lens",
    ),
    "a decode's slot elsewhere than its table puts it": (
        2,
        lambda e, c: _set("slots", 7, int(c.slots[7]) ^ 1)(e, c),  # b's position 3 written over its position 2
        InvalidBatch,
        r"slot_mapping\[7\] is \d+; token 7 is key 3 of row 1, which block_table row 1 puts in slot",
    ),
    "a prefill token's slot elsewhere": (
        0,
        lambda e, c: _set("slots", 2, int(c.slots[5]))(e, c),
        InvalidBatch,
        r"slot_mapping\[2\] is \d+; token 2 is key 4 of row 0, which block_table row 0 puts in slot \d+ ",
    ),
    "KV sharing, negative slot": (1, _set("slots", 4, -1), InvalidBatch, r"slot_mapping\[4\] is negative"),
    "KV sharing, global, negative slot": (3, _set("slots", 0, -3), InvalidBatch, r"slot_mapping\[0\]"),
    "KV sharing given k and v": (1, _with_kv, InvalidTensor, r"without k and v"),
    "q of too few heads": (0, lambda e, c: dataclasses.replace(c, q=c.q[:, :-1]), InvalidTensor, r"^q has shape"),
    "k of too few tokens": (2, _short_k, InvalidTensor, r"^k has shape"),
    "k holds NaN": (2, _nan_k, InvalidTensor, r"\bk row 2\b"),
    "another tenant's space": (0, lambda e, c: dataclasses.replace(c, tenant="u"), UnknownSpace, r"block space"),
    "a space never opened": (0, lambda e, c: dataclasses.replace(c, space_id="0" * 32), UnknownSpace, r"block space"),
    "a closed space": (2, _closed, UnknownSpace, r"block space"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_calls_raise_naming_the_field_and_change_nothing(case: str) -> None:
    layer, mutate, error, message = HOSTILE[case]
    h = Harness.build(MODELS["sharing"], num_blocks=40)  # layers: C = 8, its sharer, global, its sharer
    h.engine.open_space(3, [], tenant="u")  # another tenant's space, beside
    space = h.engine.open_space(12, [], tenant="t")
    mgr = KVCacheManager(12, 4, seed=4)
    _run_step(h, mgr, space, [("a", 0, 10), ("b", 0, 3)], tenant="t")
    _run_step(h, mgr, space, NEXT, tenant="t", layers=range(layer))
    q, k, v = h.tensors(layer, _tokens(NEXT))
    good = mgr.call(space.space_id, "t", NEXT, h.model.layers[layer].chunk_size, q, k, v)
    bad = mutate(h.engine, good)
    pages, free, stats = _pages(h.engine), h.engine.pool.num_free, h.engine.stats()

    (result,) = h.engine.attend_blocks(layer, [bad])
    assert type(result) is error, repr(result)
    assert re.search(message, str(result)), str(result)
    assert _same_pages(h.engine, pages)
    assert h.engine.pool.num_free == free
    assert h.engine.stats() == stats

    (out,) = h.engine.attend_blocks(layer, [good])  # the valid call still works, on an intact cache
    _check(h, layer, NEXT, out, q, k, v)
    assert _same_pages(h.engine, pages) == (h.model.layers[layer].kv_source is not None)  # a write shows


def test_two_new_tokens_in_one_slot_are_refused() -> None:
    """Two rows whose tables put their new keys in one slot: whichever was written last would be the other's
    key too. Found by review (issue 35.1)."""
    h = Harness.build(MODELS["mqa"])
    space = h.engine.open_space(2, [], tenant="t")
    q, k, v = h.tensors(1, 2)
    call = BlockCall(
        space.space_id, q, k, v, np.array([0, 0]), np.array([0, 1, 2]), np.array([1, 1]), np.array([[0], [0]]), "t"
    )
    pages = _pages(h.engine)
    (result,) = h.engine.attend_blocks(1, [call])
    assert isinstance(result, InvalidBatch), result
    assert "slot_mapping[1] is 0, the slot of token 0 too" in str(result)
    assert _same_pages(h.engine, pages)


@pytest.mark.parametrize("impl", ["auto", NATIVE])
def test_another_calls_padding_never_changes_how_a_row_is_computed(impl: str) -> None:
    """Issue 35.1: whether a one-token row reads its own key from the pages or from its call's k was decided once
    per step, so another tenant's padding token (slot -1) in the same step changed it. Decided per row now: A's
    decodes give the same answer alone and merged with B's padded call, which is itself answered over its own k/v."""
    together, alone = Harness.build(MODELS["gqa"], impl=impl), Harness.build(MODELS["gqa"], impl=impl)
    entries = [("s", 0, 9)]
    spaces = [h.engine.open_space(8, [], tenant="a") for h in (together, alone)]
    b_space = together.engine.open_space(8, [], tenant="b")
    mgr, b_mgr = KVCacheManager(8, 4, seed=1), KVCacheManager(8, 4, seed=2)
    mgr.schedule(entries)
    b_mgr.schedule([("p", 0, 2)])
    for layer, spec in enumerate(together.model.layers):  # a's prefill, in both engines
        q, k, v = together.tensors(layer, 9)
        for h, sp in zip((together, alone), spaces, strict=True):
            (out,) = h.engine.attend_blocks(layer, [mgr.call(sp.space_id, "a", entries, spec.chunk_size, q, k, v)])
            if h is together:
                _check(h, layer, entries, out, q, k, v)  # (the reference records the prefill)
    decode = [("s", 9, 1)]
    mgr.schedule(decode)
    for layer, spec in enumerate(together.model.layers):
        q, k, v = together.tensors(layer, 1)
        mine = mgr.call(spaces[0].space_id, "a", decode, spec.chunk_size, q, k, v)
        qb, kb, vb = together.tensors(layer, 2)
        theirs = b_mgr.call(b_space.space_id, "b", [("p", 0, 2)], spec.chunk_size, qb, kb, vb)
        theirs = dataclasses.replace(theirs, slots=np.array([theirs.slots[0], -1]))  # a padding token
        merged, padded = together.engine.attend_blocks(layer, [mine, theirs])
        (solo,) = alone.engine.attend_blocks(layer, [dataclasses.replace(mine, space_id=spaces[1].space_id)])
        assert isinstance(merged, torch.Tensor), merged
        assert isinstance(solo, torch.Tensor), solo
        assert torch.allclose(merged, solo, rtol=0, atol=1e-6), float((merged - solo).abs().max())
        _check(together, layer, decode, merged, q, k, v)
        assert isinstance(padded, torch.Tensor), padded
        assert kb is not None
        assert vb is not None
        kr, vr = kb.double().numpy(), vb.double().numpy()
        want = chunked_attention(qb.double().numpy(), kr, vr, [0, 1], chunk_size=0)  # over its own two keys
        ok, err = within_tolerance(padded.double().numpy(), want, "float32")
        assert ok, err


def test_the_layers_chunk_size_is_not_applied() -> None:
    """The caller windows: a chunked layer's row of 10 keys (C = 4, not split) is plain causal attention over
    all 10, with each row's positions counted from its own first key."""
    h = Harness.build(MODELS["mqa"])  # layer 0: C = 4
    space = h.engine.open_space(8, [], tenant="t")
    mgr = KVCacheManager(8, 4, seed=7)
    entries = [("a", 0, 6), ("b", 0, 10)]
    mgr.schedule(entries)
    q, k, v = h.tensors(0, 16)
    assert k is not None
    assert v is not None
    call = mgr.call(space.space_id, "t", entries, 0, q, k, v)  # rows as for a global layer
    (out,) = h.engine.attend_blocks(0, [call])
    assert isinstance(out, torch.Tensor), out
    for rows, positions in ((slice(0, 6), range(6)), (slice(6, 16), range(10))):
        args = (q[rows].double().numpy(), k[rows].double().numpy(), v[rows].double().numpy(), list(positions))
        ok, err = within_tolerance(out[rows].double().numpy(), chunked_attention(*args, chunk_size=0), "float32")
        assert ok, err
        assert not within_tolerance(out[rows].double().numpy(), chunked_attention(*args, chunk_size=4), "float32")[0]


def test_padding_past_a_rows_blocks_is_never_read() -> None:
    h = Harness.build(MODELS["sharing"])
    space = h.engine.open_space(12, [], tenant="t")
    mgr = KVCacheManager(12, 4, seed=5)
    _run_step(h, mgr, space, [("a", 0, 10), ("b", 0, 3)], tenant="t")
    mgr.schedule(NEXT)
    for layer, spec in enumerate(h.model.layers):
        q, k, v = h.tensors(layer, _tokens(NEXT))
        call = mgr.call(space.space_id, "t", NEXT, spec.chunk_size, q, k, v, pad=10**12, extra_width=3)
        (out,) = h.engine.attend_blocks(layer, [call])
        _check(h, layer, NEXT, out, q, k, v)


def test_an_unknown_layer_fails_the_whole_step() -> None:
    h = Harness.build(MODELS["mqa"])
    space = h.engine.open_space(2, [], tenant="t")
    mgr = KVCacheManager(2, 4)
    mgr.schedule([("a", 0, 1)])
    q, k, v = h.tensors(0, 1)
    with pytest.raises(UnknownLayer):
        h.engine.attend_blocks(2, [mgr.call(space.space_id, "t", [("a", 0, 1)], 0, q, k, v)])


# -- no stale bytes -----------------------------------------------------------------------------------------------


def test_a_space_never_shows_a_released_sequences_bytes() -> None:
    """Tenant a's sequence fills blocks of a small pool and is released; tenant b's space takes the whole pool.
    Opening it zeroes nothing (a space of the whole pool is bookkeeping, not a pass over the pages), yet no
    call ever reads a's bytes: the first call that touches a space block zeroes it in every plane, so a row
    whose older keys were never written attends over zeros, in this layer and in every other (other planes)."""
    h = Harness.build(MODELS["gqa"], num_blocks=18)  # G = 2; 6 writing layers: 3 pool blocks a space block
    for layer in range(h.model.num_layers):
        q, k, v = h.tensors(layer, 14)
        h.engine.attend(layer, [BatchEntry("s", 0, 14)], q, k, v, tenant="a")
    pages = (*h.engine.cache.k, *h.engine.cache.v)
    dirty = {b for p in pages for b in range(18) if p[:, b].any()}
    assert len(dirty) >= 4
    h.engine.kv.release(["s"], tenant="a")
    assert h.engine.pool.num_free == 18

    space = h.engine.open_space(6, [], tenant="b")
    assert set(space.pool_blocks()) == set(range(18)) >= dirty
    assert {b for p in pages for b in range(18) if p[:, b].any()} == dirty  # nothing zeroed at open

    def row(layer: int, written: int) -> None:
        """One row at the end of space blocks 0 and 1 (keys 0..7), its last ``written`` keys new: the older
        ones were never written, and must read as zeros."""
        q, k, v = h.tensors(layer, written)
        assert k is not None
        assert v is not None
        call = BlockCall(
            space_id=space.space_id,
            q=q,
            k=k,
            v=v,
            slots=np.arange(8 - written, 8, dtype=np.int64),
            starts=np.array([0, written], dtype=np.int64),
            seq_lens=np.array([8], dtype=np.int64),
            tables=np.array([[0, 1]], dtype=np.int64),
            tenant="b",
        )
        (out,) = h.engine.attend_blocks(layer, [call])
        assert isinstance(out, torch.Tensor), out
        zeros = np.zeros((8 - written, *k.shape[1:]))
        want = chunked_attention(
            q.double().numpy(),
            np.concatenate([zeros, k.double().numpy()]),
            np.concatenate([zeros, v.double().numpy()]),
            list(range(8 - written, 8)),
            chunk_size=0,
        )
        ok, err = within_tolerance(out.double().numpy(), want, "float32")
        assert ok, f"layer {layer}: {err}"

    row(2, 2)  # global, default scale: keys 0..5 never written
    touched = space.blocks[:2].reshape(-1).tolist()
    for p in pages:  # the two space blocks' pool blocks hold nothing but the row's two new keys, in its plane
        assert p[:, touched].count_nonzero() <= 2 * h.model.num_kv_heads * h.model.head_size
    assert {b for p in pages for b in range(18) if p[:, b].any()} - set(touched)  # the rest still untouched
    row(4, 1)  # another layer, another plane, over the same blocks: a decode over 7 zero keys
    row(5, 3)


def test_negative_slots_are_not_written() -> None:
    """Padding tokens (slot -1): nothing is written; rows of several tokens attend over their own k/v."""
    h = Harness.build(MODELS["mqa"])  # C = 4: rows [0, 4) and [4, 6); global: one row of 6
    space = h.engine.open_space(4, [], tenant="t")
    pages = _pages(h.engine)
    mgr = KVCacheManager(4, 4)
    entries = [("a", 0, 6)]
    mgr.schedule(entries)
    for layer, spec in enumerate(h.model.layers):
        q, k, v = h.tensors(layer, 6)
        call = mgr.call(space.space_id, "t", entries, spec.chunk_size, q, k, v)
        call = dataclasses.replace(call, slots=np.full(6, -1, dtype=np.int64))
        (out,) = h.engine.attend_blocks(layer, [call])
        _check(h, layer, entries, out, q, k, v)  # a row's new keys come from the call itself
    assert _same_pages(h.engine, pages)


@pytest.mark.parametrize(
    "impl",
    ["auto", "math", "triton", NATIVE],
)
def test_a_one_token_row_with_a_negative_slot_attends_over_its_own_kv(impl: str) -> None:
    h = Harness.build(MODELS["mqa"], impl=impl)
    space = h.engine.open_space(4, [], tenant="t")
    mgr = KVCacheManager(4, 4)
    entries = [("a", 0, 1)]
    mgr.schedule(entries)
    q, k, v = h.tensors(1, 1)
    call = dataclasses.replace(mgr.call(space.space_id, "t", entries, 0, q, k, v), slots=np.array([-1]))
    (out,) = h.engine.attend_blocks(1, [call])
    _check(h, 1, entries, out, q, k, v)  # one key: the output is its v, repeated over the query heads


def test_a_row_cannot_read_more_keys_than_its_space_holds() -> None:
    """Repeated table entries could make a 1-block space read millions of keys (a gather of gigabytes): a
    row's keys must fit in its space. Found by review."""
    h = Harness.build(MODELS["mqa"])
    space = h.engine.open_space(1, [], tenant="t")
    q, k, v = h.tensors(1, 1)
    width = 1000
    table = np.zeros((1, width), np.int64)  # block 0, a thousand times
    call = BlockCall(space.space_id, q, k, v, np.array([0]), np.array([0, 1]), np.array([4 * width]), table, "t")
    (out,) = h.engine.attend_blocks(1, [call])
    assert isinstance(out, InvalidBatch)
    assert "than the space holds (1)" in str(out)


def test_a_kv_sharing_layer_before_its_source_ever_wrote_is_refused() -> None:
    """A calibrating float8 cache has no scales for a source layer never written: reading it back is
    FAILED_PRECONDITION naming the layer to call first, not an internal error. Found by review."""
    h = Harness.build(MODELS["sharing"], cache_dtype="fp8_e4m3", kv_scales=KVScales(calibrate=True))
    space = h.engine.open_space(4, [], tenant="t")
    q, _, _ = h.tensors(1, 1)
    one = np.zeros((1, 1), np.int64)
    call = BlockCall(space.space_id, q, None, None, np.array([0]), np.array([0, 1]), np.array([1]), one, "t")
    (out,) = h.engine.attend_blocks(1, [call])
    assert isinstance(out, PositionMismatch)
    assert "call layer 0 first" in str(out)


# -- the pool and quotas --------------------------------------------------------------------------------------------


def test_a_space_past_the_free_pool_takes_nothing() -> None:
    h = Harness.build(MODELS["sharing"], num_blocks=20)  # 2 planes, G = 1: 2 pool blocks a space block
    small = h.engine.open_space(3, [], tenant="t")
    assert h.engine.pool.num_free == 14
    with pytest.raises(OutOfBlocks, match="needs 16 pool blocks"):
        h.engine.open_space(8, [], tenant="t")
    assert h.engine.pool.num_free == 14
    assert h.engine.stats().spaces_by_tenant == {"t": 1}
    assert h.engine.open_space(7, [], tenant="t").blocks.size == 14  # exactly what is left
    assert h.engine.pool.num_free == 0
    assert h.engine.kv.spaces.close(small.space_id, tenant="t") == 6
    assert h.engine.pool.num_free == 6


def test_a_bad_space_request_is_refused_naming_the_argument() -> None:
    h = Harness.build(MODELS["sharing"], num_blocks=20)
    for size in (0, -1, 21):
        with pytest.raises(InvalidArgument, match="num_blocks"):
            h.engine.open_space(size, [], tenant="t")
    with pytest.raises(InvalidArgument, match="layer_planes has 3 entries"):
        h.engine.open_space(2, [0, 0, 0], tenant="t")
    with pytest.raises(InvalidArgument, match=r"layer_planes\[2\] is 4"):
        h.engine.open_space(2, [0, 0, 4, 0], tenant="t")
    assert h.engine.pool.num_free == 20
    assert h.engine.stats().spaces_by_tenant == {}
    space = h.engine.open_space(2, [1, 7, 1, 7], tenant="t")  # one plane: layers 0 and 2 share it
    assert space.layer_planes == (1, 1, 1, 1)
    assert space.num_planes == 2
    assert space.blocks.shape == (2, 2)


def test_a_tenants_quota_bounds_its_spaces() -> None:
    h = Harness.build(MODELS["sharing"], num_blocks=40)
    h.engine.kv.quotas["t"] = Quota(max_blocks=10)
    first = h.engine.open_space(3, [], tenant="t")  # 6 pool blocks
    with pytest.raises(QuotaExceeded, match="max_kv_blocks"):
        h.engine.open_space(3, [], tenant="t")
    assert h.engine.pool.num_free == 34
    assert h.engine.open_space(3, [], tenant="other").blocks.size == 6  # another tenant is not bounded
    h.engine.open_space(2, [], tenant="t")  # 10 of 10
    assert h.engine.pool.usage()["t"] == 10
    h.engine.kv.spaces.close(first.space_id, tenant="t")
    assert h.engine.pool.usage()["t"] == 4
    h.engine.open_space(3, [], tenant="t")  # room again


def test_closing_returns_the_blocks_and_forgets_the_space() -> None:
    h = Harness.build(MODELS["gqa"], num_blocks=30)
    space = h.engine.open_space(4, [], tenant="t")
    assert h.engine.pool.num_free == 30 - 12
    with pytest.raises(UnknownSpace):
        h.engine.kv.spaces.close(space.space_id, tenant="u")  # not another tenant's to close
    assert h.engine.kv.spaces.close(space.space_id, tenant="t") == 12
    assert h.engine.pool.num_free == 30
    assert h.engine.stats().spaces_by_tenant == {}
    with pytest.raises(UnknownSpace):
        h.engine.kv.spaces.get(space.space_id, tenant="t")
    with pytest.raises(UnknownSpace):
        h.engine.kv.spaces.close(space.space_id, tenant="t")
    assert h.engine.pool.num_free == 30


def test_idle_spaces_are_evicted_and_used_ones_kept() -> None:
    h = Harness.build(MODELS["mqa"], num_blocks=20)
    idle, used = (h.engine.open_space(2, [], tenant=t) for t in ("a", "b"))
    idle.last_used -= 100
    used.last_used -= 100
    assert h.engine.kv.spaces.expire(50.0, now=time.monotonic() - 200) == []  # none idle that long then
    mgr = KVCacheManager(2, 4)
    mgr.schedule([("s", 0, 3)])
    q, k, v = h.tensors(0, 3)
    (out,) = h.engine.attend_blocks(0, [mgr.call(used.space_id, "b", [("s", 0, 3)], 4, q, k, v)])
    assert isinstance(out, torch.Tensor)  # a call marks its space used
    assert h.engine.kv.spaces.expire(50.0) == [("a", idle.space_id)]
    assert h.engine.pool.num_free == 20 - 4
    assert h.engine.stats().spaces_by_tenant == {"b": 1}
    assert h.engine.kv.spaces.expire(50.0, now=time.monotonic() + 100) == [("b", used.space_id)]
    assert h.engine.pool.num_free == 20


def test_a_lease_closes_a_space_its_client_stopped_renewing_whatever_the_idle_timeout() -> None:
    """A space opened with a lease (vLLM's plugin renews it) is closed once unused that long, also on a server
    that never evicts idle KV (--idle-timeout-s 0); a renewal or a call starts the lease again; without a lease
    of its own a space follows the idle timeout, and the shorter of the two wins."""
    h = Harness.build(MODELS["mqa"], num_blocks=40)
    spaces = h.engine.kv.spaces
    t0 = time.monotonic()
    leased = spaces.open(2, [], tenant="a", lease_s=10.0, now=t0)
    renewed = spaces.open(2, [], tenant="a", lease_s=10.0, now=t0)
    plain = spaces.open(2, [], tenant="b", now=t0)
    long = spaces.open(2, [], tenant="b", lease_s=1000.0, now=t0)
    assert spaces.expire(0.0, now=t0 + 9) == []
    spaces.renew(renewed.space_id, tenant="a", now=t0 + 9)
    with pytest.raises(UnknownSpace):
        spaces.renew(renewed.space_id, tenant="b")  # not another tenant's to renew
    assert spaces.expire(0.0, now=t0 + 11) == [("a", leased.space_id)]
    assert spaces.expire(0.0, now=t0 + 10_000) == [("a", renewed.space_id), ("b", long.space_id)]
    assert [s.space_id for s in spaces.of("b")] == [plain.space_id]  # no lease, no idle timeout: kept
    again = spaces.open(2, [], tenant="b", lease_s=1000.0, now=t0 + 10_000)
    assert spaces.expire(60.0, now=t0 + 10_061) == [("b", plain.space_id), ("b", again.space_id)]  # the shorter
    assert h.engine.pool.num_free == 40
    for bad in (-1.0, 0.5, MAX_LEASE_S + 1, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="lease_s"):
            spaces.open(2, [], tenant="a", lease_s=bad)
    assert h.engine.pool.num_free == 40


def test_a_tenant_lists_its_own_spaces_only() -> None:
    h = Harness.build(MODELS["mqa"], num_blocks=40)
    spaces = h.engine.kv.spaces
    mine = [h.engine.open_space(n, [], tenant="a") for n in (3, 1)]
    theirs = h.engine.open_space(2, [], tenant="b")
    assert [s.space_id for s in spaces.of("a")] == [s.space_id for s in mine]
    assert [s.space_id for s in spaces.of("b")] == [theirs.space_id]
    assert spaces.of("c") == []
    spaces.close(mine[0].space_id, tenant="a")
    assert [s.space_id for s in spaces.of("a")] == [mine[1].space_id]


def test_a_tenant_opens_at_most_the_pools_size_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening and closing the largest space in a loop costs the engine the pool's bookkeeping each time: a
    tenant may open the pool's size in pool blocks per OPEN_WINDOW_S (at least OPEN_FLOOR: zero here),
    refilled continuously; other tenants have their own allowance."""
    monkeypatch.setattr(spaces_module, "OPEN_FLOOR", 0)
    h = Harness.build(MODELS["mqa"], num_blocks=40)  # 2 layers, 2 planes: a space block is 2 pool blocks
    spaces = h.engine.kv.spaces
    assert spaces.open_allowance == 40
    t0 = time.monotonic()
    first = spaces.open(15, [], tenant="a", now=t0)
    spaces.close(first.space_id, tenant="a")
    free = h.engine.pool.num_free
    with pytest.raises(QuotaExceeded, match=r"40 pool blocks per 10 s .* retry in 5\.0 s"):
        spaces.open(15, [], tenant="a", now=t0)  # 10 left, 30 needed: 20 more blocks at 4 per second
    assert h.engine.pool.num_free == free
    assert spaces.by_tenant() == {}
    spaces.close(spaces.open(5, [], tenant="a", now=t0).space_id, tenant="a")  # what is left may be used
    spaces.close(spaces.open(20, [], tenant="b", now=t0).space_id, tenant="b")  # another tenant's own allowance
    with pytest.raises(QuotaExceeded):
        spaces.open(1, [], tenant="a", now=t0 + 0.1)
    spaces.open(20, [], tenant="a", now=t0 + OPEN_WINDOW_S)  # full again after a window


def test_a_tenant_holds_at_most_its_spaces() -> None:
    h = Harness.build(MODELS["mqa"], num_blocks=4 * MAX_SPACES_PER_TENANT)
    spaces = [h.engine.open_space(1, [], tenant="t") for _ in range(MAX_SPACES_PER_TENANT)]
    assert len({s.space_id for s in spaces}) == MAX_SPACES_PER_TENANT
    free = h.engine.pool.num_free
    with pytest.raises(OutOfBlocks, match=f"{MAX_SPACES_PER_TENANT} block spaces"):
        h.engine.open_space(1, [], tenant="t")
    assert h.engine.pool.num_free == free
    h.engine.open_space(1, [], tenant="u")  # others are not counted against it
    h.engine.kv.spaces.close(spaces[0].space_id, tenant="t")
    h.engine.open_space(1, [], tenant="t")
    assert h.engine.stats().spaces_by_tenant == {"t": MAX_SPACES_PER_TENANT, "u": 1}


# -- a float8 cache -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scales", [KVScales((0.05,), (0.02,)), KVScales(calibrate=True)], ids=["fixed", "calibrated"])
def test_a_float8_cache_gives_what_the_sequence_api_gives(scales: KVScales) -> None:
    """The same tokens through a block space (tenant b) and as sequences (tenant a) of one engine; the block
    calls go first, so a calibrating cache takes its scales from them."""
    h = Harness.build(MODELS["sharing"], cache_dtype="fp8_e4m3", kv_scales=scales)
    assert h.engine.cache.k[0].dtype == torch.float8_e4m3fn
    space = h.engine.open_space(SPACE_BLOCKS, [], tenant="b")
    mgr = KVCacheManager(SPACE_BLOCKS, 4, seed=6)
    for entries in STEPS[:4]:
        mgr.schedule(entries)
        for layer, spec in enumerate(h.model.layers):
            q, k, v = h.tensors(layer, _tokens(entries))
            call = mgr.call(space.space_id, "b", entries, spec.chunk_size, q, k, v)
            (out,) = h.engine.attend_blocks(layer, [call])
            _check(h, layer, entries, out, q, k, v)
            assert isinstance(out, torch.Tensor)
            seq = h.engine.attend(layer, [BatchEntry(*e) for e in entries], q, k, v, tenant="a")
            assert torch.allclose(out, seq, rtol=0, atol=1e-5), float((out - seq).abs().max())


# -- the work of one call ------------------------------------------------------------------------------------


def test_a_call_past_the_work_bound_is_refused_after_its_own_checks_and_changes_nothing() -> None:
    """Issue 35.4: rows x keys read through repeated table entries held the engine for seconds. An engine with
    max_call_work refuses a block call computing more query-key pairs (InvalidBatch naming the count and the
    bound), after the rows' own checks, so a malformed call is still told what is malformed; within the bound it
    is served."""
    model = MODELS["mqa"]
    engine = Engine(EngineConfig(model, CacheConfig(block_size=4, num_blocks=64), device="cpu", max_call_work=1000))
    assert engine.max_call_work == 1000
    assert Engine(EngineConfig(model, CacheConfig(block_size=4, num_blocks=8), device="cpu")).max_call_work == 0
    assert Engine(
        EngineConfig(model, CacheConfig(block_size=4, num_blocks=8), device="cpu", max_call_work=None)
    ).max_call_work == (1 << 22)  # the server's default on the CPU
    space = engine.open_space(32, [], tenant="t")  # the whole pool: 2 planes a space block

    def rows(n: int, keys: int) -> BlockCall:
        """n decode rows, each reading keys 0 .. keys - 1 of blocks 0 .. and its own last block (31 - r)."""
        blocks = -(-keys // 4)
        table = np.tile(np.arange(blocks), (n, 1))
        table[:, -1] = 31 - np.arange(n)
        slots = table[:, -1] * 4 + (keys - 1) % 4
        g = torch.Generator().manual_seed(n)
        q = torch.randn(n, model.num_heads, model.head_size, generator=g)
        kv = torch.randn(n, model.num_kv_heads, model.head_size, generator=g)
        return BlockCall(space.space_id, q, kv, kv, slots, np.arange(n + 1), np.full(n, keys), table, "t")

    pages = _pages(engine)
    (refused,) = engine.attend_blocks(1, [rows(16, 64)])  # 16 x 64 = 1,024 pairs
    assert isinstance(refused, InvalidBatch), refused
    assert "call's work is 1,024 (the keys each new token sees" in str(refused)
    assert "at most 1,000 per call (--max-call-work" in str(refused)
    assert _same_pages(engine, pages)
    bad = dataclasses.replace(rows(16, 64), seq_lens=np.full(16, 10**6))  # malformed and past the bound
    (refused,) = engine.attend_blocks(1, [bad])
    assert "seq_lens[0] needs more blocks" in str(refused)
    (out,) = engine.attend_blocks(1, [rows(15, 64)])  # 960 pairs
    assert isinstance(out, torch.Tensor), out
    two = rows(16, 64)  # row 0 brings keys 62 and 63: a row of 2 new tokens is computed apart, a piece more
    two = dataclasses.replace(two, starts=np.array([0, *range(2, 17)]), seq_lens=two.seq_lens[:15])
    two = dataclasses.replace(two, tables=two.tables[:15], slots=np.array([31 * 4 + 2, 31 * 4 + 3, *two.slots[1:15]]))
    (refused,) = engine.attend_blocks(1, [two])
    assert f"call's work is {15 * 64 + 63 + PIECE_WORK:,}" in str(refused), refused


@pytest.mark.parametrize("cache", [None, "fp8_e4m3"])
@pytest.mark.parametrize("model", ["gqa", "alibi"])
@pytest.mark.parametrize("impl", ["auto", "math", "triton", NATIVE])
def test_a_padded_decode_reads_its_context_from_the_pages_and_its_key_from_its_call(
    impl: str, model: str, cache: str | None
) -> None:
    """A one-token row whose slot is -1 (vLLM's padding) after 9 written keys: its key is not in the pages, so it
    attends over the 9 there and its own from the call (the native kernel reads the 9, then the own key as it
    would be stored, as its last key); beside a written decode in the same call, which reads its own key from the
    pages."""
    scales = KVScales((0.05,), (0.02,)) if cache else None
    h = Harness.build(MODELS[model], impl=impl, cache_dtype=cache, kv_scales=scales)
    space = h.engine.open_space(16, [], tenant="t")
    mgr = KVCacheManager(16, 4, seed=9)
    prefill, step = [("a", 0, 9), ("b", 0, 6)], [("a", 9, 1), ("b", 6, 1)]
    _run_step(h, mgr, space, prefill, tenant="t")
    mgr.schedule(step)
    for layer, spec in enumerate(h.model.layers):
        q, k, v = h.tensors(layer, 2)
        call = mgr.call(space.space_id, "t", step, spec.chunk_size, q, k, v)
        call = dataclasses.replace(call, slots=np.array([-1, call.slots[1]]))  # a's decode is padding
        (out,) = h.engine.attend_blocks(layer, [call])
        _check(h, layer, step, out, q, k, v)
