"""The block API (OpenBlockSpace, CloseBlockSpace, AttendRequest.blocks) through a real server subprocess, the
real clients, and raw bytes where the client would refuse to send something. The numeric parity in depth is
tests/engine/test_blocks.py's; these modules (test_block_api_*.py) are about the service edge; the shared
server, its tenants and callers are in conftest.py and tests/helpers/blockapi.py.

Covered here:

* end to end: a space opened, a prefill and decodes through attend_blocks unary, the sync stream, the asyncio
  client and the asyncio stream (rows built as vLLM's metadata builder does: tests/helpers/blockspace.py,
  chunked layers windowed to their chunk), every output equal to ReferenceModel's; Info's planes_per_block and
  the caller's block_spaces; close returns the pool blocks; the metrics move (opened, attend calls by mode,
  the block_spaces gauge, kv_blocks_used and the tenant's kv_blocks back where they were); custom layer_planes
  (two planes: fewer pool blocks, layers of different planes kept apart); two tenants' block calls and sequence
  calls at once, each answered as alone.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from chunkattn_client import AsyncChunkAttnClient, BatchEntry, BlockRows, ChunkAttnError, ReferenceModel
from tests.helpers.blockapi import BS, GLOBAL, NOT_FOUND, TOKENS, caller, client, close_enough, gauge, rows_of, wait_for
from tests.helpers.blockspace import KVCacheManager
from tests.helpers.server_process import ServerProcess, counter
from tests.helpers.tensors import qkv

pytestmark = pytest.mark.server


# -- end to end -----------------------------------------------------------------------------------------------

# Two sequences, then a third: prefills across the chunk boundary (16), decodes, a mixed step.
STEPS: list[list[tuple[str, int, int]]] = [
    [("a", 0, 19), ("b", 0, 5)],
    [("a", 19, 1), ("b", 5, 12)],
    [("a", 20, 1), ("b", 17, 1)],
    [("a", 21, 1), ("b", 18, 1), ("c", 0, 3)],
]
SPACE = 16  # blocks: a 22, b 19, c 3 tokens = 6 + 5 + 1 blocks of 4


def test_end_to_end_unary_streams_and_asyncio_match_the_reference(server: ServerProcess) -> None:
    rng = np.random.default_rng(1)
    before = server.metrics()
    with client(server, "e2e") as c:
        info = c.info()
        assert (info.planes_per_block, info.block_spaces, info.block_size) == (1, 0, BS)
        free = info.free_blocks
        space = c.open_block_space(SPACE)
        assert (space.num_blocks, space.block_size, space.num_planes) == (SPACE, BS, 4)
        assert len(space.space_id) == 32
        int(space.space_id, 16)
        assert space.pool_blocks == SPACE * 4  # one plane per layer, one plane per pool block
        info = c.info()
        assert (info.block_spaces, info.free_blocks) == (1, free - space.pool_blocks)
        with client(server, "a") as other:
            assert other.info().block_spaces == 0  # Info counts the caller's spaces only
        opened = server.metrics()
        assert counter(opened, "chunkattn_block_spaces_opened_total") == 1 + counter(
            before, "chunkattn_block_spaces_opened_total"
        )
        assert gauge(server, "chunkattn_block_spaces") == 1 + counter(before, "chunkattn_block_spaces")
        used = counter(before, "chunkattn_kv_blocks_used")
        assert counter(opened, "chunkattn_kv_blocks_used") == used + space.pool_blocks
        assert counter(opened, "chunkattn_tenant_kv_blocks", tenant="e2e") == space.pool_blocks

        ref = ReferenceModel.for_server(info)
        kv = KVCacheManager(SPACE, BS, seed=3)

        def step(
            entries: list[tuple[str, int, int]], layer: int
        ) -> tuple[BlockRows, np.ndarray, np.ndarray, np.ndarray]:
            q, k, v = qkv(rng, sum(n for _, _, n in entries))
            return rows_of(kv, space.space_id, entries, layer), q, k, v

        def expect(entries: list[tuple[str, int, int]], layer: int, out: Any, q: Any, k: Any, v: Any) -> None:
            assert out.shape == q.shape
            close_enough(out, ref.attend(layer, [BatchEntry(*e) for e in entries], q, k, v))

        # The prefill, unary.
        kv.schedule(STEPS[0])
        for layer in range(4):
            rows, q, k, v = step(STEPS[0], layer)
            expect(STEPS[0], layer, c.attend_blocks(layer, rows, q, k, v), q, k, v)
        # A step over the sync stream.
        kv.schedule(STEPS[1])
        with c.stream() as stream:
            for layer in range(4):
                rows, q, k, v = step(STEPS[1], layer)
                expect(STEPS[1], layer, stream.attend_blocks(layer, rows, q, k, v), q, k, v)

        # One over the asyncio client, one over its stream.
        async def aio() -> None:
            async with AsyncChunkAttnClient(server.target, token=TOKENS["e2e"], timeout_s=30) as ac:
                kv.schedule(STEPS[2])
                for layer in range(4):
                    rows, q, k, v = step(STEPS[2], layer)
                    expect(STEPS[2], layer, await ac.attend_blocks(layer, rows, q, k, v), q, k, v)
                kv.schedule(STEPS[3])
                async with ac.stream() as astream:
                    for layer in range(4):
                        rows, q, k, v = step(STEPS[3], layer)
                        expect(STEPS[3], layer, await astream.attend_blocks(layer, rows, q, k, v), q, k, v)
                assert (await ac.info()).block_spaces == 1

        asyncio.run(aio())
        calls = len(STEPS) * 4
        wait_for(
            lambda: (
                counter(server.metrics(), "chunkattn_attend_calls_total", mode="blocks")
                == calls + counter(before, "chunkattn_attend_calls_total", mode="blocks")
            ),
            message="chunkattn_attend_calls_total{mode=blocks} did not count every call",
        )
        after = server.metrics()
        assert counter(after, "chunkattn_attend_calls_total", mode="sequence") == counter(
            before, "chunkattn_attend_calls_total", mode="sequence"
        )

        assert c.close_block_space(space.space_id) == space.pool_blocks
        info = c.info()
        assert (info.block_spaces, info.free_blocks, info.active_sequences) == (0, free, 0)
        closed = server.metrics()
        assert counter(closed, "chunkattn_block_spaces") == counter(before, "chunkattn_block_spaces")
        assert counter(closed, "chunkattn_kv_blocks_used") == used
        assert counter(closed, "chunkattn_tenant_kv_blocks", tenant="e2e") == 0
        with pytest.raises(ChunkAttnError) as e:
            c.close_block_space(space.space_id)
        assert e.value.code == NOT_FOUND


def test_layer_planes_share_a_pool_block_and_the_space_costs_fewer(server: ServerProcess) -> None:
    """vLLM's hybrid layout: the three chunked layers in one plane, the global one in another; the space costs
    2 pool blocks per block, and a layer of one plane does not read what a layer of the other wrote at the same
    slots."""
    rng = np.random.default_rng(2)
    with client(server, "e2e") as c:
        free = c.info().free_blocks
        space = c.open_block_space(4, layer_planes=[0, 0, 0, 1])
        assert (space.num_planes, space.pool_blocks) == (2, 8)
        assert c.info().free_blocks == free - 8
        ref = ReferenceModel.for_server(c.info())
        kv = KVCacheManager(4, BS)
        for entries in ([("s", 0, 6)], [("s", 6, 1)]):  # the decode reads the prefill's keys from the space
            kv.schedule(entries)
            for layer in (0, GLOBAL):  # layers of different planes, the same slots
                q, k, v = qkv(rng, entries[0][2])
                out = c.attend_blocks(layer, rows_of(kv, space.space_id, entries, layer), q, k, v)
                close_enough(out, ref.attend(layer, [BatchEntry(*entries[0])], q, k, v))
        assert c.close_block_space(space.space_id) == 8
        assert c.info().free_blocks == free


def test_block_calls_of_two_tenants_and_sequence_calls_at_once_are_each_served_as_alone(server: ServerProcess) -> None:
    """Three clients at once on one layer after another: two tenants' spaces (block calls of one layer may share
    a step) and the sequence API (never in a step with block calls); every answer is its reference's."""
    errors: list[BaseException] = []

    def blocks(tenant: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with client(server, tenant) as c:
            space = c.open_block_space(8)
            ref = ReferenceModel.for_server(c.info())
            kv = KVCacheManager(8, BS, seed=seed)
            for entries in [[("s", 0, 10)], *[[("s", 10 + i, 1)] for i in range(12)]]:
                kv.schedule(entries)
                for layer in range(4):
                    q, k, v = qkv(rng, entries[0][2])
                    out = c.attend_blocks(layer, rows_of(kv, space.space_id, entries, layer), q, k, v)
                    close_enough(out, ref.attend(layer, [BatchEntry(*entries[0])], q, k, v))
            c.close_block_space(space.space_id)

    def sequences() -> None:
        rng = np.random.default_rng(0)
        with client(server, "e2e") as c:
            ref = ReferenceModel.for_server(c.info())
            for entry in [BatchEntry("s", 0, 10), *[BatchEntry("s", 10 + i, 1) for i in range(12)]]:
                for layer in range(4):
                    q, k, v = qkv(rng, entry.num_tokens)
                    close_enough(c.attend(layer, [entry], q, k, v), ref.attend(layer, [entry], q, k, v))
            c.release(["s"])

    def run(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:
            errors.append(e)

    with caller(server, "a") as raw:
        free = raw.info().free_blocks
        threads = [
            threading.Thread(target=run, args=(blocks, "a", 1)),
            threading.Thread(target=run, args=(blocks, "b", 2)),
            threading.Thread(target=run, args=(sequences,)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client got no answer"
        assert not errors, errors
        assert raw.info().free_blocks == free
