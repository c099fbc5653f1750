"""Fast wire encoding and decoding of the two big messages, AttendRequest and AttendResponse.

protobuf's Python runtime is slow on MiBs of tensor bytes: serializing or parsing a 16 MiB AttendRequest
costs ten times a gRPC round trip's worth of copying (docs/results.md). So the tensors' bytes bypass it:
``encode_*`` write the wire format with the small fields through protobuf and each tensor's bytes joined in
once; ``split`` takes a received message apart so the small fields parse through protobuf and each
tensor's data stays a view of the received bytes.
The bytes are plain protobuf either way (tests/client/test_wire.py checks both directions against protobuf).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from google.protobuf.descriptor import FieldDescriptor

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
    """``n`` (0 <= n < 2^64) as a protobuf varint; ValueError otherwise (a negative n would never end)."""
    if not 0 <= n < 1 << 64:
        raise ValueError(f"a varint holds 0 .. 2^64 - 1, not {n}")
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if not n:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5  # wire types


def field_number(message: Any, field: str) -> int:
    """A field's number, from the generated descriptor (never written twice)."""
    return int(message.DESCRIPTOR.fields_by_name[field].number)


def _key(message: Any, field: str, wire_type: int) -> bytes:
    """A field's key (number << 3 | wire type) as it is written."""
    return _varint(field_number(message, field) << 3 | wire_type)


_Q, _K, _V = (field_number(pb.AttendRequest, f) for f in ("q", "k", "v"))
_OUTPUT = field_number(pb.AttendResponse, "output")
_TENSOR_DATA = field_number(pb.Tensor, "data")
_TENSOR_DATA_KEY = _key(pb.Tensor, "data", _LEN)
_HEADER, _BLOCKS, _TRAILER, _GRANT = (field_number(pb.KVChunk, f) for f in ("header", "blocks", "trailer", "grant"))
_PARTS = {_HEADER: "header", _TRAILER: "trailer", _GRANT: "grant"}
_BLOCKS_KEY = _key(pb.KVChunk, "blocks", _LEN)
_BLOCK = field_number(pb.KVBlocks, "blocks")
_BLOCK_KEY = _key(pb.KVBlocks, "blocks", _LEN)
_LAYER, _LOGICAL = field_number(pb.KVBlock, "layer"), field_number(pb.KVBlock, "logical")
_LAYER_KEY, _LOGICAL_KEY = _key(pb.KVBlock, "layer", _VARINT), _key(pb.KVBlock, "logical", _VARINT)
_BLOCK_K, _BLOCK_V, _CHECKSUM = (field_number(pb.KVBlock, f) for f in ("k", "v", "checksum"))
_BLOCK_K_KEY, _BLOCK_V_KEY = _key(pb.KVBlock, "k", _LEN), _key(pb.KVBlock, "v", _LEN)
_CHECKSUM_KEY = _key(pb.KVBlock, "checksum", _I64)
_OLD_CRC32 = 3  # KVBlock's field 3, reserved: a CRC-32 in exports of older versions


def _tensor(field: int, t: RawTensor) -> list[Buffer]:
    """Wire parts of a Tensor submessage in `field`: everything before the data, then the data."""
    return [_cached_prefix((field, t.dtype, t.shape, len(t.data))), t.data]


def tensor_prefix(field: int, dtype: int, shape: tuple[int, ...], size: int) -> bytes:
    """What a Tensor submessage in ``field`` (its dtype, shape and ``size`` bytes of data) is written as before
    its data, as ``encode_*`` write it (made once per shape)."""
    return _cached_prefix((field, dtype, shape, size))


def _cached_prefix(key: tuple[int, int, tuple[int, ...], int]) -> bytes:
    prefix = _PREFIXES.get(key)
    if prefix is None:
        prefix = _tensor_prefix(*key)
        if len(_PREFIXES) >= _MAX_PREFIXES:
            _PREFIXES.clear()
        _PREFIXES[key] = prefix
    return prefix


def _tensor_prefix(field: int, dtype: int, shape: tuple[int, ...], size: int) -> bytes:
    """The field's key and length, dtype and shape via protobuf, and the data field's key and length."""
    head = pb.Tensor(dtype=dtype, shape=shape).SerializeToString()  # type: ignore[arg-type]
    data_key = _varint(size)
    body = len(head) + len(_TENSOR_DATA_KEY) + len(data_key) + size
    return b"".join([_varint(field << 3 | _LEN), _varint(body), head, _TENSOR_DATA_KEY, data_key])


# A decoding model runner sends the same shapes call after call: their prefixes are made once (~5 us each).
_PREFIXES: dict[tuple[int, int, tuple[int, ...], int], bytes] = {}
_MAX_PREFIXES = 1024


def encode_attend_request(
    layer: int,
    entries: Sequence[pb.SequenceEntry],
    q: RawTensor,
    k: RawTensor | None,
    v: RawTensor | None,
    request_id: int = 0,
    blocks: pb.BlockBatch | None = None,
) -> bytes:
    """A serialized AttendRequest (sequence-addressed by ``entries``, or block-addressed by ``blocks``); each
    tensor's bytes are copied once."""
    small = pb.AttendRequest(layer=layer, entries=entries, request_id=request_id, blocks=blocks)
    parts: list[Buffer] = [small.SerializeToString()]
    for field, t in ((_Q, q), (_K, k), (_V, v)):
        if t is not None:
            parts += _tensor(field, t)
    return b"".join(parts)


# One-byte varints, made once: a decode call's small numbers (a layer, a token count) are most of them.
_BYTE_VARINTS = [bytes((n,)) for n in range(0x80)]
_INT32, _INT64, _UINT64 = 1 << 31, 1 << 63, 1 << 64
_LAYER_FIELD_KEY = _key(pb.AttendRequest, "layer", _VARINT)
_ENTRY_KEY = _key(pb.AttendRequest, "entries", _LEN)
_REQUEST_ID_KEY = _key(pb.AttendRequest, "request_id", _VARINT)
_SEQ_ID_KEY = _key(pb.SequenceEntry, "seq_id", _LEN)
_POSITION_KEY = _key(pb.SequenceEntry, "position", _VARINT)
_NUM_TOKENS_KEY = _key(pb.SequenceEntry, "num_tokens", _VARINT)
_END_OF_SEQUENCE = _key(pb.SequenceEntry, "end_of_sequence", _VARINT) + b"\x01"


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint."""
    if n < 0x80:
        return _BYTE_VARINTS[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    return _varint(n)


_uvarint = varint


def encode_entries(layer: int, entries: Sequence[tuple[str, int, int, bool]], request_id: int = 0) -> bytes | None:
    """The first fields of ``encode_attend_request``'s bytes for a sequence-addressed request (layer, entries,
    request_id), written by hand: ``entries`` are (seq_id, position, num_tokens, end_of_sequence); its tensors
    follow (``encode_after``). Only for plain values (a layer in [0, 2**31), str ids, int positions and token
    counts in [0, 2**63), a request id in [0, 2**64)): None for anything else, which ``encode_attend_request``
    then encodes (or refuses) as protobuf does."""
    if (
        type(layer) is not int
        or not 0 <= layer < _INT32
        or type(request_id) is not int
        or not 0 <= request_id < _UINT64
    ):
        return None
    parts: list[bytes] = [_LAYER_FIELD_KEY, _uvarint(layer)] if layer else []
    for seq_id, position, num_tokens, end in entries:
        if (
            type(seq_id) is not str
            or type(position) is not int
            or type(num_tokens) is not int
            or not 0 <= position < _INT64
            or not 0 <= num_tokens < _INT64
        ):
            return None
        try:
            name = seq_id.encode()
        except UnicodeEncodeError:
            return None
        body = b"".join((
            _SEQ_ID_KEY + _uvarint(len(name)) + name if name else b"",
            _POSITION_KEY + _uvarint(position) if position else b"",
            _NUM_TOKENS_KEY + _uvarint(num_tokens) if num_tokens else b"",
            _END_OF_SEQUENCE if end else b"",
        ))  # fmt: skip
        parts += (_ENTRY_KEY, _uvarint(len(body)), body)
    if request_id:
        parts += (_REQUEST_ID_KEY, _uvarint(request_id))
    return b"".join(parts)


def encode_after(head: bytes, q: RawTensor, k: RawTensor | None, v: RawTensor | None) -> bytes:
    """A serialized AttendRequest: ``head`` (``encode_entries``'s) and the tensors, each one's bytes copied once."""
    parts: list[Buffer] = [head]
    for field, t in ((_Q, q), (_K, k), (_V, v)):
        if t is not None:
            parts += _tensor(field, t)
    return b"".join(parts)


def encode_attend_response(request_id: int, output: RawTensor | None, code: int = 0, message: str = "") -> bytes:
    """A serialized AttendResponse: the output (when the call succeeded) or a status (code != 0)."""
    status = pb.Status(code=code, message=message) if code else None
    parts: list[Buffer] = [pb.AttendResponse(request_id=request_id, status=status).SerializeToString()]
    if output is not None:
        parts += _tensor(_OUTPUT, output)
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
        head = b"".join([_LAYER_KEY, _varint(layer), _LOGICAL_KEY, _varint(logical)])
        k_size, v_size = sum(len(p) for p in k), sum(len(p) for p in v)
        k_len, v_len = _varint(k_size), _varint(v_size)
        tail = _CHECKSUM_KEY + checksum.to_bytes(8, "little")
        size = len(head) + len(_BLOCK_K_KEY) + len(k_len) + k_size + len(_BLOCK_V_KEY) + len(v_len) + v_size + len(tail)
        parts += [_BLOCK_KEY, _varint(size), head, _BLOCK_K_KEY, k_len, *k, _BLOCK_V_KEY, v_len, *v, tail]
    body_size = sum(len(p) for p in parts)
    return b"".join([_BLOCKS_KEY, _varint(body_size), *parts])


def decode_kv_message(data: bytes, max_records: int | None = None) -> tuple[str, memoryview | list[KVRecord]]:
    """A serialized KVChunk: ("blocks", its records, the K/V as views of ``data``), or ("header", "grant" or
    "trailer", the submessage's bytes), or ("", empty) for a message with none. WireError when malformed,
    or when it holds more than ``max_records`` records (found before reading more than that many)."""
    buf = memoryview(data)
    found: tuple[str, memoryview | list[KVRecord]] = ("", memoryview(b""))
    for field, kind, start, end in _fields(buf, 8):
        if kind != _LEN or (field != _BLOCKS and field not in _PARTS):
            continue
        body = _payload(buf, start, end)
        if field == _BLOCKS:
            try:
                fields = _fields(body, max_records)
            except TooManyFields:
                raise WireError(
                    f"a KV message of {len(data)} bytes has more than the {max_records} blocks that fit"
                ) from None
            found = ("blocks", [_kv_record(_payload(body, s, e)) for f, k, s, e in fields if f == _BLOCK and k == _LEN])
        else:
            found = (_PARTS[field], body)
    return found


def _kv_record(body: memoryview) -> KVRecord:
    """One KVBlock's fields."""
    layer = logical = checksum = 0
    k = v = memoryview(b"")
    for f, kind, s, e in _fields(body, 16):
        _, value_at = _read_varint(body, s)
        if f == _LAYER and kind == _VARINT:
            layer = _read_varint(body, value_at)[0]
        elif f == _LOGICAL and kind == _VARINT:
            logical = _read_varint(body, value_at)[0]
        elif f == _CHECKSUM and kind == _I64:
            checksum = int.from_bytes(body[value_at : value_at + 8], "little")
        elif f == _OLD_CRC32:
            raise WireError(
                "a KV block in the older format (a CRC-32 in field 3) where XXH3-64 checksums (field 6) are read:"
                " export it again with this version"
            )
        elif f == _BLOCK_K and kind == _LEN:
            k = _payload(body, s, e)
        elif f == _BLOCK_V and kind == _LEN:
            v = _payload(body, s, e)
    return layer, logical, checksum, k, v


class WireError(ValueError):
    """Bytes that are not a valid message of the expected kind."""


class TooManyFields(WireError):
    """A message with more fields than any valid one of its kind has."""


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


def _fields(buf: memoryview, limit: int | None = None) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start of the field's key, end of the field) for each top-level field; with
    ``limit``, WireError on reaching the limit+1-th, so that the scan's cost is bounded by the limit."""
    out: list[tuple[int, int, int, int]] = []
    pos = 0
    while pos < len(buf):
        if limit is not None and len(out) == limit:
            raise TooManyFields(f"the message has more than {limit} fields")
        start = pos
        key, pos = _read_varint(buf, pos)
        field, kind = key >> 3, key & 7
        if kind == _VARINT:
            _, pos = _read_varint(buf, pos)
        elif kind == _I64:
            pos += 8
        elif kind == _LEN:
            size, pos = _read_varint(buf, pos)
            pos += size
        elif kind == _I32:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {kind} in field {field}")
        if pos > len(buf) or field == 0:
            raise WireError("truncated message")
        out.append((field, kind, start, pos))
    return out


def check_fields(data: bytes, limit: int) -> None:
    """TooManyFields when the message has more than ``limit`` top-level fields (found reading limit + 1)."""
    _fields(memoryview(data), limit)


def split(data: bytes, tensor_fields: frozenset[int], max_fields: int | None = None) -> Split:
    """Take the Tensor submessages in ``tensor_fields`` apart without copying their data (see ``Split``).

    A tensor field that appears more than once is refused (protobuf would merge the copies; no client
    of ours sends that), and so is a message of more than ``max_fields`` top-level fields (TooManyFields,
    before more are read), or a tensor of more than 64.
    """
    buf = memoryview(data)
    rest: list[memoryview] = []
    tensors: dict[int, tuple[bytes, memoryview]] = {}
    for field, kind, start, end in _fields(buf, max_fields):
        if field not in tensor_fields or kind != _LEN:
            rest.append(buf[start:end])
            continue
        if field in tensors:
            raise WireError(f"tensor field {field} appears more than once")
        body = _payload(buf, start, end)
        header: list[memoryview] = []
        payload = memoryview(b"")
        try:
            inner = _fields(body, 64)
        except TooManyFields:
            raise WireError(f"the tensor in field {field} has more than 64 fields; a Tensor has 3") from None
        for f, k, s, e in inner:
            if f == _TENSOR_DATA and k == _LEN:  # keep a view of the bytes, no copy
                payload = _payload(body, s, e)
            else:
                header.append(body[s:e])
        tensors[field] = (b"".join(header), payload)
    return Split(b"".join(rest), tensors)


# -- why bytes do not parse ------------------------------------------------------------------------------

_WIRE_NAMES = {_VARINT: "varint", _I64: "64-bit", _LEN: "length-delimited", _I32: "32-bit"}


def _wire_type(field: FieldDescriptor) -> int:
    """The wire type a field's values take when not packed."""
    if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE):
        return _LEN
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64):
        return _I64
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32):
        return _I32
    return _VARINT


# explain reads at most this many fields (~2 ms): past them it says where it stopped.
EXPLAIN_FIELDS = 2048


def explain(descriptor: Any, data: bytes | memoryview, path: str = "", budget: list[int] | None = None) -> str:
    """Why ``data`` is not a valid message of ``descriptor``'s type, naming the field (protobuf's own error
    says only "Error parsing message"); "" when no reason is found. As protobuf does, a known field sent with
    another wire type is skipped as unknown. Reads the fields up to the first fault, at most EXPLAIN_FIELDS
    of them (``budget``, shared with the nested messages)."""
    budget = [EXPLAIN_FIELDS] if budget is None else budget
    buf = memoryview(data)
    inside = f"in {path}: " if path else ""
    pos = 0
    while pos < len(buf):
        at = pos
        budget[0] -= 1
        if budget[0] < 0:
            return f"{inside}the first {EXPLAIN_FIELDS} fields parse; the fault lies past byte {at}"
        try:
            key, pos = _read_varint(buf, pos)
        except WireError:
            return f"{inside}byte {at}: a field key that is cut short or longer than 10 bytes"
        number, kind = key >> 3, key & 7
        field = descriptor.fields_by_number.get(number)
        name = f"{path}." if path else ""
        name += field.name if field else f"field {number}"
        if number == 0:
            return f"{inside}byte {at}: field number 0 does not exist"
        if kind not in _WIRE_NAMES:
            return f"{name} (byte {at}): wire type {kind} is not one this protocol uses"
        try:
            if kind == _VARINT:
                _, pos = _read_varint(buf, pos)
            elif kind == _LEN:
                size, pos = _read_varint(buf, pos)
                start, pos = pos, pos + size
            else:
                pos += 8 if kind == _I64 else 4
        except WireError:
            return f"{name} (byte {at}): its value is a varint cut short or longer than 10 bytes"
        if pos > len(buf):
            return f"{name} (byte {at}): its value runs past the end of the message (cut short?)"
        if field is None or kind != _LEN or _wire_type(field) != _LEN:
            continue  # unknown fields, and known ones of another wire type, are skipped (as protobuf does)
        value = buf[start:pos]
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                str(value, "utf-8")
            except UnicodeDecodeError as e:
                return f"{name}: not valid UTF-8 (byte {e.start} of the string)"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            inner = explain(field.message_type, value, name, budget)
            if inner:
                return inner
    return ""
