"""The asyncio client: the same methods as ``ChunkAttnClient``, awaitable; both send the calls of ``_requests``.

async with AsyncChunkAttnClient("localhost:50051") as c:
    out = await c.attend(0, [BatchEntry("s", 0, 100)], q, k, v)
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Unpack

import grpc

from chunkattn_client import _requests as calls
from chunkattn_client._base import ClientBase
from chunkattn_client._errors import ChunkAttnError, rpc_errors
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._requests import AttendOptions, Entries, Output, TransferOptions
from chunkattn_client._stream import Answer, AsyncPlaneStream, StreamState, failure
from chunkattn_client._types import BlockSpace, Copied, Grant, KVImport, KVTransfer, OpenSpace, ServerInfo, Truncated
from chunkattn_client.batch import BlockRows

if TYPE_CHECKING:
    from chunkattn_client._zmqplane import AsyncZmqDataPlane

T = TypeVar("T")


class AsyncChunkAttnClient(ClientBase):
    """An asyncio client; see ``ChunkAttnClient`` for the arguments and each method's contract."""

    api: ClassVar[Any] = grpc.aio
    lock: ClassVar[Any] = asyncio.Lock

    async def __aenter__(self) -> AsyncChunkAttnClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._plane is not None:
            await self._plane.close()
            self._forget_plane()
        self._end_context()
        if self._owns_channel:
            await self._channel.close()

    async def open_data_plane(self) -> str:
        """ChunkAttnClient.open_data_plane: make the data-plane choice now; returns ``data_plane``."""
        await self._data_plane()
        return self.data_plane

    async def _data_plane(self) -> AsyncZmqDataPlane | None:
        if self._plane_decided:
            plane: AsyncZmqDataPlane | None = self._plane
            return plane
        async with self._opening:
            if not self._plane_decided:
                opened = self._now()
                try:
                    outcome: Any = await self._unary(calls.open_data_plane())
                except ChunkAttnError as e:
                    outcome = e
                offer = self._offer(outcome, opened)
                if offer is not None:
                    from chunkattn_client._zmqplane import AsyncZmqDataPlane  # zmq only once it is used

                    self._plane = AsyncZmqDataPlane(offer, self._reopen, self._context())
                    self._plane_decided = True
            opened_plane: AsyncZmqDataPlane | None = self._plane
            return opened_plane

    async def _reopen(self) -> Any:
        opened = self._now()
        return self._renewed(await self._unary(calls.open_data_plane()), opened)

    async def _unary(self, call: calls.Call[T]) -> T:
        with rpc_errors():
            return call.decode(await self._start(call))

    async def info(self) -> ServerInfo:
        return await self._unary(calls.info())

    async def health(self, service: str = "") -> str:
        return await self._unary(calls.health(service))

    async def attend(
        self, layer: int, entries: Entries, q: Any, k: Any = None, v: Any = None, **options: Unpack[AttendOptions]
    ) -> Output:
        plane = await self._data_plane()
        if plane is not None:
            return await plane.call(
                lambda rid: calls.attend_request(layer, entries, q, k, v, **options, request_id=rid), self.timeout_s
            )
        return await self._unary(calls.attend(layer, entries, q, k, v, **options))

    async def release(self, seq_ids: Sequence[str], *, missing_ok: bool = False) -> int:
        return await self._unary(calls.release(seq_ids, missing_ok))

    async def open_block_space(
        self, num_blocks: int, *, layer_planes: Sequence[int] = (), lease_s: float = 0.0
    ) -> BlockSpace:
        return await self._unary(calls.open_block_space(num_blocks, layer_planes, lease_s))

    async def close_block_space(self, space_id: str) -> int:
        return await self._unary(calls.close_block_space(space_id))

    async def renew_block_space(self, space_id: str) -> float:
        return await self._unary(calls.renew_block_space(space_id))

    async def list_block_spaces(self) -> list[OpenSpace]:
        return await self._unary(calls.list_block_spaces())

    async def grant_blocks(
        self,
        space_id: str,
        block_ids: Sequence[int],
        grant_id: str,
        *,
        num_tokens: int = 0,
        ttl_s: float = 0.0,
        to_tenant: str = "",
        target: str = "",
        target_token: str = "",
        whole: bool = False,
        tag: str = "",
    ) -> Grant:
        """Hand blocks of a space over (GrantBlocks): the server parks a copy of them, every plane, under
        ``grant_id`` (32 to 64 characters of [A-Za-z0-9_-], random: it is the capability) until CopyBlocks takes
        it or ``ttl_s`` (0: 60 s) passes; ``to_tenant`` may take it too. ``num_tokens``: what the blocks hold.
        With ``target`` (host:port of another server) the grant is parked there instead, its live blocks sent
        by this server (``target_token``: the credentials it presents there; empty: its --transfer-token), or
        every block's every plane with ``whole``. ``tag``: what the blocks hold, in your words (``expect_tag``)."""
        return await self._unary(
            calls.grant_blocks(
                space_id, block_ids, grant_id, num_tokens, ttl_s, to_tenant, target, target_token, whole, tag
            )
        )

    async def copy_blocks(
        self,
        dest_space_id: str,
        dest_block_ids: Sequence[int],
        *,
        space_id: str | None = None,
        grant_id: str | None = None,
        source_block_ids: Sequence[int] = (),
        expect_tag: str = "",
    ) -> Copied:
        """Copy blocks into ``dest_space_id``'s ``dest_block_ids`` (CopyBlocks), every plane: from another of
        your spaces (``space_id``, its ``source_block_ids``) or from a grant (``grant_id``, which this takes;
        ``source_block_ids`` index its blocks, empty: all; with ``expect_tag``, only a grant of that tag)."""
        return await self._unary(
            calls.copy_blocks(
                dest_space_id,
                dest_block_ids,
                space_id=space_id,
                grant_id=grant_id,
                source_block_ids=source_block_ids,
                expect_tag=expect_tag,
            )
        )

    async def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Output:
        plane = await self._data_plane()
        if plane is not None:
            return await plane.call(
                lambda rid: calls.attend_blocks_request(layer, rows, q, k, v, dtype=dtype, request_id=rid),
                self.timeout_s,
            )
        return await self._unary(calls.attend_blocks(layer, rows, q, k, v, dtype))

    async def fork(self, parent: str, child: str) -> int:
        return await self._unary(calls.fork(parent, child))

    async def truncate(self, seq_id: str, length: int) -> Truncated:
        """ChunkAttnClient.truncate: take a sequence back to its first ``length`` tokens in every layer."""
        return await self._unary(calls.truncate(seq_id, length))

    async def export_kv(
        self, seq_id: str, *, layers: Sequence[int] = (), max_message_bytes: int = 0
    ) -> AsyncIterator[pb.KVChunk]:
        with rpc_errors():
            async for message in self._start(calls.export_kv(seq_id, layers, max_message_bytes)):
                yield message

    async def import_kv(self, messages: AsyncIterable[pb.KVChunk], *, seq_id: str | None = None) -> KVImport:
        return await self._unary(calls.import_kv(calls.renaming_async(messages, seq_id)))

    async def transfer_kv(self, seq_id: str, target: str, **options: Unpack[TransferOptions]) -> KVTransfer:
        return await self._unary(calls.transfer_kv(seq_id, target, **options))

    def stream(self) -> AsyncAttendStream | AsyncPlaneStream | AsyncStream:
        """ChunkAttnClient.stream; call it with the event loop running (its reader is a task). Before the
        data-plane choice is made (the first Attend, ``open_data_plane()``), a stream that makes it on its first
        call (``AsyncStream``)."""
        if not self._plane_decided:
            return AsyncStream(self)
        if self._plane is not None:
            return AsyncPlaneStream(self._plane, self.timeout_s)
        return AsyncAttendStream(self._attend_stream, timeout_s=self.timeout_s, metadata=self._metadata)


class AsyncStream:
    """An async client's stream whose transport is chosen on its first call (the client's data plane, once
    it has chosen): then an AsyncAttendStream or an AsyncPlaneStream, whose contract it keeps."""

    def __init__(self, client: AsyncChunkAttnClient) -> None:
        self._client = client
        self._inner: AsyncAttendStream | AsyncPlaneStream | None = None
        self._ended = False

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _stream(self) -> AsyncAttendStream | AsyncPlaneStream:
        if self._inner is None:
            if self._ended:
                raise ChunkAttnError(grpc.StatusCode.CANCELLED, "the stream was closed")
            await self._client._data_plane()
            inner = self._client.stream()
            assert not isinstance(inner, AsyncStream)  # the choice is made (or _data_plane raised)
            self._inner = inner
        return self._inner

    async def close(self) -> None:
        self._ended = True
        if self._inner is not None:
            await self._inner.close()

    def cancel(self) -> None:
        self._ended = True
        if self._inner is not None:
            self._inner.cancel()

    async def attend(
        self, layer: int, entries: Entries, q: Any, k: Any = None, v: Any = None, **options: Unpack[AttendOptions]
    ) -> Output:
        """ChunkAttnClient.attend, over the stream."""
        return await (await self._stream()).attend(layer, entries, q, k, v, **options)

    async def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Output:
        """ChunkAttnClient.attend_blocks, over the stream."""
        return await (await self._stream()).attend_blocks(layer, rows, q, k, v, dtype=dtype)


class AsyncAttendStream:
    """Calls over one AttendStream RPC, answered in order; ``async with`` closes it. The contract is
    AttendStream's (``_stream``): per-call ``timeout_s``, the broken-stream state, cancellation of a call
    that times out or whose task is cancelled, ``close()`` and ``cancel()``."""

    def __init__(
        self,
        method: grpc.aio.StreamStreamMultiCallable[bytes, bytes],
        *,
        timeout_s: float | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._call: Any = method(_feed(self._requests), metadata=metadata)
        # A reader task hands answers over, as AttendStream's reader thread does: a call waits on the queue,
        # which a timeout or a cancelled task leaves intact (a read of the call cut short would not be).
        self._answers: asyncio.Queue[Answer] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(_read_answers(self._call, self._answers))
        finalizer = weakref.finalize(self, _end_stream, self._call, self._requests)
        finalizer.atexit = False  # at exit the loop is gone, and the call with it
        self._state = StreamState(timeout_s, self._call.cancel)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncAttendStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream. Never raises: a stream that already failed has nothing left to close. With
        ``timeout_s`` None and a server that never ends the RPC this waits; ``cancel()`` does not."""
        async with self._lock:
            self._requests.put_nowait(None)
            _, pending = await asyncio.wait([self._reader], timeout=self._state.timeout_s)
            if pending:
                self._call.cancel()
                await asyncio.wait([self._reader])

    def cancel(self) -> None:
        """End the RPC at once, answered or not (takes no lock: works while a call waits)."""
        self._call.cancel()

    async def attend(
        self, layer: int, entries: Entries, q: Any, k: Any = None, v: Any = None, **options: Unpack[AttendOptions]
    ) -> Output:
        """ChunkAttnClient.attend, over the stream."""
        async with self._lock:
            return await self._call_with(*self._state.request(layer, entries, q, k, v, **options))

    async def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Output:
        """ChunkAttnClient.attend_blocks, over the stream."""
        async with self._lock:
            return await self._call_with(*self._state.request_blocks(layer, rows, q, k, v, dtype))

    async def _call_with(self, rid: int, request: bytes) -> Output:
        self._requests.put_nowait(request)
        with self._state.waiting():
            answer = await asyncio.wait_for(self._answers.get(), self._state.timeout_s)
        return self._state.answer(rid, answer)


async def _feed(requests: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    """The stream's requests, until None (it holds the queue, not the stream)."""
    while (request := await requests.get()) is not None:
        yield request


async def _read_answers(call: Any, answers: asyncio.Queue[Answer]) -> None:
    """The reader task: every answer of ``call`` into ``answers``, then None, or the error that ended it."""
    try:
        async for answer in call:
            answers.put_nowait(answer)
        answers.put_nowait(None)
    except BaseException as e:  # never leave a waiting call without an answer (a cancelled call included)
        answers.put_nowait(failure(e))


def _end_stream(call: Any, requests: asyncio.Queue[bytes | None]) -> None:
    """Finalizer of a dropped AsyncAttendStream: end the request feed and cancel the RPC."""
    with contextlib.suppress(Exception):  # the loop may be closed already
        requests.put_nowait(None)
        call.cancel()
