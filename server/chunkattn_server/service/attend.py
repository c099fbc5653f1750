"""The gRPC servicer: protobuf <-> domain objects, and nothing else.

Each RPC reads as parse -> run on the engine worker -> encode; ``rpc.py`` does the parsing, limits and
statuses around them. No tensor math here: the worker thread owns the engine. Errors become statuses
through ``errors.status_code`` alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError

from chunkattn_client import codec, dtypes, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import MAX_BATCH, MAX_ID_BYTES, bounded
from chunkattn_server import __version__, torchtypes
from chunkattn_server.config import ModelShape, ServerConfig
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.entries import Entries
from chunkattn_server.engine.scheduler import Scheduler
from chunkattn_server.engine.types import EngineStats
from chunkattn_server.errors import InvalidArgument, InvalidBatch, InvalidTensor, ShuttingDown
from chunkattn_server.metrics import Metrics
from chunkattn_server.service.auth import Authenticator, Tenant
from chunkattn_server.service.blocks import BlockArgs, BlockService, block_args
from chunkattn_server.service.kv import KVService
from chunkattn_server.service.rpc import DRAINING, SMALL_REQUEST_BYTES, Admission, Context, Rpcs, Stream
from chunkattn_server.service.status import status_code

T = TypeVar("T")


# A ReleaseRequest of MAX_BATCH ids of MAX_ID_BYTES, with room for their keys and lengths.
MAX_RELEASE_BYTES = MAX_BATCH * (MAX_ID_BYTES + 4) + 64


def tensor(name: str, dtype: int, shape: tuple[int, ...], data: wire.Buffer) -> torch.Tensor:
    """A torch view of a tensor's bytes (no copy). InvalidTensor when dtype, shape and byte count disagree."""
    try:
        # Through numpy: half the cost of torch.frombuffer + view, which adds up on decode-sized calls.
        arr = codec.view(dtype, shape, data)
        if not len(data):
            return torch.empty(shape, dtype=torchtypes.WIRE[dtype])
        t = torch.from_numpy(arr)
        return t.view(torch.bfloat16) if dtype == pb.DTYPE_BFLOAT16 else t
    except (codec.CodecError, RuntimeError, ValueError) as e:  # a shape torch (or numpy) cannot hold
        raise InvalidTensor(f"{name}: {e}") from None


def parse_attend_request(raw: bytes) -> tuple[pb.AttendRequest, dict[str, torch.Tensor]]:
    """The request's small fields (protobuf) and its tensors by name, through the client's and the server's
    one small/large path (``codec.parse_tensors``: a large request's tensors are not copied, and its fields
    are scanned in Python, bounded by MAX_BATCH: the caller runs it in a thread). InvalidArgument naming the
    field when it does not parse; InvalidBatch past MAX_BATCH entries."""
    try:
        request, raws = codec.parse_tensors(pb.AttendRequest, raw, _REQUEST_FIELDS, max_fields=MAX_BATCH + 8)
    except wire.TooManyFields:
        raise InvalidBatch(
            f"the request has more fields than a batch can: at most {MAX_BATCH} sequences per call"
        ) from None
    except (wire.WireError, DecodeError) as e:
        why = wire.explain(pb.AttendRequest.DESCRIPTOR, raw) or str(e)
        raise InvalidArgument(f"the request is not a valid chunkattn.v1.AttendRequest: {why}") from None
    except codec.CodecError as e:
        raise InvalidTensor(str(e)) from None
    if len(request.entries) > MAX_BATCH:
        raise InvalidBatch(f"the batch has {len(request.entries)} sequences; at most {MAX_BATCH} per call")
    tensors = {_REQUEST_TENSORS[field]: tensor(_REQUEST_TENSORS[field], *t) for field, t in raws.items()}
    return request, tensors


# AttendRequest's Tensor fields (q, k, v), by number: read from the descriptor, never written twice.
_REQUEST_TENSORS = {
    f.number: f.name for f in pb.AttendRequest.DESCRIPTOR.fields if f.message_type is pb.Tensor.DESCRIPTOR
}
_REQUEST_FIELDS = frozenset(_REQUEST_TENSORS)


class AttendArgs(NamedTuple):
    """An Attend request as the scheduler takes it (domain types only), checked where it was parsed: q
    present, k and v both or neither, the layer one of the model's, the entries valid (``Entries``); ending:
    the ids of the entries with ``end_of_sequence``, released after the call."""

    layer: int
    entries: Entries
    ending: frozenset[str]
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None


def read_attend_request(
    raw: bytes, model: ModelShape, tenant: str
) -> tuple[int, AttendArgs | BlockArgs | InvalidArgument]:
    """parse_attend_request, then the request as AttendArgs (BlockArgs for the block API): (its request_id,
    the call or the InvalidArgument it fails with). A request that parses keeps its id for its answer when its
    contents fail their checks; one that does not parse raises as parse_attend_request does. The checks run in
    the order the engine's would (tensors present, layer, entries), so a request wrong in several ways is told the
    same first thing wherever it is checked."""
    request, tensors = parse_attend_request(raw)
    try:
        return request.request_id, _attend_args(request, tensors, model, tenant)
    except InvalidArgument as e:
        return request.request_id, e


def _attend_args(
    request: pb.AttendRequest, tensors: dict[str, torch.Tensor], model: ModelShape, tenant: str
) -> AttendArgs | BlockArgs:
    if "q" not in tensors:
        raise InvalidTensor("q is missing; send q [tokens, num_heads, head_size]")
    q, k, v = tensors["q"], tensors.get("k"), tensors.get("v")
    if (k is None) != (v is None):
        raise InvalidTensor("send both k and v, or (for a KV-sharing layer) neither")
    if request.HasField("blocks"):
        return block_args(request, q, k, v, model, tenant)
    model.spec(request.layer)
    entries: list[BatchEntry] = []
    ending: list[str] = []
    for e in request.entries:  # one pass: a decode-sized call's few microseconds count
        seq_id = e.seq_id
        entries.append(BatchEntry(seq_id, e.position, e.num_tokens))
        if e.end_of_sequence:
            ending.append(seq_id)
    return AttendArgs(request.layer, Entries(entries), frozenset(ending), q, k, v)


class ChunkAttnService:
    """Info, Attend, AttendStream and Release over one engine worker (and the KV RPCs, from KVService).

    Attend and AttendStream answer with serialized AttendResponses (``wire``): protobuf's own serializer is
    slow on MiBs of tensor bytes.
    """

    def __init__(self, worker: Scheduler, metrics: Metrics, config: ServerConfig, auth: Authenticator) -> None:
        self._worker = worker
        self._metrics = metrics
        self._config = config
        self._auth = auth
        self._engine_info = _static_info(worker.engine, config.max_message_bytes)
        self._model = worker.engine.config.model
        self._calibrating = any(x.k_scale == 0 for x in self._engine_info.layers)
        self._rpcs = Rpcs(self._count, Admission(config.max_concurrent_rpcs, config.inflight_bytes), auth)
        self._kv = KVService(self._run, self._rpcs, self._observe_pool, metrics, worker.engine, config)
        self._blocks = BlockService(self._run, self._rpcs, self._observe_pool, metrics, config.idle_timeout_s)
        metrics.kv_blocks_total.set(worker.engine.stats().num_blocks)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the RPCs of chunkattn.v1.ChunkAttn (the KV ones live in kv_service.py)."""
        r = self._rpcs
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Info": r.unary("Info", self.Info, pb.InfoRequest, 1024, admit=False),
            "Attend": r.unary("Attend", self.Attend, None, self._config.max_message_bytes),
            "AttendStream": r.bidi_stream(
                "AttendStream", self.AttendStream, self._config.stream_idle_s, "--stream-idle-s"
            ),
            "Release": r.unary(
                "Release", self.Release, pb.ReleaseRequest, MAX_RELEASE_BYTES, max_fields=MAX_BATCH + 16
            ),
            **self._kv.handlers(),
            **self._blocks.handlers(),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("chunkattn.v1.ChunkAttn", handlers),))

    @property
    def spaces_opened(self) -> asyncio.Event:
        """Set whenever a block space opens (BlockService.opened)."""
        return self._blocks.opened

    def drain(self) -> None:
        """From now on, new calls are refused and open streams end before their next request (UNAVAILABLE)."""
        self._rpcs.draining = True

    def open_calls(self) -> int:
        """Calls open in the service now (idle streams included; health and reflection are not its)."""
        return sum(self._rpcs.open_calls.values())

    async def close(self) -> None:
        """Release what the service holds besides the engine (after the server stopped)."""
        self._rpcs.close()
        await self._kv.close()

    async def Info(self, request: pb.InfoRequest, context: Context, tenant: Tenant) -> pb.InfoResponse:  # noqa: N802
        """Never queued behind the engine's jobs: the pool as of the last one that finished. The pool's
        totals, and the caller's own sequences only."""
        stats = self._worker.stats
        self._observe_pool(stats)
        response = pb.InfoResponse()
        response.CopyFrom(self._engine_info)
        response.free_blocks = stats.free_blocks
        response.active_sequences = stats.sequences_by_tenant.get(tenant.name, 0)
        response.block_spaces = stats.spaces_by_tenant.get(tenant.name, 0)
        if self._calibrating:  # a float8 layer's scales are set by its first write: as of now
            for layer in response.layers:
                layer.k_scale, layer.v_scale = self._worker.engine.scales.of(layer.index) or (0.0, 0.0)
        return response

    async def Attend(self, raw: bytes, context: Context, tenant: Tenant) -> bytes:  # noqa: N802
        request_id, args = await self._parse(raw, tenant)
        return await self._attend("Attend", request_id, args, tenant)

    async def AttendStream(self, stream: Stream, context: Context, tenant: Tenant) -> None:  # noqa: N802
        """One answer per request, in order; a failed request is answered with its status and the stream
        goes on. Each request is admitted on its own; an idle stream holds nothing."""
        while (raw := await stream.read()) is not None:
            if self._rpcs.draining:
                raise ShuttingDown(DRAINING)
            request_id = 0  # stays 0 when the request cannot be read at all
            started = time.perf_counter()
            try:
                with self._rpcs.admission.admit(len(raw), tenant=tenant):
                    request_id, args = await self._parse(raw, tenant)
                    response = await self._attend("AttendStream", request_id, args, tenant)
            except Exception as e:
                code = status_code(e)
                response = wire.encode_attend_response(request_id, None, code.value[0], bounded(str(e)))
            else:
                code = grpc.StatusCode.OK
            self._count("AttendStream", code, time.perf_counter() - started, tenant)
            await stream.write(response)

    async def Release(self, request: pb.ReleaseRequest, context: Context, tenant: Tenant) -> pb.ReleaseResponse:  # noqa: N802
        ids, missing_ok, name = request.seq_ids, request.missing_ok, tenant.name
        released, stats = await self._run(
            "Release", lambda e: (e.kv.release(ids, missing_ok=missing_ok, tenant=name), e.stats())
        )
        self._metrics.released.inc(released)
        self._observe_pool(stats)
        return pb.ReleaseResponse(released=released)

    # -- helpers -------------------------------------------------------------------------------------

    async def _parse(self, raw: bytes, tenant: Tenant) -> tuple[int, AttendArgs | BlockArgs | InvalidArgument]:
        """read_attend_request, off the event loop for a large request."""
        if len(raw) <= SMALL_REQUEST_BYTES:
            return read_attend_request(raw, self._model, tenant.name)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._rpcs.parser, read_attend_request, raw, self._model, tenant.name)

    async def _attend(
        self, rpc: str, request_id: int, args: AttendArgs | BlockArgs | InvalidArgument, tenant: Tenant
    ) -> bytes:
        if isinstance(args, InvalidArgument):
            raise args
        a = args
        with self._metrics.in_flight.track_inprogress():
            if isinstance(a, BlockArgs):
                out = await self._worker.attend_blocks(rpc, a.layer, a.call)
            else:
                out = await self._worker.attend(
                    rpc, a.layer, a.entries, a.q, a.k, a.v, tenant=tenant.name, ending=a.ending
                )
        return wire.encode_attend_response(request_id, codec.to_raw(out))

    async def _run(self, rpc: str, fn: Callable[[Engine], T]) -> T:
        with self._metrics.in_flight.track_inprogress():
            return await self._worker.run(rpc, fn)

    def _observe_pool(self, stats: EngineStats) -> None:
        self._metrics.observe_pool(stats)

    def _count(self, rpc: str, code: grpc.StatusCode, seconds: float | None, tenant: Tenant | None) -> None:
        self._metrics.of(self._metrics.requests, rpc, code.name).inc()
        if seconds is not None:
            self._metrics.of(self._metrics.rpc_seconds, rpc).observe(seconds)
        if tenant is not None and self._auth.enabled:
            self._metrics.of(self._metrics.tenant_requests, tenant.name, rpc, code.name).inc()


def _static_info(engine: Engine, max_message_bytes: int) -> pb.InfoResponse:
    model = engine.config.model
    group_of = {layer: g.index for g in engine.groups for layer in (*g.layers, *g.sharers)}
    stats = engine.stats()
    scales = [engine.scales.of(i) or (0.0, 0.0) for i in range(model.num_layers)]
    return pb.InfoResponse(
        version=__version__,
        backend=engine.backend.name,
        device=str(engine.device),
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        layers=[
            pb.LayerInfo(
                index=i,
                chunk_size=spec.chunk_size,
                kv_group=group_of[i],
                kv_source=spec.kv_source,
                scale=engine.scale(i),
                alibi=spec.alibi_slopes is not None,
                alibi_slopes=spec.alibi_slopes or (),
                k_scale=k_scale,
                v_scale=v_scale,
            )
            for (i, spec), (k_scale, v_scale) in zip(enumerate(model.layers), scales, strict=True)
        ],
        block_size=stats.block_size,
        num_blocks=stats.num_blocks,
        bytes_per_block=stats.bytes_per_block,
        cache_dtype=torchtypes.OF_TORCH[engine.cache_dtype].wire,  # type: ignore[arg-type]
        compute_dtype=torchtypes.OF_TORCH[engine.dtype].wire,  # type: ignore[arg-type]
        dtypes=[d.wire for d in dtypes.WIRE],  # type: ignore[misc]
        max_message_bytes=max_message_bytes,
        max_call_work=engine.max_call_work,
        spec_window=engine.config.cache.spec_window,
        planes_per_block=engine.config.group_size,
    )


__all__ = ["AttendArgs", "ChunkAttnService", "parse_attend_request", "read_attend_request"]
