"""Fast wire encoding and decoding of the two big messages, AttendRequest and AttendResponse.

protobuf's Python runtime is slow on MiBs of tensor bytes: serializing a 16 MiB AttendRequest took about
58 ms on the dev machines, and parsing one in the server about 40 ms, against about 4 ms for a gRPC round
trip's worth of copying. So the tensors' bytes bypass it: ``encode_*`` write the wire format with the small
fields through protobuf and each tensor's bytes joined in once; ``split`` takes a received message apart
so the small fields parse through protobuf and each tensor's data stays a view of the received bytes.
The bytes are plain protobuf either way (tests/test_wire.py checks both directions against protobuf).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb

Buffer = bytes | memoryview


class RawTensor(NamedTuple):
    """A tensor ready for the wire: its wire dtype, its shape and its little-endian C-order bytes."""

    dtype: int
    shape: tuple[int, ...]
    data: Buffer


def identity(b: bytes) -> bytes:
    """The (de)serializer of messages this module encodes or ``split`` decodes: bytes pass through."""
    return b


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if not n:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _tensor(field: int, t: RawTensor) -> list[Buffer]:
    """Wire parts of a Tensor submessage in `field`: dtype and shape via protobuf, then the data field (3)."""
    head = pb.Tensor(dtype=t.dtype, shape=t.shape).SerializeToString()  # type: ignore[arg-type]
    size = len(t.data)
    data_key = _varint(size)
    body = len(head) + 1 + len(data_key) + size
    return [_varint(field << 3 | 2), _varint(body), head, b"\x1a", data_key, t.data]


def encode_attend_request(
    layer: int,
    entries: Sequence[pb.SequenceEntry],
    q: RawTensor,
    k: RawTensor | None,
    v: RawTensor | None,
    request_id: int = 0,
) -> bytes:
    """A serialized AttendRequest; each tensor's bytes are copied once."""
    parts: list[Buffer] = [pb.AttendRequest(layer=layer, entries=entries, request_id=request_id).SerializeToString()]
    for field, t in ((3, q), (4, k), (5, v)):
        if t is not None:
            parts += _tensor(field, t)
    return b"".join(parts)


def encode_attend_response(request_id: int, output: RawTensor | None, code: int = 0, message: str = "") -> bytes:
    """A serialized AttendResponse: the output (when the call succeeded) or a status (code != 0)."""
    status = pb.Status(code=code, message=message) if code else None
    parts: list[Buffer] = [pb.AttendResponse(request_id=request_id, status=status).SerializeToString()]
    if output is not None:
        parts += _tensor(1, output)
    return b"".join(parts)


# -- KV transfer: KVChunk messages of blocks, built and read without copying the K/V bytes -------------------

KVRecord = tuple[int, int, int, Buffer, Buffer]  # (layer, logical block, checksum, k bytes, v bytes)
# The same with K and V each given as pieces whose concatenation is its bytes (e.g. one per head).
KVPieces = tuple[int, int, int, Sequence[Buffer], Sequence[Buffer]]


def encode_kv_blocks(records: Sequence[KVPieces]) -> bytes:
    """A serialized KVChunk{blocks: KVBlocks{blocks: [KVBlock...]}}, fields in protobuf's order; the K/V
    pieces are copied once, into the message."""
    parts: list[Buffer] = []
    for layer, logical, checksum, k, v in records:
        head = b"".join([b"\x08", _varint(layer), b"\x10", _varint(logical)])
        k_size, v_size = sum(len(p) for p in k), sum(len(p) for p in v)
        k_key, v_key = _varint(k_size), _varint(v_size)
        size = len(head) + 1 + len(k_key) + k_size + 1 + len(v_key) + v_size + 9
        parts += [b"\x0a", _varint(size), head, b"\x22", k_key, *k, b"\x2a", v_key, *v]
        parts.append(b"\x31" + checksum.to_bytes(8, "little"))
    body_size = sum(len(p) for p in parts)
    return b"".join([b"\x12", _varint(body_size), *parts])


def decode_kv_chunk(data: bytes) -> tuple[str, memoryview | list[KVRecord]]:
    """A serialized KVChunk: ("blocks", its records, the K/V as views of ``data``), or ("header" or
    "trailer", the submessage's bytes), or ("", empty) for a message with none. WireError when malformed."""
    buf = memoryview(data)
    found: tuple[str, memoryview | list[KVRecord]] = ("", memoryview(b""))
    for field, kind, start, end in _fields(buf):
        if kind != 2 or field not in (1, 2, 3):
            continue
        body = _payload(buf, start, end)
        if field == 2:
            found = ("blocks", [_kv_record(_payload(body, s, e)) for f, k, s, e in _fields(body) if f == 1 and k == 2])
        else:
            found = ("header" if field == 1 else "trailer", body)
    return found


def _kv_record(body: memoryview) -> KVRecord:
    """One KVBlock's fields."""
    layer = logical = checksum = 0
    k = v = memoryview(b"")
    for f, kind, s, e in _fields(body):
        _, value_at = _read_varint(body, s)
        if f == 1 and kind == 0:
            layer = _read_varint(body, value_at)[0]
        elif f == 2 and kind == 0:
            logical = _read_varint(body, value_at)[0]
        elif f == 6 and kind == 1:
            checksum = int.from_bytes(body[value_at : value_at + 8], "little")
        elif f == 3:
            raise WireError(
                "a KV block in the older format (a CRC-32 in field 3) where XXH3-64 checksums (field 6) are read:"
                " export it again with this version"
            )
        elif f in (4, 5) and kind == 2:
            if f == 4:
                k = _payload(body, s, e)
            else:
                v = _payload(body, s, e)
    return layer, logical, checksum, k, v


class WireError(ValueError):
    """Bytes that are not a valid message of the expected kind."""


class Split(NamedTuple):
    """A message with its tensors' bytes taken out: ``rest`` parses as the message without tensor data,
    ``tensors`` maps field number -> (the Tensor's other fields, serialized; a view of its data bytes)."""

    rest: bytes
    tensors: dict[int, tuple[bytes, memoryview]]


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _payload(buf: memoryview, start: int, end: int) -> memoryview:
    """The bytes of the length-delimited field at [start, end) of ``buf`` (after its key and length)."""
    _, at = _read_varint(buf, _read_varint(buf, start)[1])
    return buf[at:end]


def _fields(buf: memoryview) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start of the field's key, end of the field) for each top-level field."""
    out = []
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        field, kind = key >> 3, key & 7
        if kind == 0:
            _, pos = _read_varint(buf, pos)
        elif kind == 1:
            pos += 8
        elif kind == 2:
            size, pos = _read_varint(buf, pos)
            pos += size
        elif kind == 5:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {kind} in field {field}")
        if pos > len(buf) or field == 0:
            raise WireError("truncated message")
        out.append((field, kind, start, pos))
    return out


def split(data: bytes, tensor_fields: frozenset[int]) -> Split:
    """Take the Tensor submessages in ``tensor_fields`` apart without copying their data (see ``Split``).

    A tensor field that appears more than once is refused (protobuf would merge the copies; no client
    of ours sends that).
    """
    buf = memoryview(data)
    rest: list[memoryview] = []
    tensors: dict[int, tuple[bytes, memoryview]] = {}
    for field, kind, start, end in _fields(buf):
        if field not in tensor_fields or kind != 2:
            rest.append(buf[start:end])
            continue
        if field in tensors:
            raise WireError(f"tensor field {field} appears more than once")
        body = _payload(buf, start, end)
        header: list[memoryview] = []
        payload = memoryview(b"")
        for f, k, s, e in _fields(body):
            if f == 3 and k == 2:  # Tensor.data: keep a view of the bytes, no copy
                payload = _payload(body, s, e)
            else:
                header.append(body[s:e])
        tensors[field] = (b"".join(header), payload)
    return Split(b"".join(rest), tensors)
