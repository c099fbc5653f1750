"""The KV RPCs: Fork, ExportKV, ImportKV and TransferKV (server-to-server), over the engine worker.

As in service.py, each reads as decode -> run on the engine worker -> encode, and errors become
statuses through ``errors.status_code`` alone. An export reads the sequence in batches (one engine job
each, so calls to other sequences interleave) and fails with ABORTED if the sequence changes in
between. An import reserves its blocks when the header arrives and returns them unless the stream ends
with every block intact and a trailer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from chunkattn_client import wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.client import channel_options
from chunkattn_server import kvwire
from chunkattn_server.channels import ChannelPool
from chunkattn_server.engine import Engine, EngineStats, ImportSession
from chunkattn_server.errors import DataLoss, IncompatibleKV, StreamStalled, TargetError, status_code
from chunkattn_server.kv.transfer import BlockRecord, KVManifest, batches, record_bytes
from chunkattn_server.metrics import Metrics

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]
Run = Callable[[str, Callable[[Engine], T]], Awaitable[T]]

DEFAULT_KV_MESSAGE_BYTES = 4 << 20
DEFAULT_TRANSFER_TIMEOUT_S = 600.0  # when the caller sets no deadline: a hung target must not pin us forever
DEFAULT_IMPORT_STALL_S = 60.0  # an import that sends nothing this long is abandoned and its blocks returned
DEFAULT_TRANSFER_KEEPALIVE_S = 30.0  # TransferKV's channels ping their target after this long without news
IMPORT_KV = "/chunkattn.v1.ChunkAttn/ImportKV"


class KVService:
    """The KV RPCs. ``run`` runs a function on the engine worker; ``count`` records a finished RPC."""

    def __init__(
        self,
        run: Run[Any],
        count: Callable[[str, grpc.StatusCode], None],
        observe_pool: Callable[[EngineStats], None],
        metrics: Metrics,
        *,
        max_message_bytes: int,
        import_stall_s: float = DEFAULT_IMPORT_STALL_S,
        transfer_keepalive_s: float = DEFAULT_TRANSFER_KEEPALIVE_S,
    ) -> None:
        self._run = run
        self._count = count
        self._observe_pool = observe_pool  # the KV-in-use and active-sequence gauges
        self._metrics = metrics
        self._max_message_bytes = max_message_bytes
        self._import_stall_s = import_stall_s  # 0: wait for ever (the client's deadline still applies)
        # TransferKV's channels, kept open. With keepalive, a target whose host vanished without closing the
        # connection (no reset: powered off, cut off, frozen) is found out within two keepalive periods, an
        # unanswered ping failing the transfer with UNAVAILABLE, instead of at the transfer's deadline.
        self._targets = ChannelPool(channel_options(max_message_bytes, transfer_keepalive_s or None))

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        def ser(m: Any) -> bytes:
            return bytes(m.SerializeToString())

        return {
            "Fork": grpc.unary_unary_rpc_method_handler(
                self.Fork, request_deserializer=pb.ForkRequest.FromString, response_serializer=ser
            ),
            # KV chunks travel as bytes built and read by kvwire (no copies of the K/V through protobuf).
            "ExportKV": grpc.unary_stream_rpc_method_handler(
                self.ExportKV, request_deserializer=pb.ExportKVRequest.FromString, response_serializer=wire.identity
            ),
            "ImportKV": grpc.stream_unary_rpc_method_handler(
                self.ImportKV, request_deserializer=wire.identity, response_serializer=ser
            ),
            "TransferKV": grpc.unary_unary_rpc_method_handler(
                self.TransferKV, request_deserializer=pb.TransferKVRequest.FromString, response_serializer=ser
            ),
        }

    async def Fork(self, request: pb.ForkRequest, context: Context) -> pb.ForkResponse:  # noqa: N802
        try:
            shared, stats = await self._run("Fork", lambda e: (e.fork(request.parent, request.child), e.stats()))
        except Exception as e:
            await self._fail("Fork", context, e)
        self._metrics.forked.inc()
        self._observe_pool(stats)
        self._count("Fork", grpc.StatusCode.OK)
        return pb.ForkResponse(shared_blocks=shared)

    async def ExportKV(self, request: pb.ExportKVRequest, context: Context) -> AsyncIterator[bytes]:  # noqa: N802
        started = time.perf_counter()
        limit = min(request.max_message_bytes or DEFAULT_KV_MESSAGE_BYTES, self._max_message_bytes)
        try:
            manifest = await self._manifest(request.seq_id, list(request.layers))
            async for chunk in self._chunks(manifest, limit):
                yield chunk
        except Exception as e:
            self._transferred("out", status_code(e), started)
            await self._fail("ExportKV", context, e)
        self._transferred("out", grpc.StatusCode.OK, started)
        self._count("ExportKV", grpc.StatusCode.OK)

    async def ImportKV(self, request_iterator: AsyncIterator[bytes], context: Context) -> pb.ImportKVResponse:  # noqa: N802
        started = time.perf_counter()
        try:
            response = await self._import(request_iterator)
        except Exception as e:
            self._transferred("in", status_code(e), started)
            await self._fail("ImportKV", context, e)
        self._transferred("in", grpc.StatusCode.OK, started)
        self._count("ImportKV", grpc.StatusCode.OK)
        return response

    async def TransferKV(self, request: pb.TransferKVRequest, context: Context) -> pb.TransferKVResponse:  # noqa: N802
        started = time.perf_counter()
        try:
            remaining = context.time_remaining()
            response = await self._transfer(request, DEFAULT_TRANSFER_TIMEOUT_S if remaining is None else remaining)
        except Exception as e:
            self._transferred("out", status_code(e), started)
            await self._fail("TransferKV", context, e)
        response.seconds = time.perf_counter() - started
        self._transferred("out", grpc.StatusCode.OK, started)
        self._count("TransferKV", grpc.StatusCode.OK)
        return response

    # -- the work --------------------------------------------------------------------------------------

    async def _manifest(self, seq_id: str, layers: list[int]) -> KVManifest:
        result: KVManifest = await self._run("ExportKV", lambda e: e.export_manifest(seq_id, layers or None))
        return result

    async def _chunks(
        self, manifest: KVManifest, limit: int, *, as_id: str = "", failure: list[BaseException] | None = None
    ) -> AsyncIterator[bytes]:
        """Serialized KVChunks: header, blocks in messages of at most ``limit`` bytes (at least one block
        each), trailer. The next message's engine job runs while this one is on the wire.

        With ``failure``, an error ends the stream early (no trailer: the importer sees it cut short) and is
        kept there for the caller, instead of being raised into the consumer (gRPC's request stream)."""
        yield kvwire.encode_header(manifest, as_id)
        todo = message_batches(manifest, limit)
        pending = asyncio.ensure_future(self._run("ExportKV", exporter(manifest, todo[0]))) if todo else None
        try:
            for i in range(len(todo)):
                assert pending is not None
                try:
                    message, blocks, nbytes = await pending
                except Exception as e:
                    if failure is None:
                        raise
                    failure.append(e)
                    return
                pending = (
                    asyncio.ensure_future(self._run("ExportKV", exporter(manifest, todo[i + 1])))
                    if i + 1 < len(todo)
                    else None
                )
                self._metrics.kv_transfer_blocks.labels("out").inc(blocks)
                self._metrics.kv_transfer_bytes.labels("out").inc(nbytes)
                yield message
        finally:
            if pending is not None:
                pending.cancel()
        yield kvwire.encode_trailer(sum(len(batch) for batch in todo))

    async def _import(self, chunks: AsyncIterator[bytes]) -> pb.ImportKVResponse:
        it = chunks.__aiter__()
        received = 0

        async def receive() -> bytes | None:
            """The stream's next message (None at its end); StreamStalled after too long a silence."""
            nonlocal received
            try:
                async with asyncio.timeout(self._import_stall_s or None):  # no task per message, as wait_for makes
                    data = await anext(it, None)
            except TimeoutError:
                raise StreamStalled(
                    f"the KV stream sent nothing for {self._import_stall_s:g} s (messages so far: {received}), so"
                    " the import was abandoned and its blocks returned (chunkattn-server --kv-import-stall-s)"
                ) from None
            received += 1
            return data

        first = await receive()
        if first is None:
            raise DataLoss("the KV stream is empty; it must start with its header")
        part, manifest = kvwire.decode(first)
        if part != "header" or not isinstance(manifest, KVManifest):
            raise IncompatibleKV("a KV stream must start with its header")
        holder: list[ImportSession] = []  # set on the worker, so that no cancellation can lose the session

        def begin(e: Engine) -> ImportSession:
            holder.append(e.begin_import(manifest))
            return holder[0]

        def abort(e: Engine) -> None:
            if holder:
                e.abort_import(holder[0])  # nothing to do after a commit

        records = nbytes = 0
        # The previous message's write (its job, blocks, bytes), running while the next message arrives.
        writing: tuple[asyncio.Future[None], int, int] | None = None

        async def written() -> None:
            """Wait for the previous message's write (raising what it raised) and count it."""
            nonlocal writing, records, nbytes
            if writing is not None:
                (job, count, size), writing = writing, None
                await job
                records += count
                nbytes += size
                self._metrics.kv_transfer_blocks.labels("in").inc(count)
                self._metrics.kv_transfer_bytes.labels("in").inc(size)

        try:
            session: ImportSession = await self._run("ImportKV", begin)
            trailer = False
            while (data := await receive()) is not None:
                await written()  # a damaged block is reported before anything about the next message
                part, body = kvwire.decode(data)
                if trailer or part not in ("blocks", "trailer"):
                    raise IncompatibleKV(f"unexpected {part or 'empty'} message in the KV stream after its header")
                if part == "trailer":
                    trailer = True
                    continue
                assert isinstance(body, list)
                job = asyncio.ensure_future(self._run("ImportKV", _importer(session, body)))
                writing = (job, len(body), sum(len(r.k) + len(r.v) for r in body))
            await written()
            if not trailer:
                raise DataLoss(f"the KV stream ended before its trailer, after {records} blocks: it was cut short")
            blocks, stats = await self._run("ImportKV", lambda e: (e.commit_import(session), e.stats()))
            self._observe_pool(stats)
        finally:
            if writing is not None:  # the stream failed while a write was queued or running: drop it
                dropped = writing[0]
                dropped.cancel()
                dropped.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: nothing to log
            # Queued behind the begin job and any running write (one worker, in order) and shielded: a
            # cancelled RPC still returns every reserved block, even when cancelled while the begin job ran.
            await asyncio.shield(self._run("ImportKV", abort))
        return pb.ImportKVResponse(seq_id=manifest.seq_id, blocks=blocks, records=records, bytes=nbytes)

    async def _transfer(self, request: pb.TransferKVRequest, timeout: float | None) -> pb.TransferKVResponse:
        manifest = await self._manifest(request.seq_id, list(request.layers))  # NOT_FOUND before any connection
        failure: list[BaseException] = []
        chunks = self._chunks(manifest, DEFAULT_KV_MESSAGE_BYTES, as_id=request.new_seq_id, failure=failure)
        try:
            async with self._targets.use(request.target) as channel:
                method: grpc.aio.StreamUnaryMultiCallable[bytes, pb.ImportKVResponse] = channel.stream_unary(
                    IMPORT_KV, request_serializer=wire.identity, response_deserializer=pb.ImportKVResponse.FromString
                )
                imported: pb.ImportKVResponse = await method(chunks, timeout=timeout)
        except grpc.RpcError as e:
            if failure:  # our export failed first; the target only saw the stream stop
                raise failure[0] from None
            raise TargetError.from_rpc(e, request.target) from None
        if failure:
            raise failure[0]
        released = False
        if request.release_after:  # only if no call changed it since the export (else ABORTED)
            stats = await self._run("TransferKV", _releaser(manifest))
            self._observe_pool(stats)
            self._metrics.released.inc()
            released = True
        return pb.TransferKVResponse(
            blocks=imported.blocks, records=imported.records, bytes=imported.bytes, released=released
        )

    async def close(self) -> None:
        """Close the channels to transfer targets (at shutdown, after the last call)."""
        await self._targets.close()

    # -- helpers -----------------------------------------------------------------------------------------

    def _transferred(self, direction: str, code: grpc.StatusCode, started: float) -> None:
        """Count a finished transfer (``code``: what the caller is told)."""
        self._metrics.kv_transfers.labels(direction, code.name).inc()
        self._metrics.kv_transfer_seconds.labels(direction).observe(time.perf_counter() - started)

    async def _fail(self, rpc: str, context: Context, e: BaseException) -> None:
        code = status_code(e)
        self._count(rpc, code)
        await context.abort(code, str(e))


def _releaser(manifest: KVManifest) -> Callable[[Engine], EngineStats]:
    def job(e: Engine) -> EngineStats:
        e.release_exported(manifest)
        return e.stats()

    return job


def message_batches(manifest: KVManifest, limit: int) -> list[Sequence[tuple[int, int]]]:
    """The export's records (layer, logical block) cut into messages of at most ``limit`` bytes (at least
    one record each)."""
    return batches(manifest.expected(), max(1, limit // (record_bytes(manifest.model) + 64)))


def exporter(manifest: KVManifest, batch: Sequence[tuple[int, int]]) -> Callable[[Engine], tuple[bytes, int, int]]:
    """The engine job that reads one message's records and encodes them: (serialized KVChunk, blocks, K/V
    bytes), on the worker, leaving the event loop to gRPC. On the CPU the pages are copied once, straight
    into the message."""

    def job(e: Engine) -> tuple[bytes, int, int]:
        views = e.export_views(manifest, batch)
        return kvwire.encode_blocks(views), len(views), len(views) * record_bytes(manifest.model)

    return job


def _importer(session: ImportSession, batch: list[BlockRecord]) -> Callable[[Engine], None]:
    return lambda e: e.import_records(session, batch)
