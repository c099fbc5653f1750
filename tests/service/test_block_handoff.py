"""Block handoff (GrantBlocks, CopyBlocks: issue 38) through a real server subprocess, the real clients, and raw
bytes where the client would refuse to send something. The contract is the proto's (GrantBlocks, CopyBlocks
and their messages); kv/grants.py's bookkeeping alone is tests/kv/test_grants.py's. The shared server, its
tenants and callers are in conftest.py and tests/helpers/blockapi.py.

Covered here:

* exactness: a sequence prefilled across both chunk boundaries (16, 32) into space A through every layer (rows
  as vLLM's metadata builder builds them), granted, and taken into other, shuffled block ids of a space B; the
  next token decoded in A and in B with the same q/k/v gives bitwise the same output in every layer. The same
  for a space-to-space CopyBlocks (no grant), and across tenants (a grant to_tenant "b", taken by "b" into its
  own space); a grant's part taken (source_block_ids) lands where asked; spaces of two planes (vLLM's hybrid
  layout) hand over alike;
* after a take nothing is left: the grant is gone (a second take NOT_FOUND), the pool's free blocks are back
  once the spaces close, the gauges chunkattn_grants and chunkattn_grant_parked_blocks back to 0, and
  chunkattn_handoffs_total, chunkattn_handoff_blocks_total and chunkattn_handoff_bytes_total count the grant,
  the take and the copy; the answers' blocks, pool blocks, bytes, ttl and num_tokens;
* prefix-cache consistency: the grantor overwrites the granted blocks (a new request reusing them) before the
  take; the taken copy still decodes as the original did (the grant is a copy), the grantor's space as the
  new request;
* hostile GrantBlocks (block ids out of the space, negative, int32 max, listed twice, none; num_tokens past
  what the blocks hold and negative; ttl negative, NaN, under 1 s, 1e9; grant ids too short, too long, of bad
  characters, of 10,000 characters, not UTF-8; a name in use; another tenant's space; a space never opened;
  the quota tenant past max_kv_blocks; the pool too small; a to_tenant of 300 bytes) and hostile CopyBlocks (no
  source, counts that differ, ids out of range or listed twice, another tenant's space, another tenant's grant
  not addressed to the caller, a grant taken, malformed or never issued, a grant past its ttl, a destination
  laid out otherwise, a destination closed): each gets its status and a bounded message naming what was wrong
  (never the grant's name), and changes nothing: the pool's free blocks, the grants gauge, the K/V of the
  source and of the destination (a repeated decode gives bitwise the same output; a self-check shows a copy
  served changes it), and a grant the refused call named is still there to be taken, once; an empty grant
  name is a grant no one has (NOT_FOUND in a grant's words), not a space;
* an expired grant: NOT_FOUND to a take, its blocks back to the pool by the sweep (the gauges to 0,
  chunkattn_grants_expired_total + 1), even on a server without --idle-timeout-s;
* GrantBlocks racing CloseBlockSpace of the same space (asyncio): each grant succeeds (then it is taken and
  decodes right) or is NOT_FOUND, and no block is leaked;
* a float8 (e4m3) server: a grant taken and a space-to-space copy decode bitwise as the source does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from chunkattn_client import AsyncChunkAttnClient, BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import MAX_MESSAGE_CHARS
from tests.helpers.blockapi import (
    BS,
    EXHAUSTED,
    GLOBAL,
    I32,
    INVALID,
    NOT_FOUND,
    QUOTA_BLOCKS,
    TOKENS,
    caller,
    client,
    close_enough,
    gauge,
    refused,
    rows_of,
    wait_for,
)
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.server_process import SMALL, ServerProcess, counter
from tests.helpers.tensors import qkv

pytestmark = pytest.mark.server

LAYERS = 4
PREFILL = 40  # tokens: across both chunk boundaries (16, 32) of the chunked layers
SPACE = 12  # blocks of the grantor's space: the prefill's 10, and room for the decode
DEST = 24  # blocks of a receiving space: room for the shuffled ids
EXISTS = grpc.StatusCode.ALREADY_EXISTS


def grant_name() -> str:
    return secrets.token_urlsafe(32)  # 43 characters of [A-Za-z0-9_-]


@dataclass
class Held:
    """A sequence in a space: its client, the space, and the space's block manager (its table)."""

    c: ChunkAttnClient
    space_id: str
    kv: KVCacheManager
    seq: str = "s"
    layers: tuple[int, ...] = tuple(range(LAYERS))

    @property
    def table(self) -> list[int]:
        return self.kv.tables[0, self.seq]

    def prefill(self, n: int, seed: int, ref: ReferenceModel | None = None) -> None:
        """The sequence's first ``n`` tokens, every layer (and into ``ref`` when given)."""
        rng = np.random.default_rng(seed)
        entries = [(self.seq, 0, n)]
        self.kv.schedule(entries)
        for layer in self.layers:
            q, k, v = qkv(rng, n)
            self.c.attend_blocks(layer, rows_of(self.kv, self.space_id, entries, layer), q, k, v)
            if ref is not None:
                ref.attend(layer, [BatchEntry(self.seq, 0, n)], q, k, v)

    def decode(self, position: int, seed: int) -> list[np.ndarray]:
        """A decode step at ``position``, every layer, q/k/v drawn from ``seed``: the outputs. Repeated at the
        same position with the same seed it writes the same bytes, so it reads the space without changing it."""
        rng = np.random.default_rng(seed)
        entries = [(self.seq, position, 1)]
        self.kv.schedule(entries)
        outs = []
        for layer in self.layers:
            q, k, v = qkv(rng, 1)
            outs.append(self.c.attend_blocks(layer, rows_of(self.kv, self.space_id, entries, layer), q, k, v))
        return outs

    def moved(self, c: ChunkAttnClient, space_id: str, dest_ids: list[int], num_blocks: int) -> Held:
        """The same sequence in another space whose blocks ``dest_ids`` hold this table's blocks, in order."""
        kv = KVCacheManager(num_blocks, BS)
        kv.tables[0, self.seq] = list(dest_ids)
        kv.free = [b for b in kv.free if b not in dest_ids]
        return Held(c, space_id, kv, self.seq, self.layers)


def same(x: list[np.ndarray], y: list[np.ndarray]) -> None:
    assert len(x) == len(y)
    for layer, (a, b) in enumerate(zip(x, y, strict=True)):
        assert a.shape == b.shape
        assert np.array_equal(a, b), f"layer {layer}: outputs differ by {np.abs(a - b).max():.3g}"


def shuffled(n: int, num_blocks: int, seed: int) -> list[int]:
    """``n`` distinct ids of ``num_blocks``, in no order."""
    return [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)[:n]]


def grant_metrics(server: ServerProcess) -> tuple[float, float]:
    m = server.metrics()
    return counter(m, "chunkattn_grants"), counter(m, "chunkattn_grant_parked_blocks")


@pytest.fixture
def a_space(server: ServerProcess) -> Iterator[Held]:
    """Tenant "a"'s space holding sequence "s" (PREFILL tokens, every layer)."""
    with client(server, "a") as c:
        space = c.open_block_space(SPACE)
        held = Held(c, space.space_id, KVCacheManager(SPACE, BS, seed=7))
        held.prefill(PREFILL, seed=1)
        yield held
        with contextlib.suppress(ChunkAttnError):  # closed by the test
            c.close_block_space(space.space_id)


# -- exactness --------------------------------------------------------------------------------------------------


def test_a_grant_taken_into_shuffled_blocks_decodes_bitwise_as_the_source(server: ServerProcess, a_space: Held) -> None:
    c = a_space.c
    info = c.info()
    free = info.free_blocks
    before = server.metrics()
    n = len(a_space.table)
    assert n == PREFILL // BS
    name = grant_name()
    grant = c.grant_blocks(a_space.space_id, a_space.table, name, num_tokens=PREFILL)
    assert (grant.blocks, grant.pool_blocks, grant.ttl_s) == (n, n * LAYERS, 60.0)
    assert grant.bytes == grant.pool_blocks * info.bytes_per_block
    assert c.info().free_blocks == free - n * LAYERS  # parked: a copy, charged to the grantor
    assert grant_metrics(server) == (1, n * LAYERS)
    assert counter(server.metrics(), "chunkattn_tenant_kv_blocks", tenant="a") == (SPACE + n) * LAYERS

    dest = c.open_block_space(DEST)
    ids = shuffled(n, DEST, seed=2)
    copied = c.copy_blocks(dest.space_id, ids, grant_id=name)
    assert (copied.blocks, copied.bytes, copied.num_tokens) == (n, grant.bytes, PREFILL)
    assert grant_metrics(server) == (0, 0)
    assert c.info().free_blocks == free - DEST * LAYERS  # the grant's blocks back to the pool
    taken = a_space.moved(c, dest.space_id, ids, DEST)
    same(a_space.decode(PREFILL, seed=3), taken.decode(PREFILL, seed=3))
    same(a_space.decode(PREFILL + 1, seed=4), taken.decode(PREFILL + 1, seed=4))  # a new block each

    # Taken once: the second take finds nothing, and changes nothing.
    with pytest.raises(ChunkAttnError) as e:
        c.copy_blocks(dest.space_id, ids, grant_id=name)
    assert e.value.code == NOT_FOUND
    assert "does not exist for your tenant" in e.value.message
    assert name not in e.value.message
    same(a_space.decode(PREFILL + 1, seed=4), taken.decode(PREFILL + 1, seed=4))

    after = server.metrics()
    for op, code, count in (("grant", "OK", 1), ("take", "OK", 1), ("take", "NOT_FOUND", 1)):
        assert counter(after, "chunkattn_handoffs_total", op=op, code=code) == count + counter(
            before, "chunkattn_handoffs_total", op=op, code=code
        ), (op, code)
    for op in ("grant", "take"):
        assert counter(after, "chunkattn_handoff_blocks_total", op=op) == n + counter(
            before, "chunkattn_handoff_blocks_total", op=op
        )
        assert counter(after, "chunkattn_handoff_bytes_total", op=op, where="local") == grant.bytes + counter(
            before, "chunkattn_handoff_bytes_total", op=op, where="local"
        )
    assert c.close_block_space(dest.space_id) == DEST * LAYERS
    assert c.info().free_blocks == free
    assert counter(server.metrics(), "chunkattn_tenant_kv_blocks", tenant="a") == SPACE * LAYERS


def test_a_copy_between_spaces_decodes_bitwise_as_the_source(server: ServerProcess, a_space: Held) -> None:
    c = a_space.c
    free = c.info().free_blocks
    before = server.metrics()
    dest = c.open_block_space(DEST)
    ids = shuffled(len(a_space.table), DEST, seed=5)
    copied = c.copy_blocks(dest.space_id, ids, space_id=a_space.space_id, source_block_ids=a_space.table)
    assert (copied.blocks, copied.num_tokens) == (len(ids), 0)
    assert copied.bytes == len(ids) * LAYERS * c.info().bytes_per_block
    assert c.info().free_blocks == free - DEST * LAYERS  # nothing parked
    copy = a_space.moved(c, dest.space_id, ids, DEST)
    same(a_space.decode(PREFILL, seed=6), copy.decode(PREFILL, seed=6))
    # Within one space, blocks read and written at once: a rotation of the copy's table reads the old bytes.
    rotated = ids[1:] + ids[:1]
    c.copy_blocks(dest.space_id, rotated, space_id=dest.space_id, source_block_ids=ids)
    rotated_copy = a_space.moved(c, dest.space_id, rotated, DEST)
    rotated_copy.kv.tables[0, "s"].append(copy.table[-1])  # the decode's block, not rotated
    rotated_copy.kv.free.remove(copy.table[-1])
    same(a_space.decode(PREFILL, seed=6), rotated_copy.decode(PREFILL, seed=6))
    after = server.metrics()
    assert counter(after, "chunkattn_handoffs_total", op="copy", code="OK") == 2 + counter(
        before, "chunkattn_handoffs_total", op="copy", code="OK"
    )
    assert counter(after, "chunkattn_handoff_blocks_total", op="copy") == 2 * len(ids) + counter(
        before, "chunkattn_handoff_blocks_total", op="copy"
    )
    c.close_block_space(dest.space_id)
    assert c.info().free_blocks == free


def test_a_grant_to_another_tenant_is_taken_into_its_space(server: ServerProcess, a_space: Held) -> None:
    c = a_space.c
    free = c.info().free_blocks
    name = grant_name()
    n = len(a_space.table)
    c.grant_blocks(a_space.space_id, a_space.table, name, num_tokens=PREFILL - 1, to_tenant="b")
    with client(server, "b") as b, client(server, "many") as third:
        # Neither a third tenant nor the grantor's space id help another tenant.
        third_space = third.open_block_space(DEST)
        with pytest.raises(ChunkAttnError) as e:
            third.copy_blocks(third_space.space_id, list(range(n)), grant_id=name)
        assert e.value.code == NOT_FOUND
        third.close_block_space(third_space.space_id)
        dest = b.open_block_space(DEST)
        with pytest.raises(ChunkAttnError) as e:
            b.copy_blocks(dest.space_id, list(range(n)), space_id=a_space.space_id, source_block_ids=a_space.table)
        assert e.value.code == NOT_FOUND
        ids = shuffled(n, DEST, seed=8)
        assert b.copy_blocks(dest.space_id, ids, grant_id=name).num_tokens == PREFILL - 1
        assert grant_metrics(server) == (0, 0)
        taken = a_space.moved(b, dest.space_id, ids, DEST)
        same(a_space.decode(PREFILL, seed=9), taken.decode(PREFILL, seed=9))
        # Taken by "b": its grantor cannot take it again.
        with pytest.raises(ChunkAttnError) as e:
            c.copy_blocks(a_space.space_id, list(range(n)), grant_id=name)
        assert e.value.code == NOT_FOUND
        b.close_block_space(dest.space_id)
    assert c.info().free_blocks == free


def test_part_of_a_grant_is_taken_where_asked_and_the_rest_ends_with_it(server: ServerProcess, a_space: Held) -> None:
    """source_block_ids index the grant's blocks: the last 4 taken (the chunk the decode reads, and the global
    layer's keys before it taken apart), the grant ends anyway."""
    c = a_space.c
    free = c.info().free_blocks
    name = grant_name()
    table = a_space.table
    c.grant_blocks(a_space.space_id, table, name)
    dest = c.open_block_space(DEST)
    ids = shuffled(len(table), DEST, seed=10)
    # The first 6 blocks space to space, the last 4 from the grant (indices 6 .. 9), in reverse order.
    c.copy_blocks(dest.space_id, ids[:6], space_id=a_space.space_id, source_block_ids=table[:6])
    part = c.copy_blocks(dest.space_id, ids[6:][::-1], grant_id=name, source_block_ids=[9, 8, 7, 6])
    assert part.blocks == 4
    assert grant_metrics(server) == (0, 0)
    assert c.info().free_blocks == free - DEST * LAYERS
    taken = a_space.moved(c, dest.space_id, ids, DEST)
    same(a_space.decode(PREFILL, seed=11), taken.decode(PREFILL, seed=11))
    c.close_block_space(dest.space_id)


def test_spaces_of_two_planes_hand_over_alike(server: ServerProcess) -> None:
    """vLLM's hybrid layout (the chunked layers in one plane, the global one in another): a space block is 2 pool
    blocks, and so is each granted block; the take decodes bitwise as the source in both planes."""
    with client(server, "a") as c:
        free = c.info().free_blocks
        space = c.open_block_space(SPACE, layer_planes=[0, 0, 0, 1])
        held = Held(c, space.space_id, KVCacheManager(SPACE, BS, seed=17), layers=(0, GLOBAL))
        held.prefill(PREFILL, seed=18)
        name = grant_name()
        grant = c.grant_blocks(space.space_id, held.table, name)
        assert (grant.blocks, grant.pool_blocks) == (len(held.table), 2 * len(held.table))
        assert grant_metrics(server) == (1, 2 * len(held.table))
        dest = c.open_block_space(DEST, layer_planes=[0, 0, 0, 1])
        ids = shuffled(len(held.table), DEST, seed=19)
        c.copy_blocks(dest.space_id, ids, grant_id=name)
        same(held.decode(PREFILL, seed=20), held.moved(c, dest.space_id, ids, DEST).decode(PREFILL, seed=20))
        c.close_block_space(dest.space_id)
        c.close_block_space(space.space_id)
        assert c.info().free_blocks == free


# -- prefix-cache consistency ---------------------------------------------------------------------------------


def test_the_grantor_reusing_its_blocks_does_not_change_the_grant(server: ServerProcess) -> None:
    with client(server, "a") as c:
        space = c.open_block_space(SPACE)
        ref = ReferenceModel.for_server(c.info())
        held = Held(c, space.space_id, KVCacheManager(SPACE, BS, seed=12))
        held.prefill(PREFILL, seed=13, ref=ref)
        name = grant_name()
        c.grant_blocks(space.space_id, held.table, name, num_tokens=PREFILL, ttl_s=30)
        # A new request gets the freed blocks, and writes other keys into them (a prefix cache's blocks).
        reuse = Held(c, space.space_id, held.kv, "t")
        held.kv.tables[0, "t"] = held.kv.tables.pop((0, "s"))
        reuse.prefill(PREFILL, seed=14)

        dest = c.open_block_space(DEST)
        ids = shuffled(len(reuse.table), DEST, seed=15)
        c.copy_blocks(dest.space_id, ids, grant_id=name)
        taken = held.moved(c, dest.space_id, ids, DEST)
        rng = np.random.default_rng(16)
        for layer, out in enumerate(taken.decode(PREFILL, seed=16)):
            q, k, v = qkv(rng, 1)
            close_enough(out, ref.attend(layer, [BatchEntry("s", PREFILL, 1)], q, k, v))
        # The grantor's space holds the new request: it decodes otherwise than the grant.
        for x, y in zip(reuse.decode(PREFILL, seed=16), taken.decode(PREFILL, seed=16), strict=True):
            assert not np.allclose(x, y)
        c.close_block_space(dest.space_id)
        c.close_block_space(space.space_id)


# -- hostile GrantBlocks ----------------------------------------------------------------------------------------


@dataclass
class Watch:
    """What a refused request must leave as it was: the pool's free blocks, the grants gauge, and the decode of
    each space watched (bitwise)."""

    server: ServerProcess
    c: ChunkAttnClient
    spaces: list[tuple[Held, int]]  # each with the position its probe decodes at
    free: int = 0
    grants: float = 0.0
    outputs: list[list[np.ndarray]] | None = None

    def __post_init__(self) -> None:
        self.free = self.c.info().free_blocks
        self.grants = gauge(self.server, "chunkattn_grants")
        self.outputs = self._probe()

    def _probe(self) -> list[list[np.ndarray]]:
        return [held.decode(position, seed=77) for held, position in self.spaces]

    def unchanged(self, what: str) -> None:
        assert self.c.info().free_blocks == self.free, what
        assert gauge(self.server, "chunkattn_grants") == self.grants, what
        assert self.outputs is not None
        for before, now in zip(self.outputs, self._probe(), strict=True):
            same(before, now)


def refused_call(code: grpc.StatusCode, call: object, *args: object, **kwargs: object) -> str:
    """The message of a call that must fail with ``code``."""
    assert callable(call)
    with pytest.raises(ChunkAttnError) as e:
        call(*args, **kwargs)
    assert e.value.code == code, e.value
    assert len(e.value.message) <= MAX_MESSAGE_CHARS, e.value
    return e.value.message


def test_hostile_grants_are_refused_naming_what_is_wrong_and_change_nothing(
    server: ServerProcess, a_space: Held
) -> None:
    c, sid, table = a_space.c, a_space.space_id, list(a_space.table)
    in_use = grant_name()
    c.grant_blocks(sid, table[:2], in_use)
    watch = Watch(server, c, [(a_space, PREFILL)])
    n = len(table)
    cases: list[tuple[grpc.StatusCode, list[int], str, dict[str, object], list[str]]] = [
        (INVALID, [*table[:2], SPACE], grant_name(), {}, ["block_ids[2] is 12", "0 .. 11"]),
        (INVALID, [-1], grant_name(), {}, ["block_ids[0] is -1"]),
        (INVALID, [table[0], I32.max], grant_name(), {}, [f"block_ids[1] is {I32.max}"]),
        (INVALID, [table[0], table[1], table[0]], grant_name(), {}, ["block_ids[2]", "listed before"]),
        (INVALID, [], grant_name(), {}, ["block_ids is empty"]),
        (INVALID, table, grant_name(), {"num_tokens": n * BS + 1}, [f"num_tokens is {n * BS + 1}", f"0 .. {n * BS}"]),
        (INVALID, table, grant_name(), {"num_tokens": -1}, ["num_tokens is -1"]),
        (INVALID, table, grant_name(), {"ttl_s": -1.0}, ["ttl_s is -1"]),
        (INVALID, table, grant_name(), {"ttl_s": math.nan}, ["ttl_s is nan"]),
        (INVALID, table, grant_name(), {"ttl_s": 0.5}, ["ttl_s is 0.5", "1 .. 3600"]),
        (INVALID, table, grant_name(), {"ttl_s": 1e9}, ["ttl_s is 1000000000.0"]),
        (INVALID, table, grant_name(), {"ttl_s": math.inf}, ["ttl_s is inf"]),
        (INVALID, table, "x" * 31, {}, ["grant_id (31 characters)", "32 to 64"]),
        (INVALID, table, "x" * 65, {}, ["grant_id (65 characters)"]),
        (INVALID, table, "x" * 40 + "!", {}, ["grant_id (41 characters)", "[A-Za-z0-9_-]"]),
        (INVALID, table, "x" * 31 + "\u00e9", {}, ["grant_id (32 characters)"]),
        (INVALID, table, "x" * 10_000, {}, ["grant_id (10000 characters)"]),
        (INVALID, table, "", {}, ["grant_id (0 characters)"]),
        (INVALID, table, grant_name(), {"to_tenant": "t" * 300}, ["to_tenant", "256 bytes"]),
        (INVALID, table, grant_name(), {"to_tenant": "\u00e9" * 129}, ["to_tenant", "256 bytes"]),  # 258 bytes
        (EXISTS, table, in_use, {}, ["exists"]),
        (INVALID, [0] * 200_000, grant_name(), {}, ["GrantBlocksRequest of", "longer than any valid one"]),
    ]
    for code, ids, name, kwargs, words in cases:
        message = refused_call(code, c.grant_blocks, sid, ids, name, **kwargs)
        for w in words:
            assert w in message, (name[:70], kwargs, message)
        if len(name) >= 8:
            assert name not in message, message  # a grant's name is a secret: never echoed
        watch.unchanged(f"{name[:70]} {kwargs}")
    # A name in use, taken by another tenant's grant too (names are global).
    with client(server, "b") as b:
        b_space = b.open_block_space(2)
        refused_call(EXISTS, b.grant_blocks, b_space.space_id, [0], in_use)
        # Tenant "a"'s space, or one never opened: NOT_FOUND.
        refused_call(NOT_FOUND, b.grant_blocks, sid, table, grant_name())
        refused_call(NOT_FOUND, b.grant_blocks, secrets.token_hex(16), [0], grant_name())
        b.close_block_space(b_space.space_id)
    message = refused_call(NOT_FOUND, c.grant_blocks, "x" * 10_000, [0], grant_name())
    assert len(message) < 400
    watch.unchanged("other tenants")
    # Raw bytes: a grant id that is not UTF-8.
    request = pb.GrantBlocksRequest(space_id=sid, block_ids=table, grant_id="X" * 40).SerializeToString()
    with caller(server, "a") as raw:
        refused(
            raw.call("GrantBlocks", request.replace(b"X" * 40, b"\xff" * 40)),
            INVALID,
            "not a valid chunkattn.v1.GrantBlocksRequest",
        )
        refused(raw.call("GrantBlocks", b"\xff\xff\xff"), INVALID, "chunkattn.v1.GrantBlocksRequest")
    watch.unchanged("not UTF-8")
    # The name in use is still the first grant's: taken once, then free for a new grant.
    dest = c.open_block_space(2)
    c.copy_blocks(dest.space_id, [1, 0], grant_id=in_use)
    c.close_block_space(dest.space_id)
    assert grant_metrics(server) == (0, 0)


def test_a_grant_past_the_quota_or_the_pool_is_resource_exhausted(server: ServerProcess) -> None:
    """The parked blocks count against the grantor's max_kv_blocks until the grant ends, its space closed or not."""
    with client(server, "quota") as c:
        free = c.info().free_blocks
        space = c.open_block_space(1)  # 4 pool blocks of the quota's 8
        first = grant_name()
        c.grant_blocks(space.space_id, [0], first)  # 4 more: the whole quota
        message = refused_call(EXHAUSTED, c.grant_blocks, space.space_id, [0], grant_name())
        assert "max_kv_blocks" in message
        assert c.info().free_blocks == free - QUOTA_BLOCKS
        assert grant_metrics(server) == (1, LAYERS)
        assert "max_kv_blocks" in refused_call(EXHAUSTED, c.open_block_space, 1)
        # The grant outlives its space, and is still charged.
        c.close_block_space(space.space_id)
        assert c.info().free_blocks == free - LAYERS
        assert counter(server.metrics(), "chunkattn_tenant_kv_blocks", tenant="quota") == LAYERS
        other = c.open_block_space(1)
        c.copy_blocks(other.space_id, [0], grant_id=first)
        assert grant_metrics(server) == (0, 0)
        assert c.close_block_space(other.space_id) == LAYERS
        assert c.info().free_blocks == free
    with client(server, "many") as m:
        free = m.info().free_blocks
        big = m.open_block_space((free - LAYERS) // LAYERS)
        left = m.info().free_blocks
        assert LAYERS <= left < 2 * LAYERS
        message = refused_call(EXHAUSTED, m.grant_blocks, big.space_id, [0, 1], grant_name())
        assert "pool" in message
        assert m.info().free_blocks == left
        assert grant_metrics(server) == (0, 0)
        m.grant_blocks(big.space_id, [0], grant_name(), ttl_s=1)  # one block fits; it expires
        m.close_block_space(big.space_id)
    wait_for(lambda: grant_metrics(server) == (0, 0), message="the sweep did not end the grant")


# -- hostile CopyBlocks -----------------------------------------------------------------------------------------


def test_hostile_copies_are_refused_change_nothing_and_leave_the_grant_takeable(
    server: ServerProcess, a_space: Held
) -> None:
    c, table = a_space.c, list(a_space.table)
    n = len(table)
    name = grant_name()
    c.grant_blocks(a_space.space_id, table, name, num_tokens=PREFILL)
    # The destination holds a sequence of its own: a copy that went through would change its decode.
    dest_space = c.open_block_space(DEST)
    dest = Held(c, dest_space.space_id, KVCacheManager(DEST, BS, seed=20))
    dest.prefill(PREFILL, seed=21)
    d = list(dest.table)
    assert len(d) == n
    planes = c.open_block_space(DEST, layer_planes=[0, 0, 0, 1])  # laid out otherwise
    closed = c.open_block_space(DEST)
    c.close_block_space(closed.space_id)
    watch = Watch(server, c, [(a_space, PREFILL), (dest, PREFILL)])
    sid, did = a_space.space_id, dest.space_id
    cases: list[tuple[grpc.StatusCode, dict[str, object], list[str]]] = [
        (INVALID, {"grant_id": name, "source_block_ids": [0, 1], "dest_block_ids": d[:1]}, ["lists 2 blocks"]),
        (INVALID, {"grant_id": name, "dest_block_ids": d[:3]}, [f"lists {n} blocks and dest_block_ids 3"]),
        (INVALID, {"grant_id": name, "dest_block_ids": [*d[:-1], DEST]}, [f"dest_block_ids[{n - 1}] is {DEST}"]),
        (INVALID, {"grant_id": name, "dest_block_ids": [*d[:-1], -1]}, [f"dest_block_ids[{n - 1}] is -1"]),
        (INVALID, {"grant_id": name, "dest_block_ids": [*d[:-1], d[0]]}, [f"dest_block_ids[{n - 1}]", "listed before"]),
        (INVALID, {"grant_id": name, "dest_block_ids": []}, ["dest_block_ids is empty"]),
        (INVALID, {"grant_id": name, "source_block_ids": [0, n], "dest_block_ids": d[:2]}, ["source_block_ids[1]"]),
        (INVALID, {"grant_id": name, "source_block_ids": [I32.max], "dest_block_ids": d[:1]}, ["source_block_ids[0]"]),
        (INVALID, {"grant_id": name, "source_block_ids": [-1], "dest_block_ids": d[:1]}, ["source_block_ids[0] is -1"]),
        (INVALID, {"space_id": sid, "source_block_ids": table, "dest_block_ids": d[:2]}, ["lists 10 blocks"]),
        (INVALID, {"space_id": sid, "source_block_ids": [], "dest_block_ids": d}, ["source_block_ids is empty"]),
        (INVALID, {"space_id": sid, "source_block_ids": [SPACE], "dest_block_ids": d[:1]}, ["source_block_ids[0]"]),
        (
            INVALID,
            {"grant_id": name, "dest_space_id": planes.space_id, "dest_block_ids": d},
            ["laid out otherwise", "layer_planes [0, 1, 2, 3]", "[0, 0, 0, 1]"],
        ),
        (
            INVALID,
            {"space_id": sid, "source_block_ids": table, "dest_space_id": planes.space_id, "dest_block_ids": d},
            ["laid out otherwise"],
        ),
        (NOT_FOUND, {"grant_id": name, "dest_space_id": closed.space_id, "dest_block_ids": d}, ["does not exist"]),
        (NOT_FOUND, {"grant_id": grant_name(), "dest_block_ids": d}, ["does not exist for your tenant"]),
        (NOT_FOUND, {"grant_id": "short", "dest_block_ids": d}, ["does not exist for your tenant"]),
        (NOT_FOUND, {"grant_id": "x" * 10_000, "dest_block_ids": d}, ["does not exist for your tenant"]),
        (NOT_FOUND, {"space_id": secrets.token_hex(16), "source_block_ids": table, "dest_block_ids": d}, []),
    ]
    for code, kwargs, words in cases:
        args = {"dest_space_id": did, **kwargs}
        dest_space_id, dest_ids = args.pop("dest_space_id"), args.pop("dest_block_ids")
        message = refused_call(code, c.copy_blocks, dest_space_id, dest_ids, **args)
        for w in words:
            assert w in message, (kwargs, message)
        assert name not in message
        watch.unchanged(str(kwargs)[:200])
    # Another tenant: neither the grant (not addressed to "b") nor "a"'s space exist for it.
    with client(server, "b") as b:
        b_space = b.open_block_space(DEST)
        refused_call(NOT_FOUND, b.copy_blocks, b_space.space_id, d, grant_id=name)
        refused_call(NOT_FOUND, b.copy_blocks, b_space.space_id, d, space_id=sid, source_block_ids=table)
        refused_call(NOT_FOUND, b.copy_blocks, did, d, space_id=b_space.space_id, source_block_ids=d)
        b.close_block_space(b_space.space_id)
    watch.unchanged("tenant b")
    # Raw bytes: no source at all; a grant id of no characters (the oneof set, empty).
    with caller(server, "a") as raw:
        no_source = pb.CopyBlocksRequest(dest_space_id=did, dest_block_ids=d).SerializeToString()
        refused(raw.call("CopyBlocks", no_source), INVALID, "needs a source")
        empty = pb.CopyBlocksRequest(dest_space_id=did, dest_block_ids=d, grant_id="").SerializeToString()
        refused(raw.call("CopyBlocks", empty), NOT_FOUND, "the grant named does not exist for your tenant")
    with pytest.raises(ValueError, match="one source"):
        c.copy_blocks(did, d)
    watch.unchanged("raw")
    assert gauge(server, "chunkattn_grants") == 1
    # Self-check: the probe sees a copy that goes through (the source's sequence over the destination's).
    c.copy_blocks(did, d, space_id=sid, source_block_ids=table)
    with pytest.raises(AssertionError, match="outputs differ"):
        watch.unchanged("a copy served")

    # Every refusal left the grant takeable: it is taken now, once, and decodes as the source.
    ids = shuffled(n, DEST, seed=22)
    fresh = c.open_block_space(DEST)
    c.copy_blocks(fresh.space_id, ids, grant_id=name)
    taken = a_space.moved(c, fresh.space_id, ids, DEST)
    same(a_space.decode(PREFILL, seed=23), taken.decode(PREFILL, seed=23))
    refused_call(NOT_FOUND, c.copy_blocks, fresh.space_id, ids, grant_id=name)
    for s in (fresh, planes, dest_space):
        c.close_block_space(s.space_id)
    assert grant_metrics(server) == (0, 0)


def test_another_tenants_grant_refused_is_still_its_owners(server: ServerProcess, a_space: Held) -> None:
    c = a_space.c
    name = grant_name()
    c.grant_blocks(a_space.space_id, a_space.table, name)
    with client(server, "b") as b:
        b_space = b.open_block_space(DEST)
        refused_call(NOT_FOUND, b.copy_blocks, b_space.space_id, a_space.table, grant_id=name)
        b.close_block_space(b_space.space_id)
    dest = c.open_block_space(DEST)
    ids = shuffled(len(a_space.table), DEST, seed=24)
    c.copy_blocks(dest.space_id, ids, grant_id=name)
    same(a_space.decode(PREFILL, seed=25), a_space.moved(c, dest.space_id, ids, DEST).decode(PREFILL, seed=25))
    c.close_block_space(dest.space_id)


def test_a_grant_past_its_ttl_is_not_found_and_the_sweep_returns_its_blocks(
    server: ServerProcess, a_space: Held
) -> None:
    """The shared server runs with --idle-timeout-s 0: the grant's own deadline wakes the sweep."""
    c = a_space.c
    free = c.info().free_blocks
    expired = counter(server.metrics(), "chunkattn_grants_expired_total")
    name = grant_name()
    grant = c.grant_blocks(a_space.space_id, a_space.table, name, ttl_s=1)
    assert grant.ttl_s == 1.0
    assert c.info().free_blocks == free - grant.pool_blocks
    dest = c.open_block_space(DEST)
    time.sleep(1.5)
    refused_call(NOT_FOUND, c.copy_blocks, dest.space_id, a_space.table, grant_id=name)
    wait_for(lambda: grant_metrics(server) == (0, 0), message="the sweep did not end the grant")
    assert counter(server.metrics(), "chunkattn_grants_expired_total") == expired + 1
    c.close_block_space(dest.space_id)
    assert c.info().free_blocks == free
    # Its name is free again; a new grant of it is a new grant.
    c.grant_blocks(a_space.space_id, a_space.table[:1], name, ttl_s=1)
    wait_for(lambda: grant_metrics(server) == (0, 0), message="the sweep did not end the second grant")
    assert counter(server.metrics(), "chunkattn_grants_expired_total") == expired + 2
    assert c.info().free_blocks == free


# -- racing the source's close ----------------------------------------------------------------------------------

RACE_ROUNDS = 12
RACE_GRANTS = 3


def test_grants_racing_the_close_of_their_space_succeed_whole_or_are_not_found(server: ServerProcess) -> None:
    """Each round: a space holding a short sequence, RACE_GRANTS grants of it and its close sent at once. A grant
    before the close parks a copy (taken later: it decodes as the reference says), one after is NOT_FOUND."""
    with client(server, "a") as c:
        free = c.info().free_blocks
        ref = ReferenceModel.for_server(c.info())
        sequences: list[tuple[str, list[int]]] = []  # (sequence, its table) of each space, by round
        spaces: list[str] = []
        for r in range(RACE_ROUNDS):
            space = c.open_block_space(4)
            held = Held(c, space.space_id, KVCacheManager(4, BS, seed=r), f"r{r}")
            held.prefill(9, seed=100 + r, ref=ref)
            sequences.append((held.seq, held.table))
            spaces.append(space.space_id)

    async def race() -> list[list[str | None]]:
        async with AsyncChunkAttnClient(server.target, token=TOKENS["a"], timeout_s=30) as ac:

            async def grant(space_id: str, table: list[int], name: str, delay: float) -> str | None:
                await asyncio.sleep(delay)
                try:
                    await ac.grant_blocks(space_id, table, name, num_tokens=9, ttl_s=60)
                except ChunkAttnError as e:
                    refusals.append(e)
                    return None
                return name

            async def close(space_id: str, delay: float) -> None:
                await asyncio.sleep(delay)
                await ac.close_block_space(space_id)

            results = []
            for r, space_id in enumerate(spaces):
                table = sequences[r][1]
                # Sent at once, or a little apart: the close comes first in some rounds, last in others.
                grants = [grant(space_id, table, grant_name(), 0.001 * ((r + i) % 3)) for i in range(RACE_GRANTS)]
                done = await asyncio.gather(*grants, close(space_id, 0.001 * (r % 4)))
                results.append(list(done[:RACE_GRANTS]))
            return results

    refusals: list[ChunkAttnError] = []
    results = asyncio.run(race())
    assert all(e.code == NOT_FOUND for e in refusals), refusals
    granted = [(r, name) for r, names in enumerate(results) for name in names if name is not None]
    with client(server, "a") as c:
        assert c.info().block_spaces == 0
        assert grant_metrics(server) == (len(granted), len(granted) * 3 * LAYERS)
        assert c.info().free_blocks == free - len(granted) * 3 * LAYERS
        decoded: dict[int, list[np.ndarray]] = {}
        for r, name in granted:
            seq, _ = sequences[r]
            dest = c.open_block_space(4)
            c.copy_blocks(dest.space_id, [3, 1, 2], grant_id=name)
            taken = Held(c, dest.space_id, KVCacheManager(4, BS), seq)
            taken.kv.tables[0, seq] = [3, 1, 2]
            taken.kv.free = [0]
            outs = taken.decode(9, seed=200 + r)
            if r in decoded:  # another grant of the same round: the same bytes
                same(decoded[r], outs)
            else:
                rng = np.random.default_rng(200 + r)
                for layer, out in enumerate(outs):
                    q, k, v = qkv(rng, 1)
                    close_enough(out, ref.attend(layer, [BatchEntry(seq, 9, 1)], q, k, v))
                decoded[r] = outs
            c.close_block_space(dest.space_id)
        assert grant_metrics(server) == (0, 0)
        assert c.info().free_blocks == free
    outcomes = {name is None for names in results for name in names}
    print(f"{len(granted)} of {RACE_ROUNDS * RACE_GRANTS} grants before the close; outcomes seen: {outcomes}")


# -- a float8 cache ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    scales = tmp_path_factory.mktemp("scales") / "scales.json"
    scales.write_text(json.dumps({"k_scale": 0.02, "v_scale": [0.05, 0.03, 0.02, 0.01]}))
    flags = ["--num-blocks", "256", "--idle-timeout-s", "0", "--kv-cache-dtype", "fp8_e4m3", "--kv-scales"]
    with ServerProcess(*SMALL, *flags, str(scales)) as s:
        yield s


def test_a_float8_grant_and_copy_decode_bitwise_as_the_source(fp8_server: ServerProcess) -> None:
    with ChunkAttnClient(fp8_server.target, timeout_s=30) as c:
        info = c.info()
        assert info.cache_dtype == "float8_e4m3"
        free = info.free_blocks
        space = c.open_block_space(SPACE)
        source = Held(c, space.space_id, KVCacheManager(SPACE, BS, seed=30))
        source.prefill(PREFILL, seed=31)
        name = grant_name()
        grant = c.grant_blocks(space.space_id, source.table, name, num_tokens=PREFILL)
        assert grant.bytes == grant.pool_blocks * info.bytes_per_block
        dest = c.open_block_space(DEST)
        ids = shuffled(len(source.table), DEST, seed=32)
        c.copy_blocks(dest.space_id, ids, grant_id=name)
        copy_space = c.open_block_space(DEST)
        copy_ids = shuffled(len(source.table), DEST, seed=33)
        c.copy_blocks(copy_space.space_id, copy_ids, space_id=space.space_id, source_block_ids=source.table)
        expected = source.decode(PREFILL, seed=34)
        same(expected, source.moved(c, dest.space_id, ids, DEST).decode(PREFILL, seed=34))
        same(expected, source.moved(c, copy_space.space_id, copy_ids, DEST).decode(PREFILL, seed=34))
        assert [(x.k_scale, x.v_scale) for x in c.info().layers] == [(x.k_scale, x.v_scale) for x in info.layers]
        for s in (space, dest, copy_space):
            c.close_block_space(s.space_id)
        assert c.info().free_blocks == free


def test_a_grant_is_taken_only_for_the_tag_its_taker_expects(server: ServerProcess, a_space: Held) -> None:
    """expect_tag: a grant whose tag is another (it holds another prompt's KV than the taker was told) is
    FAILED_PRECONDITION and not taken; the right tag takes it."""
    c = a_space.c
    name = grant_name()
    c.grant_blocks(a_space.space_id, a_space.table, name, num_tokens=PREFILL, tag="prompt-1")
    dest = c.open_block_space(DEST)
    ids = shuffled(len(a_space.table), DEST, seed=5)
    with pytest.raises(ChunkAttnError) as e:
        c.copy_blocks(dest.space_id, ids, grant_id=name, expect_tag="prompt-2")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "expect_tag" in e.value.message
    assert grant_metrics(server)[0] == 1  # not taken
    assert c.copy_blocks(dest.space_id, ids, grant_id=name, expect_tag="prompt-1").blocks == len(ids)
    with pytest.raises(ChunkAttnError) as e:
        c.grant_blocks(a_space.space_id, a_space.table, grant_name(), tag="t" * 129)
    assert e.value.code == INVALID
    c.close_block_space(dest.space_id)
