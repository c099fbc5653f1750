"""The hand-written wire encoders produce exactly the messages protobuf would."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from chunkattn_client import codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.client import ChunkAttnError, decode_attend_response


def _raw(shape: tuple[int, ...], n: int) -> wire.RawTensor:
    return codec.to_raw(np.arange(np.prod(shape) if n else 0, dtype=np.float32).reshape(shape))


# element counts whose byte lengths (x 4 x 4 for q) straddle the varint size steps at 128 and 16,384 bytes
@pytest.mark.parametrize("size", [0, 1, 7, 8, 1023, 1024, 40_000])
def test_attend_request_parses_back_to_the_protobuf_message(size: int) -> None:
    q, k = _raw((size, 4), size), _raw((size, 2), size)
    entries = [pb.SequenceEntry(seq_id="a", position=3, num_tokens=size, end_of_sequence=True)]
    data = wire.encode_attend_request(7, entries, q, k, None, request_id=2**40)
    want = pb.AttendRequest(
        layer=7,
        entries=entries,
        q=codec.encode(np.frombuffer(q.data, np.float32).reshape(q.shape)),
        k=codec.encode(np.frombuffer(k.data, np.float32).reshape(k.shape)),
        request_id=2**40,
    )
    got = pb.AttendRequest.FromString(data)
    assert got == want
    assert not got.HasField("v")


def test_attend_response_with_output_or_status() -> None:
    out = codec.to_raw(torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
    got = pb.AttendResponse.FromString(wire.encode_attend_response(9, out))
    assert got.request_id == 9
    assert not got.HasField("status")
    assert codec.bf16_to_float32(codec.decode(got.output)).tolist() == [
        [float(4 * r + c) for c in range(4)] for r in range(3)
    ]
    failed = pb.AttendResponse.FromString(wire.encode_attend_response(10, None, 9, "position 3 expected"))
    assert (failed.status.code, failed.status.message, failed.HasField("output")) == (9, "position 3 expected", False)


def test_non_contiguous_and_big_endian_inputs_are_sent_as_little_endian_c_order() -> None:
    x = np.arange(24, dtype=">f4").reshape(4, 6).T  # big-endian and transposed
    raw = codec.to_raw(x)
    assert np.frombuffer(raw.data, "<f4").reshape(raw.shape).tolist() == x.tolist()


def test_split_takes_tensors_out_of_protobuf_built_messages_without_copying() -> None:
    q = np.arange(6, dtype=np.float32).reshape(2, 3)
    message = pb.AttendRequest(layer=2, q=codec.encode(q), request_id=4)
    message.entries.add(seq_id="a", position=0, num_tokens=2)
    data = message.SerializeToString()
    parts = wire.split(data, frozenset({3, 4, 5}))
    assert pb.AttendRequest.FromString(parts.rest) == pb.AttendRequest(layer=2, entries=message.entries, request_id=4)
    assert set(parts.tensors) == {3}
    view = codec.from_parts(*parts.tensors[3])
    assert view.tolist() == q.tolist()
    assert not view.flags.owndata  # a view of the received bytes, not a copy
    assert not view.flags.writeable


@pytest.mark.parametrize("bad", [b"\x1a\x05ab", b"\x0b", b"\x1a\x02\x1a\x09", b"\x1a\x00\x1a\x00"])
def test_split_refuses_malformed_or_repeated_tensor_fields(bad: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.split(bad, frozenset({3}))


def test_kv_blocks_encode_as_protobuf_does_and_decode_as_views() -> None:
    records = [(3, 17, 0xDEADBEEF_CAFEF00D, b"k" * 300, b"v" * 300), (0, 0, 0, b"", b"\x00\x01")]
    pieces: list[wire.KVPieces] = [
        (3, 17, 0xDEADBEEF_CAFEF00D, [b"k" * 100, memoryview(b"k" * 200)], [b"v" * 300]),  # joined in order
        (0, 0, 0, [], [b"\x00", b"\x01"]),
    ]
    data = wire.encode_kv_blocks(pieces)
    parsed = pb.KVChunk.FromString(data)
    assert [(b.layer, b.logical, b.checksum, b.k, b.v) for b in parsed.blocks.blocks] == records
    same = pb.KVChunk(
        blocks=pb.KVBlocks(blocks=[pb.KVBlock(layer=a, logical=b, checksum=c, k=k, v=v) for a, b, c, k, v in records])
    )
    part, decoded = wire.decode_kv_message(same.SerializeToString())
    assert part == "blocks"
    assert isinstance(decoded, list)
    assert [(a, b, c, bytes(k), bytes(v)) for a, b, c, k, v in decoded] == records
    header = pb.KVChunk(header=pb.KVHeader(seq_id="s", num_records=2)).SerializeToString()
    part, body = wire.decode_kv_message(header)
    assert part == "header"
    assert pb.KVHeader.FromString(bytes(body)).seq_id == "s"  # type: ignore[arg-type]
    assert wire.decode_kv_message(b"")[0] == ""
    with pytest.raises(wire.WireError):
        wire.decode_kv_message(data[:-5])


def test_kv_blocks_of_the_older_crc32_format_are_refused_by_name() -> None:
    block = b"\x08\x00\x10\x00\x1d\x00\x00\x00\x00\x22\x01k\x2a\x01v"  # field 3: a fixed32 CRC-32
    blocks = b"\x0a" + bytes([len(block)]) + block
    with pytest.raises(wire.WireError, match="older format"):
        wire.decode_kv_message(b"\x12" + bytes([len(blocks)]) + blocks)


# 2 and 40,000 rows of 4 floats: a small response (parsed by protobuf) and one past 64 KiB (taken apart)
@pytest.mark.parametrize("rows", [2, 40_000])
def test_the_client_reads_an_output_or_a_status_whatever_the_response_size(rows: int) -> None:
    out = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    np.testing.assert_array_equal(decode_attend_response(wire.encode_attend_response(5, codec.to_raw(out))), out)
    np.testing.assert_array_equal(decode_attend_response(wire.encode_attend_response(5, codec.to_raw(out)), 5), out)
    bf16 = torch.arange(rows * 4, dtype=torch.bfloat16).reshape(rows, 4)
    words = decode_attend_response(wire.encode_attend_response(0, codec.to_raw(bf16)))
    assert words.dtype == np.uint16
    np.testing.assert_array_equal(codec.bf16_to_float32(words), bf16.float().numpy())
    with pytest.raises(ChunkAttnError) as e:
        decode_attend_response(wire.encode_attend_response(5, codec.to_raw(out)), 6)
    assert (e.value.code, e.value.message) == (grpc.StatusCode.INTERNAL, "response 5 answers request 6")
    with pytest.raises(ChunkAttnError) as e:
        decode_attend_response(wire.encode_attend_response(5, None, grpc.StatusCode.NOT_FOUND.value[0], "gone"), 5)
    assert (e.value.code, e.value.message) == (grpc.StatusCode.NOT_FOUND, "gone")


def _response_of_bytes(n: int) -> bytes:
    return pb.AttendResponse(output=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3], data=b"\x00" * n)).SerializeToString()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xff\xff\xff", "the server's response does not parse"),
        (b"\x0a\x05" + b"\x00" * 70_000, "the server's response does not parse"),
        (wire.encode_attend_response(1, None), "the server's response has no output"),
        (_response_of_bytes(8), "the server's output does not decode"),  # 3 floats are 12 bytes
        (_response_of_bytes(70_000), "the server's output does not decode"),
    ],
)  # fmt: skip
def test_a_response_the_client_cannot_read_is_internal_and_says_why(raw: bytes, message: str) -> None:
    with pytest.raises(ChunkAttnError) as e:
        decode_attend_response(raw)
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert e.value.message.startswith(message)
