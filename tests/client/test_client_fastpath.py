"""The client's per-call fast paths (#37): a request written by hand is byte for byte the one protobuf's path
writes (and anything it does not take goes that path, with its errors); an answer of a known form is read as
a view with the same result as the full decoder, and any other goes to the full decoder; the blocking data
plane's socket: answers matched to their calls, a connection lost between calls is no call's, one lost
mid-call is UNAVAILABLE."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkattn_client import BatchEntry, ChunkAttnError, codec, wire
from chunkattn_client import _requests as calls
from chunkattn_client._errors import LostConnection
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._zmqplane import ZmqDataPlane, context
from chunkattn_client.dataplane import KEY_BYTES, Offer

# -- requests ---------------------------------------------------------------------------------------------------


def protobuf_request(layer: Any, entries: list[BatchEntry], q: Any, k: Any, v: Any, rid: int, **options: Any) -> bytes:
    """The request as the protobuf path writes it (what attend_request wrote before its hand-written path)."""
    ending = set(options.get("end_of_sequence", ()))
    dtype = options.get("dtype")
    return wire.encode_attend_request(
        layer,
        [sequence_entry(e, ending) for e in entries],
        codec.to_raw(q, dtype),
        None if k is None else codec.to_raw(k, dtype),
        None if v is None else codec.to_raw(v, dtype),
        rid,
    )  # fmt: skip


def sequence_entry(e: BatchEntry, ending: set[str]) -> pb.SequenceEntry:
    return pb.SequenceEntry(
        seq_id=e.seq_id, position=e.position, num_tokens=e.num_tokens, end_of_sequence=e.seq_id in ending
    )


entry = st.builds(
    BatchEntry,
    st.text(max_size=12),
    st.integers(0, 2**63 - 1) | st.integers(0, 300),
    st.integers(0, 2**63 - 1) | st.integers(0, 300),
)


@settings(max_examples=300, deadline=None)
@given(
    layer=st.integers(0, 2**31 - 1) | st.integers(0, 200),
    entries=st.lists(entry, max_size=4, unique_by=lambda e: e.seq_id),
    rid=st.integers(0, 2**64 - 1) | st.integers(0, 300),
    tokens=st.integers(0, 3),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    kv=st.booleans(),
    ending=st.integers(0, 4),
)
def test_a_hand_written_request_is_protobufs_byte_for_byte(
    layer: int, entries: list[BatchEntry], rid: int, tokens: int, dtype: str, kv: bool, ending: int
) -> None:
    rng = np.random.default_rng(tokens)
    words = dtype == "bfloat16"
    numpy_dtype = np.uint16 if words else np.dtype(dtype)
    q = rng.standard_normal((tokens, 4, 8)).astype(numpy_dtype)
    k = rng.standard_normal((tokens, 2, 8)).astype(numpy_dtype) if kv else None
    options: dict[str, Any] = {"end_of_sequence": [e.seq_id for e in entries[:ending]]}
    if words or ending % 2:  # the dtype named (bfloat16 words must be), or left to the arrays
        options["dtype"] = dtype
    got = calls.attend_request(layer, entries, q, k, k, request_id=rid, **options)
    assert got == protobuf_request(layer, entries, q, k, k, rid, **options)
    parsed = pb.AttendRequest.FromString(got)
    assert (parsed.layer, parsed.request_id, len(parsed.entries)) == (layer, rid, len(entries))


def test_values_the_hand_written_path_does_not_take_go_through_protobuf() -> None:
    q = np.ones((1, 4, 8), np.float32)
    odd: list[tuple[Any, list[BatchEntry]]] = [
        (np.int64(3), [BatchEntry("s", 1, 1)]),  # numpy integers
        (0, [BatchEntry("s", np.int32(5), np.int64(1))]),  # type: ignore[arg-type]
        (0, [BatchEntry("s", -1, 1)]),  # a negative position: protobuf writes it; the server refuses it
        (0, [BatchEntry(b"s", 0, 1)]),  # type: ignore[arg-type]  # bytes for a string: protobuf takes them
    ]
    for layer, entries in odd:
        assert wire.encode_entries(layer, [(e.seq_id, e.position, e.num_tokens, False) for e in entries]) is None
        assert calls.attend_request(layer, entries, q, request_id=9) == protobuf_request(
            layer, entries, q, None, None, 9
        )
    # Non-contiguous, big-endian and float64 arrays: converted (or refused) as before.
    for x in (np.ones((8, 4, 1), np.float32).transpose(2, 1, 0), np.ones((1, 4, 8), ">f4")):
        assert calls.attend_request(0, [BatchEntry("s", 0, 1)], x) == protobuf_request(
            0, [BatchEntry("s", 0, 1)], x, None, None, 0
        )
    with pytest.raises(codec.CodecError, match="cannot send a float64 array"):
        calls.attend_request(0, [BatchEntry("s", 0, 1)], np.ones((1, 4, 8)))


@pytest.mark.parametrize(
    ("layer", "entries", "error"),
    [
        (2**31, [BatchEntry("s", 0, 1)], ValueError),  # out of int32: protobuf's own error
        (0, [BatchEntry("s", 2**63, 1)], ValueError),
        (0, [BatchEntry("\ud800", 0, 1)], UnicodeEncodeError),  # a lone surrogate
        (0, [BatchEntry("s", True, 1)], TypeError),
    ],
)
def test_bad_values_raise_protobufs_errors(layer: int, entries: list[BatchEntry], error: type[Exception]) -> None:
    q = np.ones((1, 4, 8), np.float32)
    with pytest.raises(error) as expected:
        protobuf_request(layer, entries, q, None, None, 1)
    with pytest.raises(error) as got:
        calls.attend_request(layer, entries, q, request_id=1)
    assert str(got.value) == str(expected.value)


def test_to_raw_fast_is_to_raw() -> None:
    cases: list[tuple[Any, str | None]] = [
        (np.arange(6, dtype=np.float32).reshape(2, 3), None),
        (np.arange(6, dtype=np.float16).reshape(3, 2), "float16"),
        (np.arange(6, dtype=np.uint16), "bfloat16"),
        (np.zeros((0, 4), np.float32), None),
        (np.float32(2.0), None),
        (np.arange(6, dtype=np.float32).reshape(2, 3).T, None),
        (np.arange(6, dtype=np.float32), "float16"),  # converted, as to_raw does
    ]
    for x, dtype in cases:
        fast, slow = codec.to_raw_fast(x, dtype), codec.to_raw(x, dtype)
        assert (fast.dtype, fast.shape, len(fast.data), bytes(fast.data)) == (
            slow.dtype, slow.shape, len(slow.data), bytes(slow.data),
        )  # fmt: skip
    with pytest.raises(codec.CodecError, match="bfloat16 is sent as uint16 words"):
        codec.to_raw_fast(np.ones(2, np.float32), "bfloat16")


# -- answers ----------------------------------------------------------------------------------------------------


def full_decode(raw: bytes, rid: int | None) -> Any:
    """The full decoder's result (an array, or the error's code and message), the known forms forgotten."""
    calls._KNOWN.clear()
    try:
        return np.array(calls.decode_attend_response(raw, rid))
    except ChunkAttnError as e:
        return e.code, e.message


def decoded(raw: bytes, rid: int | None) -> Any:
    try:
        return np.array(calls.decode_attend_response(raw, rid))
    except ChunkAttnError as e:
        return e.code, e.message


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(a == b)


def test_a_known_answer_is_a_view_of_its_bytes_with_the_full_decoders_result() -> None:
    out = np.arange(2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)
    raw = wire.encode_attend_response(300, codec.to_raw(out))
    calls._KNOWN.clear()
    assert calls.decode_known(raw, 300) is None  # not known yet
    first = calls.decode_attend_response(raw, 300)  # learnt
    view = calls.decode_known(raw, 300)
    assert view is not None
    assert same(view, first)
    assert same(view, out)
    assert not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(raw, np.uint8))  # no copy


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_answer_decodes_as_the_full_decoder_decodes_it(data: st.DataObject) -> None:
    """Learnt forms, then answers that differ from them anywhere (another id, a status, bytes changed, cut or
    added, another shape of the same size): the result is the full decoder's, error or array."""
    out = np.arange(2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)
    rid = data.draw(st.integers(1, 2**64 - 2) | st.integers(1, 200))
    calls.decode_attend_response(wire.encode_attend_response(rid, codec.to_raw(out)), rid)
    choices = [
        wire.encode_attend_response(rid, codec.to_raw(out)),
        wire.encode_attend_response(rid + 1, codec.to_raw(out)),
        wire.encode_attend_response(rid, codec.to_raw(out.reshape(4, 2, 8))),
        wire.encode_attend_response(rid, codec.to_raw(out.astype(np.float16))),
        wire.encode_attend_response(rid, None, grpc.StatusCode.NOT_FOUND.value[0], "gone"),
        wire.encode_attend_response(0, None, grpc.StatusCode.INVALID_ARGUMENT.value[0], "bad"),
        wire.encode_attend_response(0, codec.to_raw(out)),
    ]
    raw = bytearray(data.draw(st.sampled_from(choices)))
    change = data.draw(st.sampled_from(["none", "flip", "cut", "add"]))
    if change == "flip" and raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    elif change == "cut":
        del raw[data.draw(st.integers(0, len(raw))) :]
    elif change == "add":
        raw += data.draw(st.binary(min_size=1, max_size=8))
    expect = data.draw(st.sampled_from([rid, None]))
    got = decoded(bytes(raw), expect)
    assert same(got, full_decode(bytes(raw), expect)), (bytes(raw), got)


# -- the blocking data plane's socket -------------------------------------------------------------------------


class Router:
    """A fake data-plane server in a thread: a ROUTER at ``address`` that answers each request through
    ``answer(request id)`` (a list of messages to send; none: no answer)."""

    def __init__(self, address: str, answer: Callable[[int], list[list[bytes]]]) -> None:
        self.address, self.answer = address, answer
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(20):
                continue
            peer, _key, request = self.socket.recv_multipart()
            rid = pb.AttendRequest.FromString(request).request_id
            self.requests.append(rid)
            for frames in self.answer(rid):
                self.socket.send_multipart([peer, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close(linger=0)
        self.ctx.term()


OUT = np.arange(4 * 8, dtype=np.float32).reshape(1, 4, 8)


def ok(rid: int) -> list[bytes]:
    return [wire.encode_attend_response(rid, codec.to_raw(OUT * rid))]


@pytest.fixture
def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/plane.sock"


@pytest.fixture
def plane(address: str) -> Iterator[ZmqDataPlane]:
    ctx = context(asynchronous=False)
    offer = Offer("ipc", address, b"k" * KEY_BYTES, 3600.0, time.monotonic())
    p = ZmqDataPlane(offer, lambda: offer, ctx)
    yield p
    p.close()
    ctx.destroy(linger=0)


def call(plane: ZmqDataPlane, timeout_s: float | None = 10.0) -> np.ndarray:
    q = np.ones((1, 4, 8), np.float32)
    return np.array(
        plane.call(lambda rid: calls.attend_request(0, [BatchEntry("s", 0, 1)], q, request_id=rid), timeout_s)
    )


def test_each_call_gets_its_own_answer_past_late_and_malformed_ones(address: str, plane: ZmqDataPlane) -> None:
    # Before each answer: a late answer of an earlier request, one for nobody, and a two-frame message.
    # (A malformed answer, id 0, would be the oldest call's: not sent here.)
    router = Router(address, lambda rid: [ok(rid - 1)] * (rid > 1) + [ok(rid + 1000), [b"x", b"y"], ok(rid)])
    try:
        for _ in range(5):
            assert same(call(plane), OUT * router.requests[-1])
        assert router.requests == [1, 2, 3, 4, 5]
    finally:
        router.close()


def test_a_connection_lost_between_calls_is_no_calls(address: str, plane: ZmqDataPlane) -> None:
    router = Router(address, lambda rid: [ok(rid)])
    call(plane)
    router.close()  # the connection drops while no call waits ...
    time.sleep(0.3)
    router = Router(address, lambda rid: [ok(rid)])  # ... and comes back
    try:
        time.sleep(0.5)  # reconnected: both events are queued on the monitor when the next call starts
        assert same(call(plane), OUT * 2)
        assert same(call(plane), OUT * 3)
    finally:
        router.close()


def test_a_connection_lost_mid_call_is_unavailable(address: str, plane: ZmqDataPlane) -> None:
    router = Router(address, lambda rid: [] if rid == 2 else [ok(rid)])  # the second request: no answer

    def close_once_taken() -> None:
        while len(router.requests) < 2:
            time.sleep(0.01)
        router.close()

    call(plane)
    closer = threading.Thread(target=close_once_taken, daemon=True)
    closer.start()
    started = time.monotonic()
    with pytest.raises(LostConnection) as err:
        call(plane, timeout_s=None)  # no deadline: only the lost connection ends it
    closer.join()
    assert time.monotonic() - started < 5
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "was lost mid-call (ZeroMQ: DISCONNECTED)" in err.value.message
