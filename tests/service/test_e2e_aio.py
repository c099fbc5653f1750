"""The asyncio client against a real server: the same answers as the reference, unary and stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from chunkattn_client import AsyncChunkAttnClient, BatchEntry, ChunkAttnError, ReferenceModel
from tests.helpers.server_process import SMALL, ServerProcess

pytestmark = pytest.mark.server

H, HKV, D = 4, 2, 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "1024", "--idle-timeout-s", "0") as s:
        yield s


def test_async_client_unary_stream_and_errors(server: ServerProcess) -> None:
    async def main() -> None:
        rng = np.random.default_rng(0)
        ref = ReferenceModel([16, 16, 16, 0])
        async with AsyncChunkAttnClient(server.target, timeout_s=60) as c:
            assert await c.health() == "SERVING"
            assert (await c.info()).num_heads == H

            async def check(call: object, layer: int, entries: list[BatchEntry]) -> None:
                t = sum(e.num_tokens for e in entries)
                q = rng.standard_normal((t, H, D)).astype(np.float32)
                k = rng.standard_normal((t, HKV, D)).astype(np.float32)
                out = await call(layer, entries, q, k, k)  # type: ignore[operator]
                assert np.abs(out - ref.attend(layer, entries, q, k, k)).max() < 1e-5

            for layer in range(4):
                await check(c.attend, layer, [BatchEntry("a", 0, 20)])
            async with c.stream() as stream:
                for layer in range(4):
                    await check(stream.attend, layer, [BatchEntry("a", 20, 1), BatchEntry("b", 0, 2)])
                with pytest.raises(ChunkAttnError) as err:
                    await check(stream.attend, 0, [BatchEntry("a", 0, 1)])
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
                await check(stream.attend, 0, [BatchEntry("a", 21, 1)])  # the stream is still usable
            assert await c.release(["a", "b"]) == 2
            with pytest.raises(ChunkAttnError) as err:
                await c.release(["a"])
            assert err.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())
