"""Attend and AttendStream: an AttendRequest read into domain types (AttendArgs, or the block API's BlockArgs),
queued on the scheduler, its output encoded; nothing else.

``rpc.py`` does the limits, statuses and counting around them, and parses through ``ATTEND`` (Parse): a large
request's tensors are views of the received bytes, parsed in a thread. No tensor math here: the engine
thread owns the engine.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import grpc
import torch
from google.protobuf.message import DecodeError

from chunkattn_client import codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import MAX_BATCH
from chunkattn_server import torchtypes
from chunkattn_server.config import ModelShape
from chunkattn_server.engine.entries import Entries
from chunkattn_server.engine.scheduler import Scheduler
from chunkattn_server.errors import InvalidArgument, InvalidBatch, InvalidTensor
from chunkattn_server.service.auth import Tenant
from chunkattn_server.service.blocks import BlockArgs, block_args
from chunkattn_server.service.edge import Edge
from chunkattn_server.service.rpc import Context, Parse

# The most fields an AttendRequest can have: its entries, and its other fields (layer, q, k, v, request_id and
# blocks), with room to spare.
MAX_ATTEND_FIELDS = MAX_BATCH + 8


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
        request, raws = codec.parse_tensors(pb.AttendRequest, raw, _REQUEST_FIELDS, max_fields=MAX_ATTEND_FIELDS)
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

    async def submit(self, scheduler: Scheduler, rpc: str, tenant: str) -> torch.Tensor:
        """The call's output (Scheduler.attend)."""
        return await scheduler.attend(
            rpc, self.layer, self.entries, self.q, self.k, self.v, tenant=tenant, ending=self.ending
        )


class AttendRead(NamedTuple):
    """An AttendRequest as read: its request_id, and the call (AttendArgs; BlockArgs for the block API) or the
    InvalidArgument it fails with."""

    request_id: int
    call: AttendArgs | BlockArgs | InvalidArgument


def read_attend_request(raw: bytes, model: ModelShape, tenant: str) -> AttendRead:
    """parse_attend_request, then the request as AttendArgs (BlockArgs for the block API): (its request_id,
    the call or the InvalidArgument it fails with). A request that parses keeps its id for its answer when its
    contents fail their checks; one that does not parse raises as parse_attend_request does. The checks run in
    the order the engine's would (tensors present, layer, entries), so a request wrong in several ways is told the
    same first thing wherever it is checked."""
    request, tensors = parse_attend_request(raw)
    try:
        return AttendRead(request.request_id, _attend_args(request, tensors, model, tenant))
    except InvalidArgument as e:
        return AttendRead(request.request_id, e)


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


class AttendService:
    """Attend and AttendStream over ``edge``. They answer with serialized AttendResponses (``wire``):
    protobuf's own serializer is slow on MiBs of tensor bytes."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        model = edge.scheduler.engine.config.model
        # Any request up to the server's message limit (gRPC refuses longer ones before they get here).
        self._parse = Parse(
            pb.AttendRequest.DESCRIPTOR.full_name,
            edge.config.max_message_bytes,
            lambda raw, tenant: read_attend_request(raw, model, tenant),
        )

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        r, c = self._edge.rpcs, self._edge.config
        return {
            "Attend": r.unary("Attend", self.Attend, self._parse),
            "AttendStream": r.answers(
                "AttendStream", self.AttendStream, self._parse, _failed, c.stream_idle_s, "--stream-idle-s"
            ),
        }

    async def Attend(self, request: AttendRead, context: Context, tenant: Tenant) -> bytes:  # noqa: N802
        return await self._answer("Attend", request, tenant)

    async def AttendStream(self, request: AttendRead, context: Context, tenant: Tenant) -> bytes:  # noqa: N802
        """One request of the stream (rpc.answers: one answer per request, in order; a failed request is
        answered with its status, ``_failed``, and the stream goes on)."""
        return await self._answer("AttendStream", request, tenant)

    async def data_plane_answer(self, raw: bytes | memoryview, tenant: Tenant, started: float) -> bytes:
        """A data-plane message (service/dataplane.py), served as one AttendStream message is (rpc.Rpcs.answer) and
        counted as rpc Attend over transport zmq from ``started``: its serialized AttendResponse, a failure's
        status in it. ``raw``: a large request's memoryview is read in place, as bytes are."""
        return await self._edge.rpcs.answer(
            "Attend", cast(bytes, raw), tenant, self._parse, self._data_plane, _failed, transport="zmq", started=started
        )

    async def _data_plane(self, request: AttendRead, tenant: Tenant) -> bytes:
        return await self._answer("Attend", request, tenant)

    async def _answer(self, rpc: str, request: AttendRead, tenant: Tenant) -> bytes:
        """The request's serialized AttendResponse: its call queued on the scheduler, its output encoded."""
        call = request.call
        if isinstance(call, InvalidArgument):
            raise call
        with self._edge.metrics.in_flight.track_inprogress():
            out = await call.submit(self._edge.scheduler, rpc, tenant.name)
        return wire.encode_attend_response(request.request_id, codec.to_raw(out))


def _failed(request: AttendRead | None, code: grpc.StatusCode, message: str) -> bytes:
    """An AttendStream request's answer when it failed: its status (its request_id, 0 if it did not parse)."""
    return wire.encode_attend_response(0 if request is None else request.request_id, None, code.value[0], message)


__all__ = ["AttendArgs", "AttendRead", "AttendService", "parse_attend_request", "read_attend_request"]
