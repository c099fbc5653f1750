"""Moving a sequence's KV: ExportKV, ImportKV and TransferKV (server-to-server), through the scheduler.

Each reads as parse -> run on the engine thread (the scheduler) -> encode, with ``rpc.py`` around it.
An export reads the sequence in batches (one engine job each, so calls to other sequences interleave) and
fails with ABORTED if the sequence changes in between. An import reserves its blocks when the header
arrives and returns them unless the stream ends with every block intact and a trailer; its messages are
decoded on the engine thread, so the event loop never walks a client's KV message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

import grpc

from chunkattn_client import wire
from chunkattn_client._channel import bearer, channel_options
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2_grpc as pb_grpc
from chunkattn_client.limits import MAX_ID_BYTES, id_problem, target_problem, token_problem
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.types import EngineStats, GrantAsk, Handoff, Leaving
from chunkattn_server.errors import DataLoss, IncompatibleKV, InvalidArgument, InvalidBatch
from chunkattn_server.kv.grant_transfer import GrantImport
from chunkattn_server.kv.grants import GrantState
from chunkattn_server.kv.manifest import KVManifest, ModelFingerprint, batches, record_bytes
from chunkattn_server.kv.transfer import ImportSession
from chunkattn_server.service import kvwire
from chunkattn_server.service.auth import Tenant
from chunkattn_server.service.channels import ChannelPool
from chunkattn_server.service.edge import Edge
from chunkattn_server.service.rpc import SMALL_REQUEST_BYTES, Context, Stream, Ticket, message
from chunkattn_server.service.status import TargetError, outcome_code
from chunkattn_server.service.tls import transfer_credentials

DEFAULT_KV_MESSAGE_BYTES = 4 << 20
DEFAULT_TRANSFER_TIMEOUT_S = 600.0  # when the caller sets no deadline: a hung target must not pin us forever
IMPORT_KV = "/chunkattn.v1.ChunkAttn/ImportKV"
# A KVHeader's bytes besides its id and its lists of layers and blocks (the model, tags and lengths), with room.
HEADER_FIXED_BYTES = 1024
# The most bytes a KVHeader spends on one listed block, or one layer's entries: a few varints, with room.
HEADER_ITEM_BYTES = 16


class KVService:
    """The KV transfer RPCs, over ``edge`` (the engine's door, the RPC scaffolding, the metrics)."""

    def __init__(self, edge: Edge) -> None:
        engine = edge.scheduler.engine
        config = edge.config
        self._run = edge.run
        self._rpcs = edge.rpcs
        self._observe_pool = edge.observe_pool  # the KV-in-use and active-sequence gauges
        self._metrics = edge.metrics
        self._config = config
        self._deadline = edge.deadline
        self._model = engine.fingerprint()
        # A header lists each held block once, and four entries per layer (its length, kept_from, group and index).
        self._max_header_bytes = (
            HEADER_FIXED_BYTES
            + MAX_ID_BYTES
            + HEADER_ITEM_BYTES * (engine.max_held_blocks() + 4 * len(self._model.chunk_sizes))
        )
        # TransferKV's channels, kept open. With keepalive, a target whose host vanished without closing the
        # connection (no reset: powered off, cut off, frozen) is found out within two keepalive periods, an
        # unanswered ping failing the transfer with UNAVAILABLE, instead of at the transfer's deadline.
        self._targets = ChannelPool(
            channel_options(config.max_message_bytes, config.transfer_keepalive_s or None),
            transfer_credentials(config),
        )

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        r, c, small = self._rpcs, self._config, SMALL_REQUEST_BYTES  # an id, a target, layers
        return {
            # KV chunks travel as bytes built and read by kvwire (no copies of the K/V through protobuf).
            "ExportKV": r.server_stream(
                "ExportKV", self.ExportKV, message(pb.ExportKVRequest, small), c.stream_idle_s, "--stream-idle-s"
            ),
            "ImportKV": r.client_stream("ImportKV", self.ImportKV, c.kv_import_stall_s, "--kv-import-stall-s"),
            "TransferKV": r.unary("TransferKV", self.TransferKV, message(pb.TransferKVRequest, small)),
        }

    async def ExportKV(  # noqa: N802
        self, request: pb.ExportKVRequest, context: Context, tenant: Tenant
    ) -> AsyncIterator[bytes]:
        started = time.perf_counter()
        if request.max_message_bytes < 0:
            raise InvalidArgument(f"max_message_bytes must be >= 0 (0: 4 MiB), got {request.max_message_bytes}")
        limit = min(request.max_message_bytes or DEFAULT_KV_MESSAGE_BYTES, self._config.max_message_bytes)
        try:
            manifest = await self._manifest(request.seq_id, list(request.layers), tenant)
            async with contextlib.aclosing(self._chunks(manifest, limit)) as chunks:  # its next job cancelled
                async for chunk in chunks:
                    yield chunk
        except BaseException as e:
            self._transferred("out", outcome_code(e), started)
            raise
        self._transferred("out", grpc.StatusCode.OK, started)

    async def ImportKV(self, stream: Stream, context: Context, tenant: Tenant) -> pb.ImportKVResponse:  # noqa: N802
        started = time.perf_counter()
        try:
            response = await self._import(stream, tenant)
        except BaseException as e:
            self._transferred("in", outcome_code(e), started)
            raise
        self._transferred("in", grpc.StatusCode.OK, started)
        return response

    async def TransferKV(  # noqa: N802
        self, request: pb.TransferKVRequest, context: Context, tenant: Tenant
    ) -> pb.TransferKVResponse:
        started = time.perf_counter()
        try:
            problem = target_problem(request.target)
            if problem:
                raise InvalidArgument(problem)
            remaining = context.time_remaining()
            timeout = DEFAULT_TRANSFER_TIMEOUT_S if remaining is None else remaining
            response = await self._transfer(request, timeout, tenant)
        except BaseException as e:
            self._transferred("out", outcome_code(e), started)
            raise
        response.seconds = time.perf_counter() - started
        self._transferred("out", grpc.StatusCode.OK, started)
        return response

    # -- the work --------------------------------------------------------------------------------------

    async def _manifest(self, seq_id: str, layers: list[int], tenant: Tenant) -> KVManifest:
        name = tenant.name
        result: KVManifest = await self._run(
            "ExportKV", lambda e: e.export_manifest(seq_id, layers or None, tenant=name)
        )
        return result

    async def _chunks(
        self, manifest: KVManifest, limit: int, *, as_id: str = "", failure: list[BaseException] | None = None
    ) -> AsyncGenerator[bytes, None]:
        """A sequence's serialized KVChunks (``_stream``), header first, blocks in messages of at most
        ``limit`` bytes (at least one block each)."""
        todo = message_batches(manifest.expected(), manifest.model, limit)
        jobs = [exporter(manifest, batch) for batch in todo]
        async for chunk in self._stream(kvwire.encode_header(manifest, as_id), jobs, failure):
            yield chunk

    async def _stream(
        self,
        header: bytes,
        jobs: Sequence[Callable[[Engine], tuple[bytes, int, int]]],
        failure: list[BaseException] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """Serialized KVChunks: ``header``, the messages of blocks ``jobs`` read and encode (each: serialized
        KVChunk, blocks, K/V bytes), a trailer. The next message's engine job runs while this one is on the wire.

        With ``failure``, an error ends the stream early (no trailer: the importer sees it cut short) and is
        kept there for the caller, instead of being raised into the consumer (gRPC's request stream)."""
        yield header
        todo, sent = jobs, 0
        pending = asyncio.ensure_future(self._run("ExportKV", todo[0])) if todo else None
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
                pending = asyncio.ensure_future(self._run("ExportKV", todo[i + 1])) if i + 1 < len(todo) else None
                self._metrics.kv_transfer_blocks.labels("out").inc(blocks)
                self._metrics.kv_transfer_bytes.labels("out").inc(nbytes)
                sent += blocks
                yield message
        finally:
            if pending is not None:
                pending.cancel()
        yield kvwire.encode_trailer(sent)

    async def _import(self, stream: Stream, tenant: Tenant) -> pb.ImportKVResponse:
        """The header is decoded, checked and its blocks reserved in one engine job; each later message is
        decoded and written in one job, running while the next message arrives. Every message counts in the
        server's limits from its arrival until it is written; only the header's can be refused, a later one
        waits while the byte budget is full."""
        admission = self._rpcs.admission
        first = await stream.read()
        if first is None:
            raise DataLoss("the KV stream is empty; it must start with its header")
        if len(first) > self._max_header_bytes:
            raise IncompatibleKV(
                f"a KV stream's first message must be its header, and a header for this server is at most"
                f" {self._max_header_bytes} bytes; this one has {len(first)}"
            )
        holder: list[ImportSession | GrantImport] = []  # set on the engine thread: no cancellation loses it

        def begin(e: Engine) -> ImportSession | GrantImport:
            part, header = kvwire.decode(first)
            if part == "grant" and isinstance(header, pb.GrantHeader):
                holder.append(e.begin_import(kvwire.grant_from_pb(header), tenant=tenant.name))
            elif part == "header" and isinstance(header, pb.KVHeader):
                holder.append(e.begin_import(kvwire.manifest_from_pb(header, tenant.name), tenant=tenant.name))
            else:
                raise IncompatibleKV("a KV stream must start with its header (or a grant's)")
            return holder[0]

        def abort(e: Engine) -> None:
            if holder:
                e.abort_import(holder[0])  # nothing to do after a commit

        records = nbytes = 0
        trailer = False
        # The previous message's write (its job, its admission), running while the next message arrives.
        writing: tuple[asyncio.Future[tuple[int, int, bool]], Ticket] | None = None

        async def written() -> None:
            """Wait for the previous message's write (raising what it raised) and count it."""
            nonlocal writing, records, nbytes, trailer
            if writing is not None:
                (job, ticket), writing = writing, None
                try:
                    count, size, trailer = await job
                finally:
                    ticket.release()
                records += count
                nbytes += size
                self._metrics.kv_transfer_blocks.labels("in").inc(count)
                self._metrics.kv_transfer_bytes.labels("in").inc(size)

        try:
            with admission.admit(len(first), tenant=tenant):
                session: ImportSession | GrantImport = await self._run("ImportKV", begin)
            while (data := await stream.read()) is not None:
                ticket = await admission.admit_when_room(len(data), tenant)
                try:
                    await written()  # a damaged block is reported before anything about the next message
                except BaseException:
                    ticket.release()
                    raise
                if trailer:
                    ticket.release()
                    raise IncompatibleKV("unexpected message in the KV stream after its trailer")
                job = asyncio.ensure_future(self._run("ImportKV", self._importer(session, data)))
                # Held while the message is being written, not while the client takes its time with the
                # next one: an idle import holds no call slot (its blocks are its own, counted in its quota).
                job.add_done_callback(_releasing(ticket))
                writing = (job, ticket)
            await written()
            if not trailer:
                raise DataLoss(f"the KV stream ended before its trailer, after {records} blocks: it was cut short")
            blocks, stats = await self._run("ImportKV", lambda e: (e.commit_import(session), e.stats()))
            self._observe_pool(stats)
        finally:
            if holder and isinstance(holder[0], GrantImport):
                self._deadline.set()  # a grant may have opened (its ttl: a new deadline), the call cancelled or not
            if writing is not None:  # the stream failed while a write was queued or running: drop it
                dropped, ticket = writing
                dropped.cancel()
                dropped.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: nothing to log
                ticket.release()
            # Queued behind the begin job and any running write (one engine thread, in order) and shielded: a
            # cancelled RPC still returns every reserved block, even when cancelled while the begin job ran.
            await asyncio.shield(self._run("ImportKV", abort))
        seq_id = session.manifest.seq_id if isinstance(session, ImportSession) else ""
        return pb.ImportKVResponse(seq_id=seq_id, blocks=blocks, records=records, bytes=nbytes)

    def _importer(self, session: ImportSession | GrantImport, data: bytes) -> Callable[[Engine], tuple[int, int, bool]]:
        """The engine job that decodes one message after the header and writes its blocks: (blocks, bytes,
        whether it was the trailer)."""
        model = self._model

        def job(e: Engine) -> tuple[int, int, bool]:
            part, body = kvwire.decode(data, model)
            if part == "trailer":
                return 0, 0, True
            if part != "blocks" or not isinstance(body, list):
                raise IncompatibleKV(f"unexpected {part or 'empty'} message in the KV stream after its header")
            e.import_records(session, body)
            return len(body), len(body) * record_bytes(model), False

        return job

    async def _transfer(
        self, request: pb.TransferKVRequest, timeout: float | None, tenant: Tenant
    ) -> pb.TransferKVResponse:
        problem = request.new_seq_id and id_problem(request.new_seq_id, "new_seq_id")
        if problem:
            raise InvalidBatch(problem)
        problem = request.target_token and token_problem(request.target_token, "target_token")
        if problem:
            raise InvalidArgument(problem)
        metadata = bearer(request.target_token or self._config.transfer_token_for(request.target))
        manifest = await self._manifest(request.seq_id, list(request.layers), tenant)  # NOT_FOUND before connecting
        failure: list[BaseException] = []
        chunks = self._chunks(manifest, DEFAULT_KV_MESSAGE_BYTES, as_id=request.new_seq_id, failure=failure)
        imported = await self._send(request.target, metadata, chunks, failure, timeout)
        released = False
        if request.release_after:  # only if no call changed it since the export (else ABORTED)
            stats = await self._run("TransferKV", _releaser(manifest))
            self._observe_pool(stats)
            self._metrics.released.inc()
            released = True
        return pb.TransferKVResponse(
            blocks=imported.blocks, records=imported.records, bytes=imported.bytes, released=released
        )

    async def _send(
        self,
        target: str,
        metadata: Any,
        chunks: AsyncIterator[bytes],
        failure: list[BaseException],
        timeout: float | None,
    ) -> pb.ImportKVResponse:
        """``chunks`` (a ``_stream`` that keeps its own error in ``failure``) into ``target``'s ImportKV; its
        answer, or its refusal (TargetError), or our stream's own error."""
        try:
            async with self._targets.use(target) as channel:
                method: grpc.aio.StreamUnaryMultiCallable[bytes, pb.ImportKVResponse] = channel.stream_unary(
                    IMPORT_KV, request_serializer=wire.identity, response_deserializer=pb.ImportKVResponse.FromString
                )
                imported: pb.ImportKVResponse = await method(chunks, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            if failure:  # our export failed first; the target only saw the stream stop
                raise failure[0] from None
            error = TargetError.from_rpc(e, target)
            if error.code == grpc.StatusCode.INTERNAL and "Internal error from Core" in str(error):
                raise await self._lost_refusal(target, metadata) from None
            raise error from None
        if failure:
            raise failure[0]
        return imported

    async def push_grant(
        self, target: str, target_token: str, ask: GrantAsk, *, whole: bool, timeout: float, tenant: Tenant
    ) -> Pushed:
        """GrantBlocks with a target: the blocks parked here and detached (a snapshot no one takes), their live
        records (every record when ``whole``) sent to ``target``'s ImportKV as a grant's stream (presenting
        ``target_token``, or the server's --transfer-token), the grant released here whatever happens, a
        cancelled call included. InvalidArgument for a bad target or token before anything is parked; the
        target's refusal passed on."""
        started = time.perf_counter()
        problem = target_problem(target) or (target_token and token_problem(target_token, "target_token"))
        if problem:
            raise InvalidArgument(problem)
        metadata = bearer(target_token or self._config.transfer_token_for(target))
        name = tenant.name
        holder: list[Leaving] = []  # set on the engine thread: a call cancelled meanwhile still releases it

        def leave(e: Engine) -> Leaving:
            holder.append(e.grant_leaving(ask, tenant=name, whole=whole, within_s=timeout))
            return holder[0]

        try:
            leaving = await self._run("GrantBlocks", leave)
            failure: list[BaseException] = []
            todo = message_batches(leaving.records, leaving.manifest.model, DEFAULT_KV_MESSAGE_BYTES)
            jobs = [_grant_reader(leaving.grant, batch) for batch in todo]
            chunks = self._stream(kvwire.grant_to_pb(leaving.manifest), jobs, failure)
            imported = await self._send(target, metadata, chunks, failure, timeout)
        except BaseException as e:
            self._transferred("out", outcome_code(e), started)
            raise
        finally:  # queued after the park and any read of its pages, and shielded: a cancelled call returns it too
            stats = await asyncio.shield(self._run("GrantBlocks", _leaving_releaser(holder)))
            self._observe_pool(stats)
        self._transferred("out", grpc.StatusCode.OK, started)
        return Pushed(leaving.parked, imported.records, imported.bytes)

    async def _lost_refusal(self, target: str, metadata: Any) -> TargetError:
        """What to say when a target refused an import and gRPC lost its reason. A target that refuses an
        import (credentials, another model, a full pool, an id in use) ends the stream while we still send,
        and gRPC Python's asyncio client then sometimes reports "Internal error from Core" in place of the
        target's status (grpc/grpc#36066: about 1 such refusal in 50 here, more on a loaded machine, and most
        refusals of credentials, which come before any message is read). One Info call with the same
        credentials, on the target's kept channel (a refusal does not drop it), finds out whether those, or
        the model the target serves, were the reason; nothing was imported."""
        try:
            async with self._targets.use(target) as channel:
                info = await pb_grpc.ChunkAttnStub(channel).Info(pb.InfoRequest(), metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return TargetError.from_rpc(e, target)
        else:
            diffs = kvwire.fingerprint_of_info(info).differences(self._model)
            if diffs:  # what the target says of such a stream (kv/transfer.py), in its words
                return TargetError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the target {target} did not import the KV: INVALID_ARGUMENT: the KV comes from another"
                    f" model shape: {'; '.join(diffs)}",
                )
        return TargetError(
            grpc.StatusCode.UNAVAILABLE,
            f"the target {target} ended the KV stream before it was sent, refusing the import, and gRPC lost its"
            " reason (grpc/grpc#36066); nothing was imported: retry, or ask the target (a full pool or an id in"
            " use are the usual reasons)",
        )

    async def close(self) -> None:
        """Close the channels to transfer targets (at shutdown, after the last call)."""
        await self._targets.close()

    # -- helpers -----------------------------------------------------------------------------------------

    def _transferred(self, direction: str, code: grpc.StatusCode, started: float) -> None:
        """Count a finished transfer (``code``: what the caller is told)."""
        self._metrics.kv_transfers.labels(direction, code.name).inc()
        self._metrics.kv_transfer_seconds.labels(direction).observe(time.perf_counter() - started)


def _releasing(ticket: Ticket) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback that releases ``ticket``."""
    return lambda _: ticket.release()


def _releaser(manifest: KVManifest) -> Callable[[Engine], EngineStats]:
    def job(e: Engine) -> EngineStats:
        e.release_exported(manifest)
        return e.stats()

    return job


def message_batches(
    records: Sequence[tuple[int, int]], model: ModelFingerprint, limit: int
) -> list[Sequence[tuple[int, int]]]:
    """An export's records ((layer, logical block), or a grant's (plane, block)) cut into messages of at most
    ``limit`` bytes (at least one record each)."""
    return batches(records, max(1, limit // (record_bytes(model) + 64)))


def exporter(manifest: KVManifest, batch: Sequence[tuple[int, int]]) -> Callable[[Engine], tuple[bytes, int, int]]:
    """The engine job that reads one message's records and encodes them: (serialized KVChunk, blocks, K/V
    bytes), on the engine thread, leaving the event loop to gRPC. On the CPU the pages are copied once, straight
    into the message."""

    def job(e: Engine) -> tuple[bytes, int, int]:
        views = e.export_views(manifest, batch)
        return kvwire.encode_blocks(views), len(views), len(views) * record_bytes(manifest.model)

    return job


def _leaving_releaser(holder: list[Leaving]) -> Callable[[Engine], EngineStats]:
    """The engine job that releases a leaving grant, if the park made one; the pool after."""

    def job(e: Engine) -> EngineStats:
        if holder:
            e.release_grant(holder[0].grant)
        return e.stats()

    return job


def _grant_reader(grant: GrantState, batch: Sequence[tuple[int, int]]) -> Callable[[Engine], tuple[bytes, int, int]]:
    """The engine job that reads a leaving grant's records (plane, block) and encodes them: (serialized
    KVChunk, records, K/V bytes)."""

    def job(e: Engine) -> tuple[bytes, int, int]:
        views = e.grant_views(grant, batch)
        return kvwire.encode_blocks(views), len(views), sum(v.nbytes for v in views)

    return job


class Pushed(NamedTuple):
    """A grant sent to another server: what was parked here (and released), and the records and their bytes
    the target took."""

    parked: Handoff
    records: int
    network_bytes: int
