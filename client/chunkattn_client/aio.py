"""The asyncio client: the same methods as ``ChunkAttnClient``, awaitable.

async with AsyncChunkAttnClient("localhost:50051") as c:
    out = await c.attend(0, [BatchEntry("s", 0, 100)], q, k, v)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any

import grpc
import numpy.typing as npt
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkattn_client import wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2_grpc as pb_grpc
from chunkattn_client.batch import BatchEntry
from chunkattn_client.client import (
    ATTEND,
    ATTEND_STREAM,
    DEFAULT_MAX_MESSAGE_BYTES,
    ChunkAttnError,
    Credentials,
    KVImport,
    KVTransfer,
    Routed,
    ServerInfo,
    Truncated,
    attend_request,
    decode_attend_response,
    open_channel,
    renamed,
    rpc_errors,
    transfer_request,
)


class AsyncChunkAttnClient(Routed):
    """An asyncio client; see ``ChunkAttnClient`` for the arguments and each method's contract."""

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keepalive_s: float | None = None,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        token: str | None = None,
        timeout_s: float | None = None,
        route: str | None = None,
    ) -> None:
        credentials = Credentials(root_certificates, certificate_chain, private_key, token)
        self._set_metadata(token, route)
        self._channel: grpc.aio.Channel = open_channel(grpc.aio, target, max_message_bytes, keepalive_s, credentials)
        self._stub = pb_grpc.ChunkAttnStub(self._channel)
        self._attend = self._channel.unary_unary(
            ATTEND, request_serializer=wire.identity, response_deserializer=wire.identity
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes

    async def __aenter__(self) -> AsyncChunkAttnClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    async def info(self) -> ServerInfo:
        with rpc_errors():
            return ServerInfo.from_pb(
                await self._stub.Info(pb.InfoRequest(), timeout=self.timeout_s, metadata=self._metadata)
            )

    async def health(self, service: str = "") -> str:
        with rpc_errors():
            r = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s, metadata=self._metadata
            )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    async def attend(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        q: Any,
        k: Any = None,
        v: Any = None,
        *,
        end_of_sequence: Sequence[str] = (),
        dtype: str | None = None,
    ) -> npt.NDArray[Any]:
        request = attend_request(layer, entries, q, k, v, end_of_sequence=end_of_sequence, dtype=dtype)
        with rpc_errors():
            response = await self._attend(request, timeout=self.timeout_s, metadata=self._metadata)
        return decode_attend_response(response)

    async def release(self, seq_ids: Sequence[str], *, missing_ok: bool = False) -> int:
        request = pb.ReleaseRequest(seq_ids=list(seq_ids), missing_ok=missing_ok)
        with rpc_errors():
            r = await self._stub.Release(request, timeout=self.timeout_s, metadata=self._metadata)
        return int(r.released)

    async def fork(self, parent: str, child: str) -> int:
        with rpc_errors():
            r = await self._stub.Fork(
                pb.ForkRequest(parent=parent, child=child), timeout=self.timeout_s, metadata=self._metadata
            )
        return int(r.shared_blocks)

    async def truncate(self, seq_id: str, length: int) -> Truncated:
        """ChunkAttnClient.truncate: take a sequence back to its first ``length`` tokens in every layer."""
        with rpc_errors():
            r = await self._stub.Truncate(
                pb.TruncateRequest(seq_id=seq_id, length=length), timeout=self.timeout_s, metadata=self._metadata
            )
        return Truncated.from_pb(r)

    async def export_kv(
        self, seq_id: str, *, layers: Sequence[int] = (), max_message_bytes: int = 0
    ) -> AsyncIterator[pb.KVChunk]:
        request = pb.ExportKVRequest(seq_id=seq_id, layers=list(layers), max_message_bytes=max_message_bytes)
        with rpc_errors():
            async for chunk in self._stub.ExportKV(request, timeout=self.timeout_s, metadata=self._metadata):
                yield chunk

    async def import_kv(self, chunks: AsyncIterable[pb.KVChunk], *, seq_id: str | None = None) -> KVImport:
        async def feed() -> AsyncIterator[pb.KVChunk]:
            async for c in chunks:
                yield renamed(c, seq_id)

        with rpc_errors():
            r = await self._stub.ImportKV(feed(), timeout=self.timeout_s, metadata=self._metadata)
        return KVImport(r.seq_id, r.blocks, r.records, r.bytes)

    async def transfer_kv(
        self,
        seq_id: str,
        target: str,
        *,
        new_seq_id: str = "",
        release_after: bool = False,
        layers: Sequence[int] = (),
        target_token: str = "",
    ) -> KVTransfer:
        request = transfer_request(seq_id, target, new_seq_id, release_after, layers, target_token)
        with rpc_errors():
            return KVTransfer.from_pb(
                await self._stub.TransferKV(request, timeout=self.timeout_s, metadata=self._metadata)
            )

    def stream(self) -> AsyncAttendStream:
        return AsyncAttendStream(
            self._channel.stream_stream(
                ATTEND_STREAM, request_serializer=wire.identity, response_deserializer=wire.identity
            ),
            self._metadata,
        )


class AsyncAttendStream:
    """Calls over one AttendStream RPC, answered in order; ``async with`` closes it."""

    def __init__(
        self,
        method: grpc.aio.StreamStreamMultiCallable[bytes, bytes],
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._call = method(self._feed(), metadata=metadata)
        self._responses: AsyncIterator[bytes] = self._call.__aiter__()
        self._next_id = 0
        self._lock = asyncio.Lock()

    async def _feed(self) -> AsyncIterator[bytes]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def __aenter__(self) -> AsyncAttendStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream. Never raises: a stream that already failed has nothing left to close."""
        async with self._lock:
            await self._requests.put(None)
            with contextlib.suppress(grpc.RpcError):
                async for _ in self._responses:  # drain so the RPC ends cleanly
                    pass

    def cancel(self) -> None:
        """End the RPC at once, answered or not (e.g. after a call on it timed out)."""
        self._call.cancel()

    async def attend(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        q: Any,
        k: Any = None,
        v: Any = None,
        *,
        end_of_sequence: Sequence[str] = (),
        dtype: str | None = None,
    ) -> npt.NDArray[Any]:
        async with self._lock:
            self._next_id += 1
            rid = self._next_id
            await self._requests.put(
                attend_request(layer, entries, q, k, v, end_of_sequence=end_of_sequence, dtype=dtype, request_id=rid)
            )
            try:
                with rpc_errors():
                    response = await self._responses.__anext__()
            except StopAsyncIteration:
                raise ChunkAttnError(grpc.StatusCode.UNAVAILABLE, "the stream ended") from None
        return decode_attend_response(response, rid)
