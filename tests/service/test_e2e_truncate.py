"""Truncate through a real server: speculative decoding's verify-then-roll-back, its refusals and statuses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from chunkattn_client import AsyncChunkAttnClient, BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel
from chunkattn_client.reference import within_tolerance
from tests.helpers.server_process import SMALL, ServerProcess, counter
from tests.helpers.tensors import qkv

pytestmark = pytest.mark.server


# SMALL: 3 chunked layers (C = 16), then a global one; blocks of 4
@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--spec-window", "3") as s:
        yield s


class Runner:
    """A model runner: every layer once per step, each output checked against the reference."""

    def __init__(self, client: ChunkAttnClient) -> None:
        self.client = client
        self.reference = ReferenceModel.for_server(client.info())
        self.rng = np.random.default_rng(0)

    def step(self, seq_id: str, position: int, n: int) -> None:
        for layer in range(4):
            q, k, v = qkv(self.rng, n)
            out = self.client.attend(layer, [BatchEntry(seq_id, position, n)], q, k, v)
            ok, err = within_tolerance(
                out, self.reference.attend(layer, [BatchEntry(seq_id, position, n)], q, k, v), "float32"
            )
            assert ok, (layer, position, err)

    def truncate(self, seq_id: str, length: int) -> int:
        done = self.client.truncate(seq_id, length)
        self.reference.truncate(seq_id, length)
        return done.min_length


def refused(call: object, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(ChunkAttnError) as e:
        call()  # type: ignore[operator]
    assert e.value.code == code, e.value
    for word in words:
        assert word in e.value.message, e.value.message


def test_verify_calls_roll_back_across_a_chunk_boundary_and_the_outputs_stay_exact(server: ServerProcess) -> None:
    with ChunkAttnClient(server.target, timeout_s=60) as c:
        assert c.info().spec_window == 3
        before = server.metrics()
        r = Runner(c)
        r.step("s", 0, 14)
        r.step("s", 14, 4)  # a verify call of 3 drafts, across the chunk boundary at 16
        assert r.truncate("s", 15) == 0  # one accepted; every layer still holds 0..14
        r.step("s", 15, 1)
        r.step("s", 16, 4)  # len 20: the chunked layers keep from chunk_start(17) = 16 on
        assert r.truncate("s", 17) == 16
        free = c.info().free_blocks
        refused(lambda: c.truncate("s", 10), grpc.StatusCode.FAILED_PRECONDITION, "min_length=16 ", "--spec-window 3")
        refused(lambda: c.truncate("s", 18), grpc.StatusCode.FAILED_PRECONDITION, "it has 17")
        assert c.info().free_blocks == free  # refusals change nothing
        for position in range(17, 21):
            r.step("s", position, 1)
        assert c.truncate("s", 16).released_blocks == 8  # blocks 4 and 5 (16..20) of each of the 4 KV groups
        r.reference.truncate("s", 16)
        r.step("s", 16, 2)
        after = server.metrics()
        assert (
            counter(after, "chunkattn_sequences_truncated_total")
            - counter(before, "chunkattn_sequences_truncated_total")
            == 3
        )
        assert (
            counter(after, "chunkattn_truncated_tokens_total") - counter(before, "chunkattn_truncated_tokens_total")
            == 11
        )
        assert counter(after, "chunkattn_requests_total", rpc="Truncate", code="FAILED_PRECONDITION") >= 2
        c.release(["s"])
        info = c.info()
        assert info.free_blocks == info.num_blocks


def test_bad_requests_are_refused_with_their_status(server: ServerProcess) -> None:
    with ChunkAttnClient(server.target, timeout_s=60) as c:
        Runner(c).step("t", 0, 3)
        refused(lambda: c.truncate("t", -1), grpc.StatusCode.INVALID_ARGUMENT, "from 0 to 2147483647, got -1")
        refused(lambda: c.truncate("t", 2**40), grpc.StatusCode.INVALID_ARGUMENT, "got 1099511627776")
        refused(lambda: c.truncate("nope", 0), grpc.StatusCode.NOT_FOUND, "'nope'")
        refused(lambda: c.truncate("", 0), grpc.StatusCode.INVALID_ARGUMENT, "non-empty")
        c.release(["t"])


def test_the_asyncio_client_truncates_too(server: ServerProcess) -> None:
    with ChunkAttnClient(server.target, timeout_s=60) as c:
        Runner(c).step("u", 0, 6)

    async def go() -> None:
        async with AsyncChunkAttnClient(server.target, timeout_s=60) as a:
            done = await a.truncate("u", 2)
            assert (done.released_blocks, done.min_length) == (4, 0)  # block 1 (4, 5) of each layer's group
            await a.release(["u"])

    asyncio.run(go())
