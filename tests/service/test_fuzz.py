"""The project's fuzz test: hypothesis drives every RPC of a real server with generated and mutated messages
(valid ones with one field broken, random bytes, truncations, huge numbers, long strings). The block API too:
OpenBlockSpace, CloseBlockSpace, and Attend / AttendStream requests addressed by a BlockBatch (its integer
fields' bytes broken, cut or random, its space id any string) into a space opened for each example.

After each: no UNKNOWN or INTERNAL status (and no answer lost to gRPC's metadata limit), a health check
answered within a second, and, once the sequences the message could have created are released and the
block spaces it could have opened are closed, the pool, the sequence count and the open spaces exactly as
before. CI runs FUZZ_EXAMPLES (default 300); ``make fuzz`` runs 10,000 and prints the statuses it saw.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkattn_client import codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from tests.helpers.rawrpc import Answer, Raw
from tests.helpers.server_process import SMALL, ServerProcess

pytestmark = pytest.mark.server

H, HKV, D = 4, 2, 16
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FORBIDDEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
SEEN: collections.Counter[str] = collections.Counter()
# The space id in the block API's seeds, replaced when sent by the id of the space opened for the example (as
# long, so that the message stays what it was).
PLACEHOLDER = "space-id-placeholder-0123456789a"
SPACE_BLOCKS = 8
# Seeds named apart from the RPC they call, so that the block API's requests are drawn as often as the others.
METHOD = {"AttendBlocks": "Attend", "AttendStreamBlocks": "AttendStream"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    flags = ["--num-blocks", "512", "--idle-timeout-s", "0", "--stream-idle-s", "5", "--kv-import-stall-s", "5"]
    with ServerProcess(*SMALL, *flags) as s:
        yield s
    if SEEN:
        total = sum(SEEN.values())
        print(f"\nfuzz: {total} requests; statuses: " + ", ".join(f"{k} {v}" for k, v in SEEN.most_common()))


def attend_request(seq_id: str, position: int, n: int, layer: int = 0, request_id: int = 0) -> bytes:
    rng = np.random.default_rng(position + n)
    q, k, v = (codec.to_raw(rng.standard_normal((n, h, D), np.float32)) for h in (H, HKV, HKV))
    entry = pb.SequenceEntry(seq_id=seq_id, position=position, num_tokens=n)
    return wire.encode_attend_request(layer, [entry], q, k, v, request_id)


def block_request(layer: int, request_id: int = 0) -> bytes:
    """A valid block-addressed AttendRequest into PLACEHOLDER's space of SPACE_BLOCKS blocks: layer 0, a row
    of 3 new tokens and one of 2 after 4 older keys; else one decode token after 8 older keys."""
    if layer == 0:
        slots, starts, seq_lens, table = [0, 1, 2, 12, 13], [0, 3, 5], [3, 6], [[0, 1], [2, 3]]
    else:
        slots, starts, seq_lens, table = [24], [0, 1], [9], [[4, 5, 6]]
    n = len(slots)
    rng = np.random.default_rng(n + layer)
    q, k, v = (codec.to_raw(rng.standard_normal((n, h, D), np.float32)) for h in (H, HKV, HKV))
    blocks = pb.BlockBatch(
        space_id=PLACEHOLDER,
        slot_mapping=np.array(slots, "<i8").tobytes(),
        query_start_loc=np.array(starts, "<i4").tobytes(),
        seq_lens=np.array(seq_lens, "<i4").tobytes(),
        block_table=np.array(table, "<i4").tobytes(),
        block_table_width=len(table[0]),
    )
    return wire.encode_attend_request(layer, [], q, k, v, request_id, blocks)


def seeds(source: str, export: list[bytes]) -> dict[str, list[list[bytes]]]:
    """Valid messages of every RPC, each a list of a call's messages; ``source`` exists (3 tokens, every
    layer) and ``export`` is its ExportKV stream."""
    header = pb.KVChunk.FromString(export[0])
    header.header.seq_id = "imported"
    return {
        "Info": [[b""]],
        "Attend": [[attend_request("new", 0, 3)], [attend_request(source, 3, 1, layer=2)]],
        "AttendStream": [[attend_request("new", 0, 2, request_id=7), attend_request("new", 2, 1, request_id=8)]],
        "Release": [[pb.ReleaseRequest(seq_ids=[source, "ghost"], missing_ok=True).SerializeToString()]],
        "Fork": [[pb.ForkRequest(parent=source, child="child").SerializeToString()]],
        "Truncate": [[pb.TruncateRequest(seq_id=source, length=2).SerializeToString()]],
        "ExportKV": [[pb.ExportKVRequest(seq_id=source, layers=[0, 3], max_message_bytes=4096).SerializeToString()]],
        "TransferKV": [
            [pb.TransferKVRequest(seq_id=source, target="127.0.0.1:1", new_seq_id="far").SerializeToString()]
        ],
        "ImportKV": [[header.SerializeToString(), *export[1:]]],
        "AttendBlocks": [[block_request(0)], [block_request(3)]],
        "AttendStreamBlocks": [[block_request(0, request_id=7), block_request(3, request_id=8)]],
        "OpenBlockSpace": [
            [pb.OpenBlockSpaceRequest(num_blocks=4).SerializeToString()],
            [pb.OpenBlockSpaceRequest(num_blocks=2, layer_planes=[0, 0, 0, 1]).SerializeToString()],
        ],
        "CloseBlockSpace": [[pb.CloseBlockSpaceRequest(space_id=PLACEHOLDER).SerializeToString()]],
    }


INTS = st.sampled_from([0, 1, -1, 3, 15, 16, 17, 2**31 - 1, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, -(2**63)])
STRINGS = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "x" * 256, "x" * 257, "é" * 200, "x" * 70000, "127.0.0.1:1", "[::1]:99999", "dns:///"]),
)


@st.composite
def field_broken(draw: st.DrawFn, message: bytes, kind: type[Message]) -> bytes:
    """The message with one field (at any depth) set to a generated value, or repeated many times."""
    m = kind.FromString(message)
    target: Message = m
    while True:
        fields: list[Any] = list(target.DESCRIPTOR.fields)
        field = draw(st.sampled_from(fields))
        inner = field.message_type
        deeper = field.type == field.TYPE_MESSAGE and not field.is_repeated and inner is not None and bool(inner.fields)
        if deeper and draw(st.booleans()):
            target = getattr(target, field.name)
            continue
        break
    name = field.name
    if field.type == field.TYPE_MESSAGE:
        items = getattr(target, name)
        if field.is_repeated and len(items):
            items.extend([items[0]] * draw(st.sampled_from([1, 100, 9000])))
        return m.SerializeToString()
    if field.type == field.TYPE_STRING:
        values: Any = STRINGS
    elif field.type == field.TYPE_BYTES:
        values = st.binary(max_size=64)
    elif field.type == field.TYPE_BOOL:
        values = st.booleans()
    elif field.type == field.TYPE_DOUBLE or field.type == field.TYPE_FLOAT:
        values = st.floats(allow_nan=True, allow_infinity=True, width=32)
    else:
        values = INTS
    value = draw(values)
    try:
        if field.is_repeated:
            getattr(target, name).extend([value] * draw(st.sampled_from([1, 3, 5000])))
        else:
            setattr(target, name, value)
    except (ValueError, TypeError):  # out of the field's range: protobuf refuses it, send what it holds
        pass
    return m.SerializeToString()


@st.composite
def mutated(draw: st.DrawFn, message: bytes) -> bytes:
    """The bytes flipped, cut, spliced or repeated."""
    data = bytearray(message)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["flip", "cut", "insert", "delete", "repeat"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if how == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del data[at:]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif how == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 64))] * draw(st.integers(1, 50))
    return bytes(data)


KINDS: dict[str, type[Message]] = {
    "Info": pb.InfoRequest,
    "Attend": pb.AttendRequest,
    "AttendStream": pb.AttendRequest,
    "Release": pb.ReleaseRequest,
    "Fork": pb.ForkRequest,
    "Truncate": pb.TruncateRequest,
    "ExportKV": pb.ExportKVRequest,
    "TransferKV": pb.TransferKVRequest,
    "ImportKV": pb.KVChunk,
    "AttendBlocks": pb.AttendRequest,
    "AttendStreamBlocks": pb.AttendRequest,
    "OpenBlockSpace": pb.OpenBlockSpaceRequest,
    "CloseBlockSpace": pb.CloseBlockSpaceRequest,
}


@st.composite
def case(draw: st.DrawFn, seeds: dict[str, list[list[bytes]]]) -> tuple[str, list[bytes]]:
    """An RPC and its messages: a seed with one message broken in one of the ways above, or random bytes."""
    rpc = draw(st.sampled_from(sorted(seeds)))
    messages = list(draw(st.sampled_from(seeds[rpc])))
    i = draw(st.integers(0, len(messages) - 1))
    how = draw(st.sampled_from(["field", "bytes", "random", "empty"]))
    if how == "field" and KINDS[rpc].DESCRIPTOR.fields:
        messages[i] = draw(field_broken(messages[i], KINDS[rpc]))
    elif how == "bytes":
        messages[i] = draw(mutated(messages[i]))
    elif how == "random":
        messages[i] = draw(st.binary(max_size=256))
    else:
        messages = messages[:i]  # a stream cut short (or, for a unary call, an empty request)
        if METHOD.get(rpc, rpc) not in ("ImportKV", "AttendStream"):
            messages = [b""]
    return rpc, messages


def ids_in(rpc: str, messages: list[bytes], answer: Answer) -> list[str]:
    """The sequence ids a call that succeeded may have created."""
    ids: list[str] = []
    for m in messages:
        try:
            if rpc in ("Attend", "AttendStream"):
                ids += [e.seq_id for e in pb.AttendRequest.FromString(m).entries]
            elif rpc == "Fork":
                ids.append(pb.ForkRequest.FromString(m).child)
        except DecodeError:
            pass
    if rpc == "ImportKV" and answer.code == grpc.StatusCode.OK:
        ids.append(pb.ImportKVResponse.FromString(answer.data).seq_id)
    return ids


def spaces_in(rpc: str, answer: Answer) -> list[str]:
    """The block space a call that succeeded may have opened."""
    if rpc == "OpenBlockSpace" and answer.code == grpc.StatusCode.OK:
        return [pb.OpenBlockSpaceResponse.FromString(answer.data).space_id]
    return []


def send(r: Raw, rpc: str, messages: list[bytes]) -> Answer:
    rpc = METHOD.get(rpc, rpc)
    if rpc == "ImportKV":
        return r.stream(rpc, messages, timeout=10)
    if rpc == "AttendStream":
        return r.stream(rpc, messages, timeout=10)
    return r.call(rpc, messages[0] if messages else b"", timeout=10)


def check(answer: Answer, rpc: str) -> None:
    assert answer.code not in FORBIDDEN, (rpc, answer)
    assert "metadata" not in answer.details, (rpc, answer)
    codes = [answer.code.name]
    if METHOD.get(rpc, rpc) == "AttendStream" and answer.code == grpc.StatusCode.OK:
        for data in answer.data:
            status = pb.AttendResponse.FromString(data).status
            code = (
                grpc.StatusCode.OK if not status.code else next(c for c in grpc.StatusCode if c.value[0] == status.code)
            )
            assert code not in FORBIDDEN, (rpc, status)
            codes.append(f"in-stream {code.name}")
    for c in codes:
        SEEN[f"{rpc} {c}"] += 1


def test_fuzz_every_rpc(server: ServerProcess) -> None:
    with Raw(server.target) as r:
        source = "source"
        assert all(r.call("Attend", attend_request(source, 0, 3, layer=x)).code == grpc.StatusCode.OK for x in range(4))
        export = r.call("ExportKV", pb.ExportKVRequest(seq_id=source).SerializeToString()).data
        cases = seeds(source, export)
        baseline = r.info()

        def setup() -> None:
            """The source as the seeds expect it: 3 tokens in every layer."""
            r.call("Release", pb.ReleaseRequest(seq_ids=[source], missing_ok=True).SerializeToString())
            for x in range(4):
                assert r.call("Attend", attend_request(source, 0, 3, layer=x)).code == grpc.StatusCode.OK

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case(cases))
        def one(example: tuple[str, list[bytes]]) -> None:
            rpc, messages = example
            setup()
            opened = r.call("OpenBlockSpace", pb.OpenBlockSpaceRequest(num_blocks=SPACE_BLOCKS).SerializeToString())
            assert opened.code == grpc.StatusCode.OK, opened
            space_id = pb.OpenBlockSpaceResponse.FromString(opened.data).space_id
            messages = [m.replace(PLACEHOLDER.encode(), space_id.encode()) for m in messages]
            answer = send(r, rpc, messages)
            check(answer, rpc)
            started = time.monotonic()
            assert r.health(timeout=1).data == 1, "no health answer within a second"
            assert time.monotonic() - started < 1
            created = [*ids_in(rpc, messages, answer), "child", "imported", "new", "far"]
            valid = [s for s in dict.fromkeys(created) if s and len(s.encode()) <= 256]
            release = pb.ReleaseRequest(seq_ids=valid, missing_ok=True)
            r.call("Release", release.SerializeToString())
            for space in [space_id, *spaces_in(rpc, answer)]:
                closed = r.call("CloseBlockSpace", pb.CloseBlockSpaceRequest(space_id=space).SerializeToString())
                if rpc == "CloseBlockSpace" and space == space_id and answer.code == grpc.StatusCode.OK:
                    assert closed.code == grpc.StatusCode.NOT_FOUND, (rpc, closed)  # the call closed it
                else:
                    assert closed.code == grpc.StatusCode.OK, (rpc, answer, closed)
            setup()
            after = r.info()
            assert (after.free_blocks, after.active_sequences, after.block_spaces) == (
                baseline.free_blocks,
                baseline.active_sequences,
                0,
            ), (rpc, answer)

        one()
        r.call("Release", pb.ReleaseRequest(seq_ids=[source]).SerializeToString())
        assert r.info().free_blocks == baseline.num_blocks
