"""The gRPC servicer: protobuf <-> domain objects, and nothing else.

Each RPC reads as decode -> run on the engine worker -> encode. No tensor math here: the worker thread
owns the engine. Errors become statuses through ``errors.status_code`` alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError

from chunkattn_client import codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.batch import BatchEntry
from chunkattn_server import __version__
from chunkattn_server.engine import DTYPES, Engine, EngineStats
from chunkattn_server.errors import InvalidArgument, InvalidTensor, status_code
from chunkattn_server.kv_service import DEFAULT_IMPORT_STALL_S, DEFAULT_TRANSFER_KEEPALIVE_S, KVService
from chunkattn_server.metrics import Metrics
from chunkattn_server.worker import EngineWorker

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]


_TORCH: dict[int, torch.dtype] = {wire_dtype: DTYPES[name] for name, wire_dtype in codec.WIRE_DTYPES.items()}
_WIRE = {DTYPES[name]: wire_dtype for name, wire_dtype in codec.WIRE_DTYPES.items()}


def tensor_from_parts(name: str, header: bytes, data: wire.Buffer) -> torch.Tensor:
    """A torch view of a tensor taken apart by ``wire.split`` (no copy). InvalidTensor when dtype, shape and
    byte count disagree."""
    try:
        dtype, shape = codec.read_header(header, len(data))
        if not len(data):
            return torch.empty(shape, dtype=_TORCH[dtype])
        return torch.frombuffer(data, dtype=_TORCH[dtype]).view(shape)
    except (codec.CodecError, RuntimeError) as e:  # RuntimeError: a shape torch cannot hold
        raise InvalidTensor(f"{name}: {e}") from None


def parse_attend_request(raw: bytes) -> tuple[pb.AttendRequest, dict[str, torch.Tensor]]:
    """The request's small fields (protobuf) and its tensors (views of ``raw``) by name."""
    try:
        parts = wire.split(raw, _REQUEST_FIELDS)
        request = pb.AttendRequest.FromString(parts.rest)
    except (wire.WireError, DecodeError) as e:
        raise InvalidArgument(f"the request is not a valid chunkattn.v1.AttendRequest: {e}") from None
    tensors = {
        name: tensor_from_parts(name, *parts.tensors[f]) for f, name in _REQUEST_TENSORS.items() if f in parts.tensors
    }
    return request, tensors


_REQUEST_TENSORS = {3: "q", 4: "k", 5: "v"}  # AttendRequest's Tensor fields
_REQUEST_FIELDS = frozenset(_REQUEST_TENSORS)


class ChunkAttnService:
    """Info, Attend, AttendStream and Release over one engine worker (and the KV RPCs, from KVService).

    Attend and AttendStream answer with serialized AttendResponses (``wire``), which ``add_to_server``
    registers with an identity serializer: protobuf's own serializer is slow on MiBs of tensor bytes.
    """

    def __init__(
        self,
        worker: EngineWorker,
        metrics: Metrics,
        *,
        max_message_bytes: int,
        import_stall_s: float = DEFAULT_IMPORT_STALL_S,
        transfer_keepalive_s: float = DEFAULT_TRANSFER_KEEPALIVE_S,
    ) -> None:
        self._worker = worker
        self._metrics = metrics
        self._engine_info = _static_info(worker.engine, max_message_bytes)
        self._draining = False
        self._kv = KVService(
            self._run,
            self._count,
            self._observe_pool,
            metrics,
            max_message_bytes=max_message_bytes,
            import_stall_s=import_stall_s,
            transfer_keepalive_s=transfer_keepalive_s,
        )
        metrics.kv_blocks_total.set(worker.engine.stats().num_blocks)

    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.InfoResponse:  # noqa: N802
        stats = await self._run("Info", lambda e: e.stats())
        self._observe_pool(stats)
        response = pb.InfoResponse()
        response.CopyFrom(self._engine_info)
        response.free_blocks = stats.free_blocks
        response.active_sequences = stats.num_sequences
        self._count("Info", grpc.StatusCode.OK)
        return response

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the RPCs of chunkattn.v1.ChunkAttn (the KV ones live in kv_service.py)."""
        # Attend messages bypass protobuf for their tensor bytes (see chunkattn_client.wire).
        request, response = wire.identity, wire.identity
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Info": grpc.unary_unary_rpc_method_handler(
                self.Info, request_deserializer=pb.InfoRequest.FromString, response_serializer=_serialize
            ),
            "Attend": grpc.unary_unary_rpc_method_handler(
                self.Attend, request_deserializer=request, response_serializer=response
            ),
            "AttendStream": grpc.stream_stream_rpc_method_handler(
                self.AttendStream, request_deserializer=request, response_serializer=response
            ),
            "Release": grpc.unary_unary_rpc_method_handler(
                self.Release, request_deserializer=pb.ReleaseRequest.FromString, response_serializer=_serialize
            ),
            **self._kv.handlers(),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("chunkattn.v1.ChunkAttn", handlers),))

    def drain(self) -> None:
        """From now on, open streams end (UNAVAILABLE) before their next request."""
        self._draining = True

    async def close(self) -> None:
        """Release what the service holds besides the engine (after the server stopped)."""
        await self._kv.close()

    async def Attend(self, request: bytes, context: Context) -> bytes:  # noqa: N802
        try:
            response = await self._attend(*parse_attend_request(request))
        except Exception as e:  # every failure becomes a status; nothing has changed on the engine
            code = status_code(e)
            self._count("Attend", code)
            await context.abort(code, str(e))
        self._count("Attend", grpc.StatusCode.OK)
        return response

    async def AttendStream(  # noqa: N802
        self, request_iterator: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[bytes]:
        async for raw in request_iterator:
            if self._draining:
                self._count("AttendStream", grpc.StatusCode.UNAVAILABLE)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; reconnect elsewhere")
            request_id = 0  # stays 0 when the request cannot be read at all
            try:
                request, tensors = parse_attend_request(raw)
                request_id = request.request_id
                response = await self._attend(request, tensors)
            except Exception as e:
                code = status_code(e)
                self._count("AttendStream", code)
                yield wire.encode_attend_response(request_id, None, code.value[0], str(e))
                continue
            self._count("AttendStream", grpc.StatusCode.OK)
            yield response

    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:  # noqa: N802
        ids = list(request.seq_ids)
        try:
            released, stats = await self._run(
                "Release", lambda e: (e.release(ids, missing_ok=request.missing_ok), e.stats())
            )
        except Exception as e:
            code = status_code(e)
            self._count("Release", code)
            await context.abort(code, str(e))
        self._metrics.released.inc(released)
        self._observe_pool(stats)
        self._count("Release", grpc.StatusCode.OK)
        return pb.ReleaseResponse(released=released)

    # -- helpers -------------------------------------------------------------------------------------

    async def _attend(self, request: pb.AttendRequest, tensors: dict[str, torch.Tensor]) -> bytes:
        entries = [BatchEntry(e.seq_id, e.position, e.num_tokens) for e in request.entries]
        ending = [e.seq_id for e in request.entries if e.end_of_sequence]
        if "q" not in tensors:
            raise InvalidTensor("q is missing; send q [tokens, num_heads, head_size]")
        q, k, v = tensors["q"], tensors.get("k"), tensors.get("v")
        if (k is None) != (v is None):
            raise InvalidTensor("send both k and v, or (for a KV-sharing layer) neither")
        layer = request.layer

        def job(engine: Engine) -> tuple[wire.RawTensor, EngineStats]:
            out = engine.attend(layer, entries, q, k, v)
            if ending:
                engine.release(ending)
            return codec.to_raw(out), engine.stats()  # to host memory here, on the engine's thread

        output, stats = await self._run("Attend", job)
        m = self._metrics
        m.bytes_received.inc(sum(t.numel() * t.element_size() for t in (q, k, v) if t is not None))
        m.bytes_sent.inc(len(output.data))
        decode = sum(1 for e in entries if e.num_tokens == 1)
        m.tokens.labels("decode").inc(decode)
        m.tokens.labels("prefill").inc(sum(e.num_tokens for e in entries if e.num_tokens > 1))
        m.released.inc(len(ending))
        self._observe_pool(stats)
        return wire.encode_attend_response(request.request_id, output)

    async def _run(self, rpc: str, fn: Callable[[Engine], T]) -> T:
        def observe(queue_s: float, compute_s: float) -> None:
            self._metrics.queue_seconds.labels(rpc).observe(queue_s)
            self._metrics.compute_seconds.labels(rpc).observe(compute_s)

        with self._metrics.in_flight.track_inprogress():
            return await self._worker.run(fn, observe)

    def _observe_pool(self, stats: EngineStats) -> None:
        self._metrics.observe_pool(stats)

    def _count(self, rpc: str, code: grpc.StatusCode) -> None:
        self._metrics.requests.labels(rpc, code.name).inc()


def _static_info(engine: Engine, max_message_bytes: int) -> pb.InfoResponse:
    model = engine.config.model
    group_of = {layer: g.index for g in engine.groups for layer in (*g.layers, *g.sharers)}
    stats = engine.stats()
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
            )
            for i, spec in enumerate(model.layers)
        ],
        block_size=stats.block_size,
        num_blocks=stats.num_blocks,
        bytes_per_block=stats.bytes_per_block,
        cache_dtype=_WIRE[engine.dtype],
        dtypes=[_WIRE[d] for d in DTYPES.values()],
        max_message_bytes=max_message_bytes,
    )


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


__all__ = ["ChunkAttnService", "parse_attend_request"]
