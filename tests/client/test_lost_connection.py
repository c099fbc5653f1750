"""A server killed under a stream: the client reports UNAVAILABLE, "the connection to the server was lost".

Through Envoy (``make cluster``) the dying replica's streams are reset with RST_STREAM, which gRPC reports as
INTERNAL "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))"; ``ResettingProxy`` plays
Envoy's part. Connected to the server itself, the client sees UNAVAILABLE "Stream removed (Socket closed)".
Either way the client's error is UNAVAILABLE and says that the connection was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from chunkattn_client import AsyncChunkAttnClient, BatchEntry, ChunkAttnClient, ChunkAttnError
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.client import connection_lost
from tests.helpers.grpc_fakes import FakeCall
from tests.helpers.reset_proxy import ResettingProxy
from tests.helpers.server_process import SMALL, ServerProcess
from tests.helpers.tensors import qkv

LOST = "the connection to the server was lost mid-call"
RESET = "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))"  # gRPC 1.85, through Envoy


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.INTERNAL, RESET),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (recvmsg:Connection reset by peer (104))"),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed"),
    ],
)
def test_a_lost_connection_is_unavailable_and_says_so(code: grpc.StatusCode, details: str) -> None:
    error = ChunkAttnError.from_rpc(FakeCall(code, details))
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.message.startswith(LOST)
    assert f"(gRPC: {code.name}: {details})" in error.message  # gRPC's own status and words are kept


@pytest.mark.parametrize(
    ("code", "details"),
    [
        # A server bug: INTERNAL with the server's own message, even one that quotes gRPC's words.
        (grpc.StatusCode.INTERNAL, "unexpected error: KeyError('a')"),
        (grpc.StatusCode.INTERNAL, "the engine failed: Stream removed (RST_STREAM)"),
        (grpc.StatusCode.INTERNAL, "Internal error from Core"),
        # No connection was made: the call never reached a server, which is not "lost mid-call".
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNAVAILABLE: Socket closed"),
        (grpc.StatusCode.UNAVAILABLE, "the server is shutting down"),
        # Another status with transport words is not rewritten.
        (grpc.StatusCode.CANCELLED, "Stream removed"),
    ],
)
def test_other_errors_keep_their_status_and_message(code: grpc.StatusCode, details: str) -> None:
    error = ChunkAttnError.from_rpc(FakeCall(code, details))
    assert (error.code, error.message) == (code, details)
    assert not connection_lost(code, details)


def kill(server: ServerProcess) -> None:
    """SIGKILL: no drain, no goodbye, as a replica that crashes or is OOM-killed."""
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()


def assert_lost(error: ChunkAttnError) -> None:
    assert error.code == grpc.StatusCode.UNAVAILABLE, error
    assert error.message.startswith(LOST), error


@contextlib.contextmanager
def relayed(server: ServerProcess, via: str) -> Iterator[str]:
    """The target to connect to: the server itself ("direct"), or a ResettingProxy in front of it."""
    if via == "direct":
        yield server.target
    else:
        with ResettingProxy(server.port) as proxy:
            yield proxy.target


@pytest.mark.server
@pytest.mark.parametrize("via", ["envoy-like proxy", "direct"])
def test_a_sync_stream_whose_server_is_killed_raises_unavailable(via: str) -> None:
    q, k, v = qkv(np.random.default_rng(2), 2)
    with (
        ServerProcess(*SMALL, "--idle-timeout-s", "0") as server,
        relayed(server, via) as target,
        ChunkAttnClient(target, timeout_s=60) as client,
        client.stream() as stream,
    ):
        stream.attend(0, [BatchEntry("a", 0, 2)], q, k, v)
        kill(server)
        with pytest.raises(ChunkAttnError) as err:
            stream.attend(0, [BatchEntry("a", 2, 2)], q, k, v)
        assert_lost(err.value)
        with pytest.raises(ChunkAttnError) as again:  # the stream stays broken, for the same reason
            stream.attend(0, [BatchEntry("a", 4, 2)], q, k, v)
        assert (again.value.code, again.value.message) == (err.value.code, err.value.message)


@pytest.mark.server
def test_an_asyncio_stream_whose_server_is_killed_raises_unavailable() -> None:
    q, k, v = qkv(np.random.default_rng(2), 2)

    async def main(target: str, server: ServerProcess) -> None:
        async with AsyncChunkAttnClient(target, timeout_s=60) as client, client.stream() as stream:
            await stream.attend(0, [BatchEntry("a", 0, 2)], q, k, v)
            kill(server)
            with pytest.raises(ChunkAttnError) as err:
                await stream.attend(0, [BatchEntry("a", 2, 2)], q, k, v)
            assert_lost(err.value)

    with ServerProcess(*SMALL, "--idle-timeout-s", "0") as server, ResettingProxy(server.port) as proxy:
        asyncio.run(main(proxy.target, server))


@pytest.mark.server
def test_an_export_whose_server_is_killed_raises_unavailable() -> None:
    """ExportKV (asyncio): the server is stopped before it answers, then killed while the export waits."""
    q, k, v = qkv(np.random.default_rng(8), 8)

    async def main(proxy: ResettingProxy, server: ServerProcess) -> None:
        async with AsyncChunkAttnClient(proxy.target, timeout_s=60) as client:
            for layer in range(4):
                await client.attend(layer, [BatchEntry("a", 0, 8)], q, k, v)
            server.proc.send_signal(signal.SIGSTOP)
            opened = proxy.streams
            first = asyncio.ensure_future(anext(client.export_kv("a")))
            while proxy.streams == opened:  # the export's stream is open on the relay
                await asyncio.sleep(0.01)
            kill(server)
            with pytest.raises(ChunkAttnError) as err:
                await first
            assert_lost(err.value)

    with ServerProcess(*SMALL, "--idle-timeout-s", "0") as server, ResettingProxy(server.port) as proxy:
        asyncio.run(main(proxy, server))


@pytest.mark.server
def test_an_import_whose_server_is_killed_mid_stream_raises_unavailable() -> None:
    """ImportKV (sync): the server is killed after the first chunks were sent, before the rest."""
    q, k, v = qkv(np.random.default_rng(8), 8)
    with (
        ServerProcess(*SMALL, "--idle-timeout-s", "0") as server,
        ResettingProxy(server.port) as proxy,
        ChunkAttnClient(proxy.target, timeout_s=60) as client,
    ):
        for layer in range(4):
            client.attend(layer, [BatchEntry("a", 0, 8)], q, k, v)
        chunks = list(client.export_kv("a", max_message_bytes=4096))
        assert len(chunks) > 2

        def feed() -> Iterator[pb.KVChunk]:
            yield from chunks[:2]
            kill(server)
            yield from chunks[2:]

        with pytest.raises(ChunkAttnError) as err:
            client.import_kv(feed(), seq_id="b")
        assert_lost(err.value)
