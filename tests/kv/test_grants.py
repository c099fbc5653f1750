"""Grants (kv/grants.py) without a server: the bookkeeping over a real KV manager's pool, spaces and quotas
(names, checks, expiry at explicit times, the per-tenant cap, quotas, blocks back to the pool, who may take),
and the engine's GrantBlocks / CopyBlocks on its pages (Engine.grant_blocks, Engine.copy_blocks): the bytes
parked and copied exactly, float8 included, a stale block parked as zeros, and nothing changed by a refusal.
The service's side (statuses, messages, metrics, races) is tests/service/test_block_handoff.py's."""

from __future__ import annotations

import math
import secrets

import numpy as np
import pytest
import torch

from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.engine.types import GrantAsk
from chunkattn_server.errors import (
    GrantExists,
    InvalidArgument,
    OutOfBlocks,
    QuotaExceeded,
    UnknownGrant,
    UnknownSpace,
)
from chunkattn_server.kv import grants as grants_module
from chunkattn_server.kv.grants import (
    DEFAULT_TTL_S,
    GRANT_ID,
    LEAVING_GRACE_S,
    MAX_TTL_S,
    GrantState,
    block_ids,
    check_grant_id,
    same_layout,
)
from chunkattn_server.kv.manager import KVManager
from chunkattn_server.kv.records import Quota
from chunkattn_server.kv.scales import KVScales
from chunkattn_server.kv.spaces import SpaceState

# Two chunked and two global layers: KV groups of 2 layers, so a pool block holds 2 planes (G = 2) and a space
# of 4 planes takes 2 pool blocks per block.
MODEL = ModelShape(
    num_heads=4, num_kv_heads=2, head_size=8, layers=(LayerSpec(8), LayerSpec(8), LayerSpec(0), LayerSpec(0))
)
POOL, BS = 64, 4
NOW = 1000.0


def config(dtype: str = "float32") -> EngineConfig:
    scales = KVScales((0.05,) * 4, (0.5,) * 4) if dtype.startswith("fp8") else None
    return EngineConfig(MODEL, CacheConfig(block_size=BS, num_blocks=POOL, dtype=dtype, scales=scales), device="cpu")


@pytest.fixture
def kv() -> KVManager:
    return KVManager(config(), POOL, lambda src, dst: None)


def name() -> str:
    return secrets.token_hex(16)


def add(kv: KVManager, space: SpaceState, ids: list[int], grant_id: str = "", **kw: object) -> GrantState:
    args: dict[str, object] = {"num_tokens": 0, "ttl_s": 0.0, "to_tenant": "", "now": NOW, **kw}
    grant, _ = kv.grants.add(space, ids, grant_id or name(), **args)  # type: ignore[arg-type]
    return grant


# -- checks -----------------------------------------------------------------------------------------------------


def test_grant_names_are_32_to_64_characters_of_the_url_safe_alphabet() -> None:
    for ok in ("a" * 32, "Z" * 64, "-_" * 16, secrets.token_hex(16), secrets.token_urlsafe(32)):
        check_grant_id(ok)
    for bad in ("", "a" * 31, "a" * 65, "a" * 31 + "!", "a" * 31 + "\u00e9", "a" * 31 + "\n", " " + "a" * 32):
        with pytest.raises(InvalidArgument) as e:
            check_grant_id(bad)
        assert f"grant_id ({len(bad)} characters)" in str(e.value)
        assert bad.strip() == "" or bad not in str(e.value)  # never echoed
    assert not GRANT_ID.fullmatch("a" * 32 + "\n")


def test_block_ids_name_the_first_bad_entry() -> None:
    assert block_ids("f", [3, 0, 3], 4, unique=False).tolist() == [3, 0, 3]
    for values, unique, words in (
        ([], True, "f is empty"),
        ([0, 4], True, "f[1] is 4; expected a block id 0 .. 3"),
        ([-1], False, "f[0] is -1"),
        ([2**31 - 1], False, f"f[0] is {2**31 - 1}"),
        ([1, 2, 1], True, "f[2] is 1, listed before"),
    ):
        with pytest.raises(InvalidArgument) as e:
            block_ids("f", values, 4, unique=unique)
        assert words in str(e.value)


def test_same_layout_compares_the_planes_of_every_layer(kv: KVManager) -> None:
    default = kv.spaces.open(1, [], tenant="a")
    other = kv.spaces.open(1, [0, 0, 1, 1], tenant="a")
    same_layout(default.layer_planes, default.num_planes, default, "x")
    with pytest.raises(InvalidArgument, match="x and the destination space are laid out otherwise"):
        same_layout(default.layer_planes, default.num_planes, other, "x")
    with pytest.raises(InvalidArgument, match="laid out otherwise"):
        same_layout(default.layer_planes, default.num_planes + 1, default, "x")


# -- Grants -----------------------------------------------------------------------------------------------------


def test_a_grant_parks_pool_blocks_charged_to_its_tenant_and_release_returns_them(kv: KVManager) -> None:
    space = kv.spaces.open(8, [], tenant="a")
    assert space.blocks.shape == (8, 2)  # 4 planes, 2 per pool block
    free = kv.pool.num_free
    grant, checked = kv.grants.add(space, [5, 1, 2], name(), num_tokens=10, ttl_s=0, to_tenant="", now=NOW)
    assert checked.tolist() == [5, 1, 2]
    assert grant.blocks.shape == (3, 2)
    assert (grant.num_blocks, grant.num_tokens, grant.expires) == (3, 10, NOW + DEFAULT_TTL_S)
    assert (grant.layer_planes, grant.num_planes) == (space.layer_planes, space.num_planes)
    assert not set(grant.blocks.reshape(-1).tolist()) & set(space.blocks.reshape(-1).tolist())
    assert kv.pool.num_free == free - 6
    assert kv.pool.used_by("a") == 16 + 6
    assert (len(kv.grants), kv.grants.parked_blocks(), kv.grants.by_tenant()) == (1, 6, {"a": 1})
    assert kv.grants.release(grant) == 6
    assert kv.pool.num_free == free
    assert kv.pool.used_by("a") == 16
    assert (len(kv.grants), kv.grants.parked_blocks(), kv.grants.by_tenant()) == (0, 0, {})
    with pytest.raises(UnknownGrant):
        kv.grants.get(grant.grant_id, tenant="a", now=NOW)
    add(kv, space, [0], grant.grant_id)  # the name is free again


@pytest.mark.parametrize(
    ("ids", "kw", "words"),
    [
        ([8], {}, "block_ids[0] is 8"),
        ([0, 0], {}, "listed before"),
        ([], {}, "block_ids is empty"),
        ([0, 1], {"num_tokens": 9}, "num_tokens is 9; 2 blocks of 4 tokens hold 0 .. 8"),
        ([0], {"num_tokens": -1}, "num_tokens is -1"),
        ([0], {"ttl_s": -1.0}, "ttl_s is -1"),
        ([0], {"ttl_s": 0.999}, "ttl_s is 0.999"),
        ([0], {"ttl_s": MAX_TTL_S + 1}, "ttl_s is 3601"),
        ([0], {"ttl_s": math.nan}, "ttl_s is nan"),
        ([0], {"ttl_s": math.inf}, "ttl_s is inf"),
        ([0], {"to_tenant": "t" * 257}, "to_tenant is longer than 256 bytes"),
        ([0], {"to_tenant": "\u00e9" * 129}, "to_tenant is longer than 256 bytes"),
        ([0], {"grant_id": "short"}, "grant_id (5 characters)"),
    ],
)
def test_a_malformed_grant_takes_nothing(kv: KVManager, ids: list[int], kw: dict[str, object], words: str) -> None:
    space = kv.spaces.open(8, [], tenant="a")
    free = kv.pool.num_free
    kw = dict(kw)
    grant_id = str(kw.pop("grant_id", name()))
    with pytest.raises(InvalidArgument) as e:
        add(kv, space, ids, grant_id, **kw)
    assert words in str(e.value)
    assert (kv.pool.num_free, len(kv.grants), kv.grants.by_tenant()) == (free, 0, {})
    with pytest.raises(UnknownGrant):
        kv.grants.get(grant_id, tenant="a", now=NOW)


def test_the_ttl_bounds_are_served(kv: KVManager) -> None:
    space = kv.spaces.open(2, [], tenant="a")
    assert add(kv, space, [0], ttl_s=1).expires == NOW + 1
    assert add(kv, space, [0], ttl_s=MAX_TTL_S).expires == NOW + MAX_TTL_S
    assert add(kv, space, [0, 1], num_tokens=8).num_tokens == 8


def test_a_name_in_use_is_refused_whoever_holds_it(kv: KVManager) -> None:
    a, b = kv.spaces.open(2, [], tenant="a"), kv.spaces.open(2, [], tenant="b")
    grant = add(kv, a, [0])
    free = kv.pool.num_free
    for space in (a, b):
        with pytest.raises(GrantExists):
            add(kv, space, [1], grant.grant_id)
    assert (kv.pool.num_free, len(kv.grants)) == (free, 1)


def test_expiry_at_explicit_times(kv: KVManager) -> None:
    space = kv.spaces.open(4, [], tenant="a")
    assert kv.grants.next_expiry() is None
    short = add(kv, space, [0], ttl_s=1)
    long = add(kv, space, [1], ttl_s=30)
    default = add(kv, space, [2])
    assert kv.grants.next_expiry() == NOW + 1
    assert kv.grants.get(short.grant_id, tenant="a", now=NOW + 0.999) is short
    with pytest.raises(UnknownGrant):  # past its ttl: gone to a taker even before a sweep ends it
        kv.grants.get(short.grant_id, tenant="a", now=NOW + 1)
    free = kv.pool.num_free
    assert kv.grants.expire(now=NOW + 0.5) == 0
    assert kv.grants.expire(now=NOW + 1) == 1
    assert kv.pool.num_free == free + 2
    assert kv.grants.next_expiry() == NOW + 30
    assert kv.grants.expire(now=NOW + 59.999) == 1  # the 30 s one
    assert kv.grants.next_expiry() == NOW + DEFAULT_TTL_S
    assert kv.grants.get(default.grant_id, tenant="a", now=NOW + 59.999) is default
    assert kv.grants.expire(now=NOW + DEFAULT_TTL_S) == 1
    assert (kv.grants.next_expiry(), len(kv.grants), kv.grants.by_tenant()) == (None, 0, {})
    assert long.grant_id not in kv.grants.by_tenant()
    assert kv.pool.num_free == free + 6


def test_who_may_take_a_grant(kv: KVManager) -> None:
    space = kv.spaces.open(2, [], tenant="a")
    own = add(kv, space, [0])
    to_b = add(kv, space, [1], to_tenant="b")
    assert [own.may_take(t) for t in ("a", "b", "")] == [True, False, False]
    assert [to_b.may_take(t) for t in ("a", "b", "c")] == [True, True, False]
    assert kv.grants.get(to_b.grant_id, tenant="b", now=NOW) is to_b
    for tenant in ("b", "c", ""):
        with pytest.raises(UnknownGrant) as e:
            kv.grants.get(own.grant_id, tenant=tenant, now=NOW)
        assert own.grant_id not in str(e.value)
    # A name never issued, malformed, or another tenant's: the same words.
    messages = set()
    for grant_id, tenant in ((name(), "a"), ("x" * 10_000, "a"), ("", "a"), (own.grant_id, "b")):
        with pytest.raises(UnknownGrant) as e:
            kv.grants.get(grant_id, tenant=tenant, now=NOW)
        messages.add(str(e.value))
    assert len(messages) == 1
    # A refused get takes nothing: the grant is its owner's still.
    assert kv.grants.get(own.grant_id, tenant="a", now=NOW) is own


def test_a_tenant_holds_at_most_max_grants_open(kv: KVManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grants_module, "MAX_GRANTS_PER_TENANT", 3)
    space = kv.spaces.open(2, [], tenant="a")
    held = [add(kv, space, [0]) for _ in range(3)]
    free = kv.pool.num_free
    with pytest.raises(OutOfBlocks, match="3 grants open, the most it may"):
        add(kv, space, [0])
    assert kv.pool.num_free == free
    other = kv.spaces.open(2, [], tenant="b")
    add(kv, other, [0])  # another tenant's count is its own
    kv.grants.release(held[0])
    add(kv, space, [0])
    assert kv.grants.by_tenant() == {"a": 3, "b": 1}


def test_the_parked_blocks_count_against_the_quota(kv: KVManager) -> None:
    kv.quotas["q"] = Quota(max_blocks=10)
    space = kv.spaces.open(3, [], tenant="q")  # 6 pool blocks
    first = add(kv, space, [0, 1])  # 4 more: 10
    free = kv.pool.num_free
    with pytest.raises(QuotaExceeded, match="max_kv_blocks"):
        add(kv, space, [2])
    assert (kv.pool.num_free, len(kv.grants)) == (free, 1)
    with pytest.raises(QuotaExceeded):  # nor may the tenant open more while the grant holds its blocks
        kv.spaces.open(1, [], tenant="q")
    kv.grants.release(first)
    add(kv, space, [2])


def test_the_pool_bounds_a_grant(kv: KVManager) -> None:
    space = kv.spaces.open(POOL // 2 - 1, [], tenant="a")  # leaves 2 pool blocks: one space block's worth
    assert kv.pool.num_free == 2
    with pytest.raises(OutOfBlocks, match="parks 4 pool blocks and the pool has 2 free"):
        add(kv, space, [0, 1])
    assert (kv.pool.num_free, len(kv.grants)) == (2, 0)
    add(kv, space, [0])
    assert kv.pool.num_free == 0


def test_a_two_plane_space_parks_one_pool_block_per_block(kv: KVManager) -> None:
    space = kv.spaces.open(4, [0, 1, 0, 1], tenant="a")
    assert (space.num_planes, space.blocks.shape) == (2, (4, 1))
    grant = add(kv, space, [3, 2])
    assert grant.blocks.shape == (2, 1)
    assert kv.grants.parked_blocks() == 2


# -- the engine's pages -----------------------------------------------------------------------------------------


def pages_of(engine: Engine, pool_blocks: np.ndarray) -> list[torch.Tensor]:
    """The bytes of ``pool_blocks`` [n, per block] in every plane, K and V: per plane of the cache, [Hkv, n *
    per block, bs * D * itemsize] uint8 (copies)."""
    index = torch.tensor(pool_blocks.reshape(-1), dtype=torch.int64)
    return [pages.view(torch.uint8).index_select(1, index).clone() for pages in (*engine.cache.k, *engine.cache.v)]


def scribble(engine: Engine, pool_blocks: np.ndarray, seed: int) -> None:
    """Random bytes in ``pool_blocks`` of every plane (what calls would have written)."""
    g = torch.Generator().manual_seed(seed)
    index = pool_blocks.reshape(-1).tolist()
    for pages in (*engine.cache.k, *engine.cache.v):
        raw = pages.view(torch.uint8)
        raw[:, index] = torch.randint(0, 256, raw[:, index].shape, generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_the_engine_parks_and_copies_every_byte(dtype: str) -> None:
    e = Engine(config(dtype))
    source = e.open_space(8, [], tenant="a")
    source.stale[:] = False  # written by calls
    scribble(e, source.blocks, seed=1)
    original = pages_of(e, source.blocks[[6, 2, 3]])
    done = e.grant_blocks(GrantAsk(source.space_id, [6, 2, 3], "g" * 32, 12, 0, ""), tenant="a")
    assert (done.blocks, done.pool_blocks, done.num_tokens) == (3, 6, 12)
    assert done.bytes == 6 * e.bytes_per_block
    scribble(e, source.blocks, seed=2)  # the grantor reuses its blocks: the grant is a copy

    dest = e.open_space(8, [], tenant="a")
    free = e.pool.num_free
    taken = e.copy_blocks(dest.space_id, [1, 7, 0], [], grant_id="g" * 32, tenant="a")
    assert (taken.blocks, taken.pool_blocks, taken.bytes, taken.num_tokens) == (3, 6, done.bytes, 12)
    assert e.pool.num_free == free + 6
    assert dest.stale.tolist() == [False, False, True, True, True, True, True, False]
    for before, after in zip(original, pages_of(e, dest.blocks[[1, 7, 0]]), strict=True):
        assert torch.equal(before, after)
    with pytest.raises(UnknownGrant):
        e.copy_blocks(dest.space_id, [1, 7, 0], [], grant_id="g" * 32, tenant="a")

    # Space to space, within one space too (a rotation: each block read before it is written).
    now = pages_of(e, source.blocks[[0, 1, 2]])
    e.copy_blocks(source.space_id, [1, 2, 0], [0, 1, 2], space_id=source.space_id, tenant="a")
    for before, after in zip(now, pages_of(e, source.blocks[[1, 2, 0]]), strict=True):
        assert torch.equal(before, after)


def test_a_stale_block_parks_as_zeros_and_a_refused_copy_changes_nothing() -> None:
    e = Engine(config())
    first = e.open_space(POOL // 2, [], tenant="a")  # the whole pool
    first.stale[:] = False
    scribble(e, first.blocks, seed=3)
    e.close_space(first.space_id, tenant="a")
    source = e.open_space(4, [], tenant="b")  # over the first's bytes, every block stale
    e.grant_blocks(GrantAsk(source.space_id, [0, 1], "z" * 32, 0, 0, ""), tenant="b")
    assert source.stale.tolist() == [False, False, True, True]
    dest = e.open_space(4, [0, 0, 1, 1], tenant="b")
    same = e.open_space(4, [], tenant="b")
    same.stale[:] = False
    scribble(e, same.blocks, seed=4)
    kept = pages_of(e, same.blocks)
    free = e.pool.num_free
    for kwargs, error in (
        ({"dest_space_id": dest.space_id, "dest_ids": [0, 1]}, InvalidArgument),  # laid out otherwise
        ({"dest_space_id": same.space_id, "dest_ids": [0]}, InvalidArgument),  # counts differ
        ({"dest_space_id": same.space_id, "dest_ids": [0, 0]}, InvalidArgument),
        ({"dest_space_id": same.space_id, "dest_ids": [0, 4]}, InvalidArgument),
        ({"dest_space_id": same.space_id, "dest_ids": [0, 1], "tenant": "a"}, UnknownSpace),  # not a's
    ):
        args: dict[str, object] = {"tenant": "b", **kwargs}
        with pytest.raises(error):
            e.copy_blocks(source_ids=[], grant_id="z" * 32, **args)  # type: ignore[arg-type]
        assert e.pool.num_free == free
        assert len(e.kv.grants) == 1
        for before, after in zip(kept, pages_of(e, same.blocks), strict=True):
            assert torch.equal(before, after)
    e.copy_blocks(same.space_id, [3, 2], [], grant_id="z" * 32, tenant="b")
    for after in pages_of(e, same.blocks[[3, 2]]):
        assert not after.any()  # the previous owner's bytes never reach the grant
    assert e.pool.num_free == free + 4


def test_the_sweep_ends_grants_past_their_ttl_and_reports_the_next() -> None:
    e = Engine(config())
    space = e.open_space(2, [], tenant="a")
    e.grant_blocks(GrantAsk(space.space_id, [0], "s" * 32, 0, 1, ""), tenant="a")
    swept = e.sweep(0, sequences=False)
    assert swept.grants_ended == 0
    assert swept.due is not None
    e.kv.grants.expire(now=swept.due)
    assert len(e.kv.grants) == 0
    assert e.sweep(0, sequences=False).due is None


def test_a_park_that_fails_leaves_no_grant_and_the_source_still_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that fails (out of memory, on a device) must not leave an open grant over pool blocks that still
    hold a previous owner's bytes, nor a source block counted as zeroed that was not."""
    e = Engine(config())
    source = e.open_space(8, [], tenant="a")
    free, stale = e.pool.num_free, source.stale.copy()

    def fail(*args: object) -> None:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(e.cache, "zero_blocks", fail)
    with pytest.raises(torch.OutOfMemoryError):
        e.grant_blocks(GrantAsk(source.space_id, [0, 1], "f" * 32, 8, 0, "b"), tenant="a")
    assert (len(e.kv.grants), e.kv.grants.parked_blocks(), e.pool.num_free) == (0, 0, free)
    assert source.stale.tolist() == stale.tolist()
    monkeypatch.undo()
    monkeypatch.setattr(e.cache, "copy_blocks", fail)
    with pytest.raises(torch.OutOfMemoryError):
        e.grant_blocks(GrantAsk(source.space_id, [0, 1], "f" * 32, 8, 0, "b"), tenant="a")
    assert (len(e.kv.grants), e.pool.num_free) == (0, free)
    with pytest.raises(UnknownGrant):
        e.kv.grants.get("f" * 32, tenant="b")


def test_grants_and_copies_spend_the_tenants_allowance_of_blocks(kv: KVManager) -> None:
    """Taking and zeroing pool blocks costs the engine per block: grants spend the same allowance as opening
    spaces (the pool's size, at least OPEN_FLOOR, per OPEN_WINDOW_S), and past it are refused saying when to
    retry, nothing taken."""
    space = kv.spaces.open(4, [], tenant="a", now=NOW)
    kv.spaces.charge("a", kv.spaces.open_allowance - 4 * space.blocks.shape[1] - 1, now=NOW)  # nearly spent
    free = kv.pool.num_free
    with pytest.raises(QuotaExceeded, match=r"grants, copies\) and has used that many lately.*retry in"):
        kv.grants.add(space, [0, 1], name(), num_tokens=0, ttl_s=0, to_tenant="", now=NOW)
    assert (kv.pool.num_free, len(kv.grants)) == (free, 0)
    kv.spaces.charge("b", 1, now=NOW)  # another tenant's allowance is its own: not refused


def test_a_leaving_grant_nobody_releases_ends_after_its_push_deadline(kv: KVManager) -> None:
    space = kv.spaces.open(4, [], tenant="a", now=NOW)
    grant, _ = kv.grants.add(space, [0], name(), num_tokens=0, ttl_s=3600, to_tenant="", now=NOW)
    kv.grants.detach(grant, within_s=10, now=NOW)
    assert kv.grants.next_expiry() == NOW + 10 + LEAVING_GRACE_S
    assert kv.grants.expire(now=NOW + 10) == 0
    assert kv.grants.expire(now=NOW + 10 + LEAVING_GRACE_S) == 1
    assert (len(kv.grants), kv.grants.parked_blocks()) == (0, 0)
    assert kv.grants.release(grant) == 0  # released once: a late release by its push changes nothing
