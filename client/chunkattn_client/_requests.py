"""The calls of both clients, written once: each builds its request and names how its response decodes
(``Call``); ``ChunkAttnClient`` and ``AsyncChunkAttnClient`` only send it, blocking or awaited.

Attend requests are serialized by ``wire.encode_attend_request`` and responses read by
``decode_attend_response`` (protobuf's own serializer and parser are slow on MiBs of tensor bytes).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from chunkattn_client import codec, wire
from chunkattn_client._errors import ChunkAttnError
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._types import BlockSpace, Copied, Grant, KVImport, KVTransfer, OpenSpace, ServerInfo, Truncated
from chunkattn_client.batch import BatchEntry, BlockRows

T = TypeVar("T")
Output = npt.NDArray[Any]
Entries = Sequence[BatchEntry]

ATTEND = "/chunkattn.v1.ChunkAttn/Attend"
ATTEND_STREAM = "/chunkattn.v1.ChunkAttn/AttendStream"


class AttendOptions(TypedDict, total=False):
    """The keyword arguments of every ``attend``: sequences to release after the call, and the dtype q/k/v
    travel in (see ``ChunkAttnClient.attend``)."""

    end_of_sequence: Sequence[str]
    dtype: str | None


class TransferOptions(TypedDict, total=False):
    """The keyword arguments of every ``transfer_kv`` (see ``ChunkAttnClient.transfer_kv``)."""

    new_seq_id: str
    release_after: bool
    layers: Sequence[int]
    target_token: str


@dataclass(frozen=True)
class Call(Generic[T]):
    """One call: the stub ("ChunkAttn", "Health", or "Raw": Attend, serialized by ``wire``) and method that
    take it, its request, and what its response becomes."""

    stub: str
    method: str
    request: Any
    decode: Callable[[Any], T]


def _same(response: Any) -> Any:
    return response


def info() -> Call[ServerInfo]:
    return Call("ChunkAttn", "Info", pb.InfoRequest(), ServerInfo.from_pb)


def health(service: str) -> Call[str]:
    def status(r: health_pb2.HealthCheckResponse) -> str:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    return Call("Health", "Check", health_pb2.HealthCheckRequest(service=service), status)


def open_data_plane() -> Call[pb.OpenDataPlaneResponse]:
    """A data-plane session (the response as it is: ``dataplane.choose`` reads it)."""
    return Call("ChunkAttn", "OpenDataPlane", pb.OpenDataPlaneRequest(), _same)


def attend(layer: int, entries: Entries, q: Any, k: Any, v: Any, **options: Any) -> Call[Output]:
    return Call("Raw", "Attend", attend_request(layer, entries, q, k, v, **options), decode_attend_response)


def release(seq_ids: Sequence[str], missing_ok: bool) -> Call[int]:
    return Call("ChunkAttn", "Release", pb.ReleaseRequest(seq_ids=list(seq_ids), missing_ok=missing_ok), _released)


def _released(r: pb.ReleaseResponse) -> int:
    return int(r.released)


def fork(parent: str, child: str) -> Call[int]:
    return Call("ChunkAttn", "Fork", pb.ForkRequest(parent=parent, child=child), _shared)


def _shared(r: pb.ForkResponse) -> int:
    return int(r.shared_blocks)


def truncate(seq_id: str, length: int) -> Call[Truncated]:
    return Call("ChunkAttn", "Truncate", pb.TruncateRequest(seq_id=seq_id, length=length), Truncated.from_pb)


def export_kv(seq_id: str, layers: Sequence[int], max_message_bytes: int) -> Call[Any]:
    """The call whose response is the stream of KVChunks."""
    request = pb.ExportKVRequest(seq_id=seq_id, layers=list(layers), max_message_bytes=max_message_bytes)
    return Call("ChunkAttn", "ExportKV", request, _same)


def import_kv(messages: Iterable[pb.KVChunk] | AsyncIterable[pb.KVChunk]) -> Call[KVImport]:
    """The call that sends ``messages`` (see ``renaming``)."""
    return Call("ChunkAttn", "ImportKV", messages, KVImport.from_pb)


def transfer_kv(seq_id: str, target: str, **options: Any) -> Call[KVTransfer]:
    """``options``: TransferOptions."""
    request = transfer_request(seq_id, target, **options)
    return Call("ChunkAttn", "TransferKV", request, KVTransfer.from_pb)


def transfer_request(
    seq_id: str,
    target: str,
    new_seq_id: str = "",
    release_after: bool = False,
    layers: Sequence[int] = (),
    target_token: str = "",
) -> pb.TransferKVRequest:
    return pb.TransferKVRequest(
        seq_id=seq_id,
        target=target,
        new_seq_id=new_seq_id,
        release_after=release_after,
        layers=list(layers),
        target_token=target_token,
    )


def renamed(message: pb.KVChunk, seq_id: str | None) -> pb.KVChunk:
    """The message, with its header's sequence id replaced when ``seq_id`` is given (import under a new id)."""
    if not seq_id or message.WhichOneof("part") != "header":
        return message
    copy = pb.KVChunk()
    copy.CopyFrom(message)
    copy.header.seq_id = seq_id
    return copy


def renaming(messages: Iterable[pb.KVChunk], seq_id: str | None) -> Iterator[pb.KVChunk]:
    return (renamed(c, seq_id) for c in messages)


async def renaming_async(messages: AsyncIterable[pb.KVChunk], seq_id: str | None) -> AsyncIterator[pb.KVChunk]:
    async for c in messages:
        yield renamed(c, seq_id)


def attend_request(
    layer: int,
    entries: Entries,
    q: Any,
    k: Any = None,
    v: Any = None,
    *,
    end_of_sequence: Sequence[str] = (),
    dtype: str | None = None,
    request_id: int = 0,
) -> bytes:
    """The serialized AttendRequest of one call (see ``ChunkAttnClient.attend``): written by hand where its
    values are plain (``wire.encode_entries``), else through protobuf; the same bytes either way."""
    ending = set(end_of_sequence)
    if ending:
        unknown = ending - {e.seq_id for e in entries}
        if unknown:
            raise ValueError(f"end_of_sequence names sequences not in the batch: {sorted(unknown)}")
    plain = [(e.seq_id, e.position, e.num_tokens, e.seq_id in ending) for e in entries]
    head = wire.encode_entries(layer, plain, request_id)
    if head is not None:
        return wire.encode_after(
            head,
            codec.to_raw_fast(q, dtype),
            None if k is None else codec.to_raw_fast(k, dtype),
            None if v is None else codec.to_raw_fast(v, dtype),
        )
    return wire.encode_attend_request(
        layer,
        [pb.SequenceEntry(seq_id=s, position=p, num_tokens=n, end_of_sequence=end) for s, p, n, end in plain],
        codec.to_raw(q, dtype),
        None if k is None else codec.to_raw(k, dtype),
        None if v is None else codec.to_raw(v, dtype),
        request_id,
    )


def attend_blocks_request(
    layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None, request_id: int = 0
) -> bytes:
    """The serialized AttendRequest of one block-addressed call (see ``ChunkAttnClient.attend_blocks``)."""
    table = np.asarray(rows.block_table)
    if table.ndim != 2:
        raise ValueError(f"block_table has shape {list(table.shape)}; expected [rows, width]")
    blocks = pb.BlockBatch(
        space_id=rows.space_id,
        slot_mapping=_little("slot_mapping", rows.slot_mapping, "<i8"),
        query_start_loc=_little("query_start_loc", rows.query_start_loc, "<i4"),
        seq_lens=_little("seq_lens", rows.seq_lens, "<i4"),
        block_table=_little("block_table", table, "<i4"),
        block_table_width=table.shape[1],
    )
    return wire.encode_attend_request(
        layer,
        [],
        codec.to_raw(q, dtype),
        None if k is None else codec.to_raw(k, dtype),
        None if v is None else codec.to_raw(v, dtype),
        request_id,
        blocks,
    )


def _little(name: str, values: Any, dtype: str) -> bytes:
    """Integers as little-endian bytes of ``dtype``; ValueError for non-integers or a value it cannot hold."""
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    info = np.iinfo(dtype)
    if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
        raise ValueError(f"{name} holds a value outside {np.dtype(dtype).name}'s range")
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def attend_blocks(layer: int, rows: BlockRows, q: Any, k: Any, v: Any, dtype: str | None) -> Call[Output]:
    request = attend_blocks_request(layer, rows, q, k, v, dtype=dtype)
    return Call("Raw", "Attend", request, decode_attend_response)


def open_block_space(num_blocks: int, layer_planes: Sequence[int], lease_s: float) -> Call[BlockSpace]:
    request = pb.OpenBlockSpaceRequest(num_blocks=num_blocks, layer_planes=list(layer_planes), lease_s=lease_s)
    return Call("ChunkAttn", "OpenBlockSpace", request, BlockSpace.from_pb)


def close_block_space(space_id: str) -> Call[int]:
    return Call("ChunkAttn", "CloseBlockSpace", pb.CloseBlockSpaceRequest(space_id=space_id), _pool_blocks)


def _pool_blocks(r: pb.CloseBlockSpaceResponse) -> int:
    return int(r.pool_blocks)


def renew_block_space(space_id: str) -> Call[float]:
    return Call("ChunkAttn", "RenewBlockSpace", pb.RenewBlockSpaceRequest(space_id=space_id), _lease)


def _lease(r: pb.RenewBlockSpaceResponse) -> float:
    return float(r.lease_s)


def list_block_spaces() -> Call[list[OpenSpace]]:
    return Call("ChunkAttn", "ListBlockSpaces", pb.ListBlockSpacesRequest(), _spaces)


def _spaces(r: pb.ListBlockSpacesResponse) -> list[OpenSpace]:
    return [OpenSpace.from_pb(s) for s in r.spaces]


def grant_blocks(
    space_id: str,
    block_ids: Sequence[int],
    grant_id: str,
    num_tokens: int,
    ttl_s: float,
    to_tenant: str,
    target: str = "",
    target_token: str = "",
    whole: bool = False,
    tag: str = "",
) -> Call[Grant]:
    request = pb.GrantBlocksRequest(
        space_id=space_id,
        block_ids=list(block_ids),
        grant_id=grant_id,
        num_tokens=num_tokens,
        ttl_s=ttl_s,
        to_tenant=to_tenant,
        target=target,
        target_token=target_token,
        whole=whole,
        tag=tag,
    )
    return Call("ChunkAttn", "GrantBlocks", request, Grant.from_pb)


def copy_blocks(
    dest_space_id: str,
    dest_block_ids: Sequence[int],
    *,
    space_id: str | None,
    grant_id: str | None,
    source_block_ids: Sequence[int],
    expect_tag: str = "",
) -> Call[Copied]:
    if (space_id is None) == (grant_id is None):
        raise ValueError("copy_blocks takes one source: space_id= (one of your spaces) or grant_id= (a grant)")
    request = pb.CopyBlocksRequest(
        source_block_ids=list(source_block_ids),
        dest_space_id=dest_space_id,
        dest_block_ids=list(dest_block_ids),
        expect_tag=expect_tag,
    )
    if space_id is not None:
        request.space_id = space_id
    else:
        request.grant_id = grant_id or ""
    return Call("ChunkAttn", "CopyBlocks", request, Copied.from_pb)


def decode_attend_response(raw: bytes, request_id: int | None = None) -> Output:
    """The output of a serialized AttendResponse (a view of its bytes when large), or its failure as
    ChunkAttnError.

    With ``request_id`` (streams), a response to another request is an error in itself, checked first.
    """
    known = decode_known(raw, request_id)
    if known is not None:
        return known
    try:
        response, tensors = codec.parse_tensors(pb.AttendResponse, raw, _RESPONSE_TENSORS)
    except (wire.WireError, DecodeError) as e:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, f"the server's response does not parse: {e}") from None
    except codec.CodecError as e:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, f"the server's output does not decode: {e}") from None
    unparsed_request = response.status.code and response.request_id == 0  # the server could not read its id
    if request_id is not None and response.request_id != request_id and not unparsed_request:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, f"response {response.request_id} answers request {request_id}")
    if response.status.code:
        raise ChunkAttnError.from_status(response.status.code, response.status.message)
    if _OUTPUT not in tensors:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, "the server's response has no output")
    try:
        output = codec.view(*tensors[_OUTPUT])
    except codec.CodecError as e:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, f"the server's output does not decode: {e}") from None
    _learn(tensors[_OUTPUT].dtype, output)
    return output


_OUTPUT = wire.field_number(pb.AttendResponse, "output")
_RESPONSE_TENSORS = frozenset({_OUTPUT})
_REQUEST_ID_TAG = bytes((wire.field_number(pb.AttendResponse, "request_id") << 3,))  # its key: a varint field

# The output forms met so far, by the bytes an answer's output field takes (its header and data): the header
# as the server writes it (``wire.tensor_prefix``), and the dtype and shape it stands for. An answer that is a
# request id and one of these, byte for byte, and nothing else, is read without parsing (``decode_known``).
_KNOWN: dict[int, tuple[bytes, np.dtype[Any], tuple[int, ...]]] = {}
_MAX_KNOWN = 64


def _learn(dtype: int, output: Output) -> None:
    """Remember a successful answer's output form (not an empty one: no view of zero bytes is made)."""
    if not output.nbytes:
        return
    prefix = wire.tensor_prefix(_OUTPUT, dtype, output.shape, output.nbytes)
    if len(_KNOWN) >= _MAX_KNOWN:
        _KNOWN.clear()
    _KNOWN[len(prefix) + output.nbytes] = (prefix, output.dtype, output.shape)


def decode_known(raw: bytes, request_id: int | None) -> Output | None:
    """``decode_attend_response``'s output for an answer of a known form (see ``_KNOWN``), as a read-only view of
    ``raw``; None for any other answer (a status, another request's id, an unknown shape, anything malformed),
    which the full decoder reads and checks."""
    start = 0
    if request_id:
        tag = _REQUEST_ID_TAG + wire.varint(request_id)
        if not raw.startswith(tag):
            return None
        start = len(tag)
    elif request_id is None and raw[:1] == _REQUEST_ID_TAG:
        return None  # (the id is not checked: the full decoder reads it)
    known = _KNOWN.get(len(raw) - start)
    if known is None or not raw.startswith(known[0], start):
        return None
    prefix, dtype, shape = known
    array: Output = np.frombuffer(raw, dtype, offset=start + len(prefix)).reshape(shape)
    return array
