"""A careless or hostile client against a real server, with raw bytes: every bad request gets its status and a
bounded message, changes nothing, and stalls nobody else. One test per case of issue 14, numbered as there."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from chunkattn_client import BatchEntry, BlockRows, ChunkAttnClient, ChunkAttnError, codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import MAX_MESSAGE_CHARS
from chunkattn_server.config import DEFAULT_MAX_MESSAGE_MIB
from tests.helpers.rawrpc import Answer, Raw, Watch, idle_streams, rss_mib
from tests.helpers.server_process import SMALL, ServerProcess
from tests.helpers.tensors import qkv

pytestmark = pytest.mark.server

H, HKV, D = 4, 2, 16
INVALID = grpc.StatusCode.INVALID_ARGUMENT
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "4096", "--idle-timeout-s", "0") as s:
        yield s


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[Raw]:
    with Raw(server.target) as r:
        yield r


def state(r: Raw) -> tuple[int, int]:
    info = r.info()
    return info.free_blocks, info.active_sequences


def attend_bytes(
    entries: list[tuple[str, int, int]], layer: int = 0, value: float | None = None, tokens: int | None = None
) -> bytes:
    """An AttendRequest of random (or constant) q/k/v for ``entries`` (seq_id, position, num_tokens), valid
    unless ``tokens`` (how many the tensors hold) says otherwise."""
    t = sum(n for _, _, n in entries) if tokens is None else tokens
    rng = np.random.default_rng(t)

    def tensor(*shape: int) -> wire.RawTensor:
        x = np.full(shape, value, np.float32) if value is not None else rng.standard_normal(shape, np.float32)
        return codec.to_raw(x)

    batch = [pb.SequenceEntry(seq_id=s, position=p, num_tokens=n) for s, p, n in entries]
    return wire.encode_attend_request(layer, batch, tensor(t, H, D), tensor(t, HKV, D), tensor(t, HKV, D))


def refused(answer: Answer, code: grpc.StatusCode, *words: str) -> None:
    assert answer.code == code, answer
    for w in words:
        assert w in answer.details, answer
    assert len(answer.details) <= MAX_MESSAGE_CHARS


# -- 1. malformed protobuf is INVALID_ARGUMENT on every RPC, naming the field --------------------------------

MALFORMED = {
    "a lone 0xff": (b"\xff", "byte 0: a field key"),
    "a key with no value": (b"\x08", "cut short"),
    "an 11-byte varint": (b"\x08" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
    "a length past the end": (b"\x0a\x05ab", "runs past the end"),
}
BAD_UTF8 = {  # (RPC, field number, field name)
    "Release": (1, "seq_ids"),
    "Fork": (2, "child"),
    "Truncate": (1, "seq_id"),
    "TransferKV": (2, "target"),
    "ExportKV": (1, "seq_id"),
    "Attend": (2, "entries"),  # a SequenceEntry whose seq_id is not UTF-8
}


@pytest.mark.parametrize("method", ["Info", "Release", "Fork", "Truncate", "ExportKV", "TransferKV", "Attend"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_1_malformed_bytes_are_invalid_argument_on_every_rpc(raw: Raw, method: str, case: str) -> None:
    data, words = MALFORMED[case]
    before = state(raw)
    refused(raw.call(method, data), INVALID, "not a valid chunkattn.v1.", words)
    refused(raw.stream("ImportKV", [data]), INVALID)
    assert state(raw) == before


@pytest.mark.parametrize("method", sorted(BAD_UTF8))
def test_1_bad_utf8_is_invalid_argument_naming_the_field(raw: Raw, method: str) -> None:
    number, name = BAD_UTF8[method]
    value = b"\x0a\x01\xff" if method == "Attend" else b"\xff"  # Attend: inside a SequenceEntry
    data = bytes([number << 3 | 2, len(value)]) + value
    refused(raw.call(method, data), INVALID, name, "UTF-8")


def test_1_a_shape_of_many_huge_dimensions_is_invalid_argument(raw: Raw) -> None:
    """Found by the fuzz test: the byte count of 1,000 dimensions of 2^62 has more digits than Python prints."""
    shape = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**62] * 1000)
    request = pb.AttendRequest(entries=[pb.SequenceEntry(seq_id="s", num_tokens=1)], q=shape)
    refused(raw.call("Attend", request.SerializeToString()), INVALID, "1000 dimensions; at most 8")


# -- 2. messages quote a bounded prefix and a few ids ---------------------------------------------------


def test_2_five_thousand_unknown_ids_are_not_found_with_a_short_message(raw: Raw) -> None:
    ids = [f"id-{i}" for i in range(5000)]
    answer = raw.call("Release", pb.ReleaseRequest(seq_ids=ids).SerializeToString())
    refused(answer, grpc.StatusCode.NOT_FOUND, "5000 of the 5000", "'id-0', 'id-1', 'id-2' and 4997 more")
    assert len(answer.details) < 300


def test_2_ids_repeated_by_the_hundred_thousand_are_refused_before_the_parse(server: ServerProcess, raw: Raw) -> None:
    """2 MiB of one id repeated, and 2 MiB of fields with a fault at the end: counted before protobuf parses
    them, explained within bounds, off the event loop."""
    repeated = pb.ReleaseRequest(seq_ids=["a"] * 700_000).SerializeToString()
    fault_at_end = b"\x10\x00" * 1_000_000 + b"\x0a\x01\xff"
    with Raw(server.target) as other, Watch(other.health) as health:
        time.sleep(0.05)
        answers = [raw.call("Release", repeated), raw.call("Release", fault_at_end)]
        time.sleep(0.05)
    assert health.worst < 0.1, f"health took {health.worst * 1000:.0f} ms"
    refused(answers[0], INVALID, "more than 8208 fields")
    refused(answers[1], INVALID, "more than 8208 fields")


def test_2_more_ids_than_a_call_takes_is_invalid_argument(raw: Raw) -> None:
    answer = raw.call("Release", pb.ReleaseRequest(seq_ids=[f"{i}" for i in range(8193)]).SerializeToString())
    refused(answer, INVALID, "8193 sequences to release; at most 8192")


LONG = "x" * 16384
TOO_LONG_ID = "too long: at most 256 bytes of UTF-8, got 16384"


@pytest.mark.parametrize(
    ("method", "request_bytes", "words"),
    [
        ("Release", pb.ReleaseRequest(seq_ids=[LONG]).SerializeToString(), TOO_LONG_ID),
        ("Fork", pb.ForkRequest(parent=LONG, child="c").SerializeToString(), TOO_LONG_ID),
        ("Fork", pb.ForkRequest(parent="p", child=LONG).SerializeToString(), TOO_LONG_ID),
        ("Truncate", pb.TruncateRequest(seq_id=LONG).SerializeToString(), TOO_LONG_ID),
        ("Attend", attend_bytes([(LONG, 0, 1)]), TOO_LONG_ID),
        ("ExportKV", pb.ExportKVRequest(seq_id=LONG).SerializeToString(), TOO_LONG_ID),
        (
            "TransferKV",
            pb.TransferKVRequest(seq_id="s", target="h:1", new_seq_id=LONG).SerializeToString(),
            TOO_LONG_ID,
        ),
        (
            "TransferKV",
            pb.TransferKVRequest(seq_id="s", target="a" * 60000 + ":1").SerializeToString(),
            "longer than 512",
        ),
        (
            "TransferKV",
            pb.TransferKVRequest(seq_id="s", target="a" * 65536).SerializeToString(),
            "longer than any valid",
        ),
    ],
)
def test_2_a_16_kib_id_or_a_64_kib_target_is_invalid_argument_quoting_a_prefix(
    raw: Raw, method: str, request_bytes: bytes, words: str
) -> None:
    before = state(raw)
    answer = raw.call(method, request_bytes)
    refused(answer, INVALID, words)
    assert len(answer.details) < 400
    assert state(raw) == before


# -- 3. TransferKV targets are checked before any connection ------------------------------------------------


@pytest.mark.parametrize("target", ["", "ipv4:999", "dns:///", "127.0.0.1:70000", "127.0.0.1:0"])
def test_3_an_unparseable_target_is_invalid_argument(raw: Raw, target: str) -> None:
    assert raw.call("Attend", attend_bytes([("moving", 0, 3)])).code == grpc.StatusCode.OK
    try:
        answer = raw.call("TransferKV", pb.TransferKVRequest(seq_id="moving", target=target).SerializeToString())
        refused(answer, INVALID, "is not an address", "1 <= port <= 65535")
    finally:
        raw.call("Release", pb.ReleaseRequest(seq_ids=["moving"]).SerializeToString())


@pytest.mark.parametrize("target", ["unix:/tmp/s", "unix:50051", "unix-abstract:x:1", "vsock:1:2"])
def test_27_9_a_unix_or_other_local_target_is_refused_saying_which_forms_are_accepted(raw: Raw, target: str) -> None:
    """Issue 27.9: "unix:/tmp/s" was refused for its port; "unix:50051" passed as host "unix" and gRPC would
    have connected to a Unix socket. Both are refused for what they are, with the accepted forms."""
    assert raw.call("Attend", attend_bytes([("moving", 0, 3)])).code == grpc.StatusCode.OK
    try:
        answer = raw.call("TransferKV", pb.TransferKVRequest(seq_id="moving", target=target).SerializeToString())
        refused(answer, INVALID, "scheme: TransferKV connects to other servers over TCP only", "host:port, [ipv6]:port")
        assert "port must be a number" not in answer.details
    finally:
        raw.call("Release", pb.ReleaseRequest(seq_ids=["moving"]).SerializeToString())


# -- 4, 5, 6. ImportKV headers: checked in proportion to their size, within int64, no unwritten blocks -------


def exported_header(raw: Raw, seq_id: str, tokens: int) -> pb.KVHeader:
    assert raw.call("Attend", attend_bytes([(seq_id, 0, tokens)], layer=3)).code == grpc.StatusCode.OK
    answer = raw.call("ExportKV", pb.ExportKVRequest(seq_id=seq_id).SerializeToString())
    raw.call("Release", pb.ReleaseRequest(seq_ids=[seq_id]).SerializeToString())
    return pb.KVChunk.FromString(answer.data[0]).header


def import_header(raw: Raw, header: pb.KVHeader) -> Answer:
    return raw.stream("ImportKV", [pb.KVChunk(header=header).SerializeToString()])


def test_4_a_header_claiming_layers_times_blocks_is_refused_without_stalling_anyone(
    server: ServerProcess, raw: Raw
) -> None:
    header = exported_header(raw, "h4", 5)
    header.seq_id = "forged4"
    del header.layers[:]
    header.layers.extend([3] * 3000)
    header.groups[3].logical[:] = range(4000)  # within the pool: nothing but the header's own checks refuses it
    header.num_records = 3000 * 4000
    assert len(header.SerializeToString()) > 10000
    before, rss = state(raw), rss_mib(server.proc.pid)
    with Raw(server.target) as other, Watch(other.health) as health:
        time.sleep(0.05)
        answer = import_header(raw, header)
        time.sleep(0.05)
    assert health.worst < 0.1, f"health took {health.worst * 1000:.0f} ms while the header was refused"
    refused(answer, INVALID, "twice")
    assert state(raw) == before
    assert rss_mib(server.proc.pid) - rss < 64


def test_5_a_length_past_int64_arithmetic_is_refused_at_import_and_at_attend(raw: Raw) -> None:
    header = exported_header(raw, "h5", 5)
    header.seq_id = "forged5"
    header.lengths[0] = 2**63 - 1024  # a chunked layer, with no blocks
    del header.layers[:]
    header.layers.extend([0, 3])
    header.num_records = len(header.groups[3].logical)
    before = state(raw)
    refused(import_header(raw, header), INVALID, "outside 0..2147483647")
    for position, n in ((0, 2**62), (2**63 - 1024, 1025), (2**31 - 1, 1)):
        answer = raw.call("Attend", attend_bytes([("far", position, n)], tokens=1))
        refused(answer, INVALID, "past the longest sequence served, 2147483647 tokens")
    assert state(raw) == before


def test_6_blocks_no_exported_layer_writes_are_refused(raw: Raw) -> None:
    header = exported_header(raw, "h6", 5)
    header.seq_id = "forged6"
    assert list(header.lengths) == [0, 0, 0, 5]
    assert list(header.layers) == [0, 1, 2, 3]
    header.groups[0].logical[:] = range(20)  # layer 0's group, whose length is 0: nothing would write them
    header.num_records = 20 + len(header.groups[3].logical)
    before = state(raw)
    refused(import_header(raw, header), INVALID, "KV group 0", "need exactly the 0 blocks")
    assert state(raw) == before


# -- 7. an export carries only what the sequence wrote -------------------------------------------------------


def test_7_an_export_never_carries_bytes_of_a_released_sequence() -> None:
    """Every block of every layer is first filled with 7.0 by sequences then released; a 1-token sequence
    then reads and exports 1.0 and zeros, whichever blocks it got."""
    flags = ["--layers", "3", "--chunk-size", "32", "--global-every", "0", "--heads", "4", "--kv-heads", "2"]
    flags += ["--head-size", "16", "--block-size", "4", "--num-blocks", "48", "--idle-timeout-s", "0"]
    with ServerProcess(*flags) as s, Raw(s.target) as raw:
        olds = [f"old-{i}" for i in range(12)]  # 12 x 4 blocks of 16 tokens: the whole pool, all 3 layers
        for layer in range(3):
            assert raw.call("Attend", attend_bytes([(o, 0, 16) for o in olds], layer, value=7.0)).code.name == "OK"
        assert raw.info().free_blocks == 0
        raw.call("Release", pb.ReleaseRequest(seq_ids=olds).SerializeToString())
        for layer in range(3):
            answer = raw.call("Attend", attend_bytes([("new", 0, 1)], layer, value=1.0))
            out = np.frombuffer(pb.AttendResponse.FromString(answer.data).output.data, np.float32)
            assert np.all(out == 1.0)  # attention over its one key, whose value is 1.0
        chunks = [pb.KVChunk.FromString(c) for c in raw.call("ExportKV", b"\x0a\x03new").data]
        records = [r for c in chunks if c.HasField("blocks") for r in c.blocks.blocks]
        assert len(records) == 3
        for r in records:
            for data in (r.k, r.v):
                rows = np.frombuffer(data, np.float32).reshape(HKV, 4, D)
                assert np.all(rows[:, 0] == 1.0)
                assert not rows[:, 1:].any()


# -- 8, 9, 10. no client stalls the rest -------------------------------------------------------------------


def test_8_a_million_entries_are_refused_without_stalling_health(server: ServerProcess, raw: Raw) -> None:
    entry = pb.AttendRequest(entries=[pb.SequenceEntry(seq_id="e", position=0, num_tokens=1)]).SerializeToString()
    data = entry * 1_000_000
    assert len(data) > 6 << 20
    with Raw(server.target) as other, Watch(other.health) as health:
        time.sleep(0.05)
        answer = raw.call("Attend", data)
        time.sleep(0.05)
    assert health.worst < 0.1, f"health took {health.worst * 1000:.0f} ms while 1M entries were refused"
    refused(answer, INVALID, "at most 8192")


def test_9_idle_streams_hold_nothing_and_are_closed_after_stream_idle_s() -> None:
    flags = [*SMALL, "--stream-idle-s", "2", "--max-concurrent-rpcs", "8"]
    with ServerProcess(*flags) as s, Raw(s.target) as raw, idle_streams(raw.channel, 64) as calls:
        time.sleep(0.5)
        assert raw.health().data == 1  # SERVING
        assert raw.call("Info", b"").code == grpc.StatusCode.OK
        assert raw.call("Attend", attend_bytes([("busy", 0, 1)])).code == grpc.StatusCode.OK
        started = time.monotonic()
        codes = set()
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            codes.add(err.value.code())
            assert "sent nothing for 2 s" in (err.value.details() or "")
        assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert time.monotonic() - started < 10


def test_10_requests_past_the_byte_budget_are_refused_at_once_naming_the_flag() -> None:
    """A slow prefill holds 15 MiB of the 64 MiB budget; of two 39 MiB requests arriving meanwhile, one is
    admitted and the other refused."""
    flags = [
        *SMALL,
        "--max-message-mib",
        "64",
        "--max-inflight-mib",
        "64",
        "--num-blocks",
        "16384",
        "--max-call-work",
        "0",
    ]
    with ServerProcess(*flags, "--idle-timeout-s", "0") as s, Raw(s.target) as raw:
        slow = attend_bytes([("slow", 0, 30000)], layer=3)  # global causal attention over 30,000 tokens
        big = [attend_bytes([(f"big-{i}", 0, 80000)]) for i in range(2)]
        assert 14 << 20 < len(slow) < 16 << 20
        assert all(38 << 20 < len(b) < 40 << 20 for b in big)
        peak = rss_mib(s.proc.pid, "VmHWM")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(raw.call, "Attend", slow)
            time.sleep(0.3)
            answers = list(pool.map(lambda b: raw.call("Attend", b), big))
            assert first.result().code == grpc.StatusCode.OK
        codes = sorted(a.code.name for a in answers)
        assert codes == ["OK", "RESOURCE_EXHAUSTED"], answers
        (no,) = [a for a in answers if a.code != grpc.StatusCode.OK]
        refused(no, grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-inflight-mib", "64 MiB")
        assert rss_mib(s.proc.pid, "VmHWM") - peak < 4 * 64 + 100  # a bounded multiple of the budget


# -- the whole at once: a maximum-size bad request and 64 idle streams ------------------------------------


def test_health_and_a_decode_are_answered_within_100_ms_under_a_maximum_size_bad_request_and_idle_streams(
    server: ServerProcess, raw: Raw
) -> None:
    """A request of the largest size the server takes by default, all empty SequenceEntries (8M fields in
    16 MiB), sent by another process, beside 64 streams that never send."""
    fields = (DEFAULT_MAX_MESSAGE_MIB << 20) // 2 - 8
    sender = [sys.executable, "-c", SEND_BAD, server.target, str(fields)]
    with ChunkAttnClient(server.target, timeout_s=30) as c:
        q, kv = np.ones((1, H, D), np.float32), np.ones((1, HKV, D), np.float32)
        c.attend(0, [BatchEntry("decoder", 0, 1)], q, kv, kv)
        position = [1]

        def decode() -> float:
            c.attend(0, [BatchEntry("decoder", position[0], 1)], q, kv, kv)
            position[0] += 1
            return 0.0

        with (
            idle_streams(raw.channel, 64),
            Raw(server.target) as other,
            Watch(other.health) as health,
            Watch(decode) as decodes,
        ):
            time.sleep(0.1)
            bad = subprocess.run(sender, capture_output=True, text=True, timeout=120, check=True, cwd=ROOT).stdout
            time.sleep(0.1)
        c.release(["decoder"])
    assert len(health.seconds) > 5
    assert len(decodes.seconds) > 5
    assert all(a.data == 1 for a in health.results)  # SERVING
    print(f"health worst {health.worst * 1000:.0f} ms, decode worst {decodes.worst * 1000:.0f} ms")
    assert health.worst < 0.1, f"health: worst {health.worst * 1000:.0f} ms"
    assert decodes.worst < 0.1, f"decode: worst {decodes.worst * 1000:.0f} ms"
    assert bad.startswith("INVALID_ARGUMENT"), bad
    assert "at most 8192" in bad, bad


SEND_BAD = """
import sys
from tests.helpers.rawrpc import Raw
with Raw(sys.argv[1]) as r:
    answer = r.call("Attend", b"\\x12\\x00" * int(sys.argv[2]))
print(answer.code.name, answer.details)
"""


def test_the_client_sees_chunkattn_errors_for_these_too(server: ServerProcess) -> None:
    with ChunkAttnClient(server.target) as c, pytest.raises(ChunkAttnError) as err:
        c.release(["y" * 300])
    assert err.value.code == INVALID


# -- issue 27: the second hostile review ------------------------------------------------------------------

CACHES = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("cache", CACHES)
def test_27_7_a_non_finite_q_k_or_v_is_refused_naming_its_row_and_writes_nothing(cache: str) -> None:
    """Issue 27.7: a NaN or inf query came back as an exact-zero row. Now NaN, inf, and values past the
    compute dtype's range are INVALID_ARGUMENT naming the tensor, row, sequence and position, in a prefill,
    a single-token call and a merged decode, and the sequences are as if the call had not been sent."""
    with (
        ServerProcess(*SMALL, "--num-blocks", "512", "--idle-timeout-s", "0", "--kv-cache-dtype", cache) as s,
        ChunkAttnClient(s.target) as c,
    ):
        rng = np.random.default_rng(27)
        c.attend(0, [BatchEntry("a", 0, 20), BatchEntry("b", 0, 3)], *qkv(rng, 23))
        free = c.info().free_blocks
        cases = [  # (entries, which tensor, row, bad value, what the message says)
            ([BatchEntry("p", 0, 5)], 0, 3, np.nan, "q row 3 (sequence 'p' at position 3) holds nan"),
            ([BatchEntry("a", 20, 1)], 1, 0, np.inf, "k row 0 (sequence 'a' at position 20) holds inf"),
            ([BatchEntry("a", 20, 1), BatchEntry("b", 3, 1)], 2, 1, -np.inf, "v row 1 (sequence 'b' at position 3)"),
            ([BatchEntry("a", 20, 2)], 0, 1, np.nan, "q row 1 (sequence 'a' at position 21) holds nan"),
        ]
        if cache == "float16":  # a finite float32 past float16's range would become inf in the compute
            cases.append(([BatchEntry("b", 3, 1)], 1, 0, 1e6, "holds 1e+06, past float16's largest value 65504"))
        for entries, which, row, value, message in cases:
            tensors = list(qkv(rng, sum(e.num_tokens for e in entries)))
            tensors[which][row, 1, 2] = value
            with pytest.raises(ChunkAttnError) as e:
                c.attend(0, entries, *tensors)
            assert e.value.code == INVALID, e.value
            assert message in str(e.value), e.value
            assert "Nothing was written" in str(e.value), e.value
            assert c.info().free_blocks == free
            assert c.info().active_sequences == 2
        # Nothing was written: "a" and "b" go on at 20 and 3, and "p" starts afresh.
        c.attend(0, [BatchEntry("a", 20, 1), BatchEntry("b", 3, 1), BatchEntry("p", 0, 2)], *qkv(rng, 4))


def start_fails(*flags: str) -> str:
    """Start a server that must refuse to start; returns what it printed."""
    cmd = [sys.executable, "-m", "chunkattn_server", "--port", "0", "--metrics-port", "0", *SMALL, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def test_27_2_a_first_write_cannot_set_zero_or_denormal_scales_and_tenants_cannot_calibrate(tmp_path: Path) -> None:
    """Issue 27.2: a first write of zeros and one 1e-44 calibrated every scale to 0 and every later output was
    exact zeros. Such a write is refused and calibrates nothing; with tenants, calibrate is refused at start."""
    flags = ["--num-blocks", "512", "--kv-cache-dtype", "fp8_e4m3", "--kv-scales", "calibrate"]
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"tenants": {"a": {"tokens_sha256": ["' + "0" * 64 + '"]}}}')
    tokens.chmod(0o600)
    assert "on a server with tenants (--auth-tokens) give the scales in a --kv-scales file" in start_fails(
        *flags, "--auth-tokens", str(tokens)
    )
    with ServerProcess(*SMALL, *flags) as s, ChunkAttnClient(s.target) as c:
        rng = np.random.default_rng(2)
        q = rng.standard_normal((4, H, D), np.float32)
        k, v = np.zeros((4, HKV, D), np.float32), np.zeros((4, HKV, D), np.float32)
        k[1, 0, 0] = v[2, 1, 1] = 1e-44
        with pytest.raises(ChunkAttnError) as e:
            c.attend(0, [BatchEntry("s", 0, 4)], q, k, v)
        assert e.value.code == INVALID
        assert "the smallest this cache can be read back over" in str(e.value)
        assert "--kv-scales" in str(e.value)
        assert c.info().layers[0].k_scale == 0.0  # still to calibrate
        assert c.info().active_sequences == 0
        k, v = rng.standard_normal((4, HKV, D), np.float32), rng.standard_normal((4, HKV, D), np.float32)
        out = c.attend(0, [BatchEntry("s", 0, 4)], q, k, v)
        layer = c.info().layers[0]
        assert layer.k_scale == np.float32(np.abs(k).max() / 200)
        assert layer.v_scale == np.float32(np.abs(v).max() / 100)
        assert np.isfinite(out).all()
        assert np.abs(out).max() > 0.01


def test_27_3_and_27_4_scales_that_would_read_back_as_zero_or_inf_stop_the_start(tmp_path: Path) -> None:
    path = tmp_path / "scales.json"
    fp8 = ["--kv-cache-dtype", "fp8_e4m3", "--kv-scales", str(path)]
    for content, message in [
        ('{"k_scale": 1e-50, "v_scale": 1e-50}', "got 0 as a float32 (the file says 1e-50)"),
        ('{"k_scale": 1e39, "v_scale": 1}', "got inf as a float32 (the file says 1e+39)"),
        ('{"k_scale": 1, "kscale": 2, "v_scale": 1}', "unknown keys ['kscale']"),
        ('{"k_scale": 1, "v_scale": 1, "calibrate": "no"}', '"calibrate" must be true or false'),
        ('{"k_scale": [], "v_scale": []}', "k_scale is an empty list"),
    ]:
        path.write_text(content)
        assert message in start_fails(*fp8), content
    path.write_text('{"k_scale": 1.0, "v_scale": 2.0}')
    e5m2 = ["--dtype", "float16", "--kv-cache-dtype", "fp8_e5m2", "--kv-scales", str(path)]
    assert "v_scale 2 times float8_e5m2's largest value 57344 is past float16's largest, 65504" in start_fails(*e5m2)


# -- issue 35: the third hostile review -------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["float32", "fp8_e4m3"])
def test_35_3_finite_inputs_never_give_nan_and_values_past_the_bounds_are_refused(cache: str) -> None:
    """Issue 35.3: q = k = 1e20 gave NaN in every row of a prefill and a decode, q = 3e38 NaN in a decode. Such
    values are INVALID_ARGUMENT naming the tensor and the bound (2^48 for SMALL's head size 16, |v| 2^64), and
    values at the bounds, signs chosen for the largest scores, give finite outputs within v's range."""
    bound, v_bound = 2.0**48, 2.0**64
    with (
        ServerProcess(*SMALL, "--num-blocks", "512", "--idle-timeout-s", "0", "--kv-cache-dtype", cache) as s,
        ChunkAttnClient(s.target) as c,
    ):
        for layer in (0, 3):  # chunked and global
            for entries, value, which, words in (
                ([BatchEntry(f"p{layer}", 0, 12)], 1e20, (0, 1), "q row 11 (sequence 'p"),
                ([BatchEntry(f"d{layer}", 0, 1)], 3e38, (0,), "q row 0"),
                ([BatchEntry(f"v{layer}", 0, 3)], 3e38, (2,), "v row 2"),
            ):
                n = entries[0].num_tokens
                tensors = [np.ones((n, h, D), np.float32) for h in (H, HKV, HKV)]
                for w in which:
                    tensors[w][-1] = value
                with pytest.raises(ChunkAttnError) as e:
                    c.attend(layer, entries, *tensors)
                assert e.value.code == INVALID, e.value
                assert words in e.value.message, e.value
                assert "(2^48)" in e.value.message or "(2^64)" in e.value.message, e.value
                assert "Nothing was written" in e.value.message
            assert c.info().active_sequences == (1 if layer else 0)  # b0 below, and none of the refused
            # at the bounds: prefill then decodes, every output finite and within v's range
            for position, n in ((0, 9), (9, 1), (10, 1)):
                q = np.full((n, H, D), bound, np.float32)
                k = np.full((n, HKV, D), bound, np.float32)
                k[:, :, 1::2] = -bound
                v = np.full((n, HKV, D), v_bound, np.float32)
                out = np.asarray(c.attend(layer, [BatchEntry(f"b{layer}", position, n)], q, k, v))
                assert np.isfinite(out).all(), (layer, position)
                assert np.abs(out).max() <= v_bound * 1.01


@pytest.fixture(scope="module")
def bounded() -> Iterator[ServerProcess]:
    """A server whose calls may ask for at most 50,000 work (query-key pairs, and 8,192 per piece apart)."""
    with ServerProcess(*SMALL, "--num-blocks", "4096", "--idle-timeout-s", "0", "--max-call-work", "50000") as s:
        yield s


def test_35_4_a_call_past_the_work_bound_is_refused_naming_it_and_stalls_nobody(bounded: ServerProcess) -> None:
    """Issue 35.4: one 5 MB block request (256 decode rows x 65,536 keys) held the engine 10.8 s, and a long global
    prefill could do the same. A call asking for more work than --max-call-work (its query-key pairs, and 8,192
    for each piece the engine computes apart) is INVALID_ARGUMENT naming both, and writes nothing; the same work
    in calls within the bound is served; another client's decodes go on meanwhile."""
    piece = 8192
    with ChunkAttnClient(bounded.target) as c, ChunkAttnClient(bounded.target) as other:
        assert c.info().max_call_work == 50_000
        rng = np.random.default_rng(35)

        def refused_for(work: int, call: Callable[[], object]) -> None:
            with pytest.raises(ChunkAttnError) as e:
                call()
            assert e.value.code == INVALID, e.value
            assert f"the call's work is {work:,} (the keys each new token sees" in e.value.message, e.value
            assert "at most 50,000 per call (--max-call-work" in e.value.message, e.value

        other.attend(0, [BatchEntry("victim", 0, 1)], *qkv(rng, 1))
        step = [1]

        def decode() -> None:
            other.attend(0, [BatchEntry("victim", step[0], 1)], *qkv(rng, 1))
            step[0] += 1

        with Watch(decode) as decodes:
            # the global layer: 400 tokens see 1 + 2 + ... + 400 = 80,200 keys, in one piece
            refused_for(80_200 + piece, lambda: c.attend(3, [BatchEntry("long", 0, 400)], *qkv(rng, 400)))
            for first in range(0, 400, 100):  # in four calls: the last asks for 35,050 + 8,192
                c.attend(3, [BatchEntry("long", first, 100)], *qkv(rng, 100))
            # a chunked layer (C = 16): 400 tokens see at most 16 keys each (3,400), in 25 pieces
            refused_for(3_400 + 25 * piece, lambda: c.attend(0, [BatchEntry("long", 0, 400)], *qkv(rng, 400)))
            for first in range(0, 400, 80):  # 5 chunks a call
                c.attend(0, [BatchEntry("long", first, 80)], *qkv(rng, 80))
            # block rows: 200 decodes over 256 keys (63 blocks shared, the last each row's own): 51,200 pairs
            space = c.open_block_space(300)
            tables = np.concatenate([np.tile(np.arange(63), (200, 1)), 63 + np.arange(200)[:, None]], axis=1)
            slots = (63 + np.arange(200)) * 4 + 3

            def rows(n: int, padding: int = 0) -> BlockRows:
                written = np.where(np.arange(n) < padding, -1, slots[:n])
                return BlockRows(space.space_id, written, np.arange(n + 1), np.full(n, 256), tables[:n])

            refused_for(51_200, lambda: c.attend_blocks(3, rows(200), *qkv(rng, 200)))
            c.attend_blocks(3, rows(100), *qkv(rng, 100))
            c.attend_blocks(3, rows(100, padding=50), *qkv(rng, 100))  # padding decodes: their keys, as written ones
            refused_for(51_200, lambda: c.attend_blocks(3, rows(200, padding=100), *qkv(rng, 200)))
        assert len(decodes.seconds) > 2
        assert decodes.worst < 0.5, f"decode: worst {decodes.worst * 1000:.0f} ms"
