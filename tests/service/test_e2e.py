"""End to end: the real server in a subprocess, reached only through the client, checked against the reference."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from chunkattn_client import BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel, codec
from chunkattn_client._channel import MIN_KEEPALIVE_S, channel_options
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2_grpc as pb_grpc
from chunkattn_client.reference import within_tolerance
from chunkattn_server.config import DEFAULT_MAX_MESSAGE_MIB
from tests.helpers.harness import NATIVE_PROBLEM
from tests.helpers.server_process import SMALL, ServerProcess, connections

pytestmark = pytest.mark.server

H, HKV, D = 4, 2, 16
CHUNKS = [16, 16, 16, 0]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "4096", "--idle-timeout-s", "0") as s:
        yield s


@pytest.fixture
def client(server: ServerProcess) -> Iterator[ChunkAttnClient]:
    with ChunkAttnClient(server.target, timeout_s=60) as c:
        yield c


class Runner:
    """Sends calls through the client (unary or stream) and checks them against the reference."""

    def __init__(self, call: Any, dtype: str = "float32", seed: int = 0) -> None:
        self.call = call
        self.dtype = dtype
        self.rng = np.random.default_rng(seed)
        self.ref = ReferenceModel(CHUNKS)

    def _tensor(self, *shape: int) -> tuple[np.ndarray, np.ndarray]:
        """(what is sent, its float64 value): float32/float16 arrays, or bfloat16 words."""
        x = self.rng.standard_normal(shape).astype(np.float32)
        if self.dtype == "bfloat16":
            words = codec.float32_to_bf16(x)
            return words, codec.bf16_to_float32(words).astype(np.float64)
        sent = x.astype(self.dtype)
        return sent, sent.astype(np.float64)

    def step(self, layer: int, entries: list[BatchEntry], **kw: Any) -> np.ndarray:
        t = sum(e.num_tokens for e in entries)
        (q, q64), (k, k64), (v, v64) = self._tensor(t, H, D), self._tensor(t, HKV, D), self._tensor(t, HKV, D)
        dtype = "bfloat16" if self.dtype == "bfloat16" else None
        out = self.call(layer, entries, q, k, v, dtype=dtype, **kw)
        want = self.ref.attend(layer, entries, q64, k64, v64)
        ok, err = within_tolerance(codec.to_float64(out, self.dtype), want, self.dtype)
        assert ok, f"layer {layer}: error {err} is over the {self.dtype} tolerance"
        return np.asarray(out)

    def model_step(self, entries: list[BatchEntry]) -> None:
        for layer in range(len(CHUNKS)):
            self.step(layer, entries)


# -- agreement with the reference ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_results_match_the_reference(client: ChunkAttnClient, dtype: str, transport: str) -> None:
    """Prefill across two chunk boundaries, then decodes across the next, in every layer; two sequences."""
    a, b = f"{transport}-{dtype}-a", f"{transport}-{dtype}-b"
    if transport == "unary":
        r = Runner(client.attend, dtype)
        _session(r, a, b)
    else:
        with client.stream() as stream:
            r = Runner(stream.attend, dtype)
            _session(r, a, b)
    client.release([a, b])


def _session(r: Runner, a: str, b: str) -> None:
    r.model_step([BatchEntry(a, 0, 40), BatchEntry(b, 0, 3)])
    for i in range(10):  # a crosses 48
        r.model_step([BatchEntry(a, 40 + i, 1), BatchEntry(b, 3 + i, 1)])


def test_info_describes_the_model_and_the_pool(client: ChunkAttnClient) -> None:
    info = client.info()
    assert (info.num_heads, info.num_kv_heads, info.head_size, info.block_size) == (H, HKV, D, 4)
    assert [layer.chunk_size for layer in info.layers] == CHUNKS
    assert info.layers[3].kv_source is None
    assert info.num_blocks == 4096
    assert info.cache_dtype == "float32"
    assert set(info.dtypes) == {"float32", "float16", "bfloat16"}
    assert (info.backend, info.device) == ("torch" if NATIVE_PROBLEM else "native", "cpu")  # auto on the CPU
    assert info.max_message_bytes == DEFAULT_MAX_MESSAGE_MIB << 20


# -- standard services, metrics ---------------------------------------------------------------------


def test_standard_health_and_reflection(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "chunkattn.v1.ChunkAttn"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"chunkattn.v1.ChunkAttn", "grpc.health.v1.Health"} <= names


def test_reflection_v1_lists_and_describes_every_service(server: ServerProcess) -> None:
    """grpc.reflection.v1 (what grpcurl asks first) answers like v1alpha: the file descriptors it returns
    build, in a fresh pool, the services the server actually serves, v1 reflection itself included."""
    v1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(server.target) as channel:
        call = channel.stream_stream(
            v1,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        names = [s.name for r in call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
                 for s in r.list_services_response.service]  # fmt: skip
        asks = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=n) for n in names]
        answers = list(call(iter(asks), timeout=10))
        missing = list(
            call(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such")]), timeout=10)
        )
    assert {"chunkattn.v1.ChunkAttn", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} == set(names)  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for a in answers
             for b in a.file_descriptor_response.file_descriptor_proto]  # fmt: skip
    added: set[str] = set()
    for _ in files:  # dependencies first (each pass adds at least one file when none is missing)
        for f in files:
            if f.name not in added and set(f.dependency) <= added | {"google/protobuf/descriptor.proto"}:
                pool.Add(f)
                added.add(f.name)
    assert added == {f.name for f in files}, "a returned file's dependency was not returned"
    assert "Attend" in [m.name for m in pool.FindServiceByName("chunkattn.v1.ChunkAttn").methods]
    assert pool.FindServiceByName("grpc.reflection.v1.ServerReflection").methods[0].name == "ServerReflectionInfo"
    assert missing[0].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_a_drain_says_so_on_every_probe_and_refuses_new_calls_until_it_stops() -> None:
    with ServerProcess(*SMALL, "--drain-delay-s", "3") as s, grpc.insecure_channel(s.target) as channel:
        base = s.metrics_url.removesuffix("/metrics")
        with urllib.request.urlopen(base + "/readyz", timeout=10) as r:
            assert r.status == 200
        s.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 10
        while (
            health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            != health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/readyz", timeout=10)
        assert e.value.code == 503
        assert e.value.read().decode().startswith("draining")
        with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
            assert r.status == 200  # draining is not dead
        with ChunkAttnClient(s.target, timeout_s=5) as c, pytest.raises(ChunkAttnError) as refused:
            c.info()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.message
        assert s.proc.wait(30) == 0


def test_healthz_and_readyz_on_the_metrics_port(server: ServerProcess) -> None:
    base = server.metrics_url.removesuffix("/metrics")
    for path, body in (("/healthz", "ok"), ("/readyz", "ready")):
        with urllib.request.urlopen(base + path, timeout=10) as r:
            assert (r.status, r.read().decode().strip()) == (200, body)
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        assert b"chunkattn_build_info" in r.read()


def test_metrics_parse_and_count_what_was_sent(server: ServerProcess, client: ChunkAttnClient) -> None:
    before = server.metrics()
    r = Runner(client.attend, seed=7)
    r.step(0, [BatchEntry("m1", 0, 30), BatchEntry("m2", 0, 1)])
    r.step(0, [BatchEntry("m1", 30, 1), BatchEntry("m2", 1, 1)])
    with pytest.raises(ChunkAttnError):
        client.attend(
            0, [BatchEntry("m1", 0, 1)], np.zeros((1, H, D), np.float32), *([np.zeros((1, HKV, D), np.float32)] * 2)
        )
    client.release(["m1", "m2"])
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("chunkattn_tokens_total", kind="prefill") == 30
    assert delta("chunkattn_tokens_total", kind="decode") == 3
    assert delta("chunkattn_requests_total", rpc="Attend", code="OK", transport="grpc") == 2
    assert delta("chunkattn_requests_total", rpc="Attend", code="FAILED_PRECONDITION", transport="grpc") == 1
    assert delta("chunkattn_requests_total", rpc="Release", code="OK", transport="grpc") == 1
    assert delta("chunkattn_received_bytes_total") == 4 * 33 * (H + 2 * HKV) * D
    assert delta("chunkattn_sent_bytes_total") == 4 * 33 * H * D
    assert delta("chunkattn_compute_seconds_count", rpc="Attend") == 3
    assert after[("chunkattn_kv_blocks", ())] == 4096
    assert after[("chunkattn_kv_blocks_used", ())] == 0


# -- the error matrix: precise statuses, nothing changed --------------------------------------------


def _raw(layer: int, entries: list[tuple[str, int, int]], q: Any, k: Any = None, v: Any = None) -> pb.AttendRequest:
    return pb.AttendRequest(
        layer=layer,
        entries=[pb.SequenceEntry(seq_id=s, position=p, num_tokens=n) for s, p, n in entries],
        q=q,
        k=k,
        v=v,
    )


def _t(*shape: int, dtype: Any = pb.DTYPE_FLOAT32, extra: int = 0) -> pb.Tensor:
    n = int(np.prod(shape)) * 4 + extra
    return pb.Tensor(dtype=dtype, shape=shape, data=b"\0" * n)


def _ok(*, layer: int = 0, seqs: tuple[tuple[str, int, int], ...] = (("v", 3, 1),), **tensors: Any) -> pb.AttendRequest:
    """A request that would be served, but for the tensors or metadata overridden by the caller."""
    t = sum(n for _, _, n in seqs)
    parts = {"q": _t(t, H, D), "k": _t(t, HKV, D), "v": _t(t, HKV, D)}
    parts.update(tensors)
    return _raw(layer, list(seqs), parts["q"], parts["k"], parts["v"])


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
BAD: dict[str, tuple[Any, grpc.StatusCode, str]] = {
    "unknown dtype enum": (_ok(q=_t(1, H, D, dtype=7)), INVALID, "unknown tensor dtype 7"),
    "unspecified dtype": (_ok(q=_t(1, H, D, dtype=0)), INVALID, "unknown tensor dtype 0"),
    "byte count": (_ok(q=_t(1, H, D, extra=2)), INVALID, "needs 256 bytes, got 258"),
    "shape": (_ok(k=_t(1, H, D)), INVALID, "k has shape"),
    "tokens disagree with metadata": (_ok(seqs=(("v", 3, 2),), q=_t(1, H, D)), INVALID, "expected [2, 4, 16]"),
    "unknown layer": (_ok(layer=4), INVALID, "layers 0..3"),
    "zero tokens": (_ok(seqs=(("v", 3, 0),)), INVALID, "num_tokens must be"),
    "negative position": (_ok(seqs=(("n", -1, 1),)), INVALID, "position must be"),
    "sequence twice": (_ok(seqs=(("v", 3, 1), ("v", 3, 1))), INVALID, "appears twice"),
    "missing q": (_ok(q=None), INVALID, "q is missing"),
    "k without v": (_ok(v=None), INVALID, "both k and v"),
    "unknown sequence": (_ok(seqs=(("ghost", 5, 1),)), NOT_FOUND, "does not exist"),
    "wrong position": (_ok(seqs=(("v", 2, 1),)), grpc.StatusCode.FAILED_PRECONDITION, "next position is 3"),
    "new sequence, then a wrong position": (
        _ok(seqs=(("fresh", 0, 2), ("v", 2, 1))),
        grpc.StatusCode.FAILED_PRECONDITION,
        "next position is 3",
    ),
    "new sequence, then an unknown one": (_ok(seqs=(("fresh", 0, 2), ("ghost", 5, 1))), NOT_FOUND, "'ghost'"),
    "empty batch": (_ok(seqs=()), INVALID, "the batch is empty"),
    "empty seq_id": (_ok(seqs=(("", 0, 1),)), INVALID, "seq_id must be a non-empty string"),
    "k dtype differs from q": (_ok(k=_t(1, HKV, D, dtype=pb.DTYPE_FLOAT16, extra=-64)), INVALID, "expected q's dtype"),
    "negative dimension": (_ok(q=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, H, D])), INVALID, "negative dimension"),
    "message too large": (
        _ok(q=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1], data=b"\0" * (257 << 20))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_gets_a_precise_status_and_changes_nothing(
    server: ServerProcess, client: ChunkAttnClient, case: str
) -> None:
    """'v' (victim) and 'w' (witness) get identical inputs; the bad request hits only 'v'."""
    request, code, message = BAD[case]
    victim, witness = Runner(client.attend, seed=1), Runner(client.attend, seed=1)
    victim_ids = [BatchEntry("v", 0, 3)]
    out_v = victim.step(0, victim_ids)
    out_w = witness.step(0, [BatchEntry("w", 0, 3)])
    assert np.array_equal(out_v, out_w)
    info_before = client.info()
    options = [("grpc.max_send_message_length", 300 << 20)]
    with grpc.insecure_channel(server.target, options=options) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.ChunkAttnStub(channel).Attend(request, timeout=60)
    assert err.value.code() == code
    assert message in (err.value.details() or "")
    info_after = client.info()
    assert (info_after.free_blocks, info_after.active_sequences) == (
        info_before.free_blocks,
        info_before.active_sequences,
    )
    for pos in (3, 4, 5):
        assert np.array_equal(victim.step(0, [BatchEntry("v", pos, 1)]), witness.step(0, [BatchEntry("w", pos, 1)]))
    client.release(["v", "w"])


def test_stream_reports_an_error_on_its_response_and_stays_usable(client: ChunkAttnClient) -> None:
    with client.stream() as stream:
        r = Runner(stream.attend, seed=3)
        r.step(0, [BatchEntry("st", 0, 5)])
        with pytest.raises(ChunkAttnError) as err:
            stream.attend(
                0,
                [BatchEntry("st", 9, 1)],
                np.zeros((1, H, D), np.float32),
                np.zeros((1, HKV, D), np.float32),
                np.zeros((1, HKV, D), np.float32),
            )
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        r.step(0, [BatchEntry("st", 5, 2)])
    client.release(["st"])


def test_a_stream_call_without_an_answer_times_out_and_cancels_the_stream() -> None:
    """A stopped server (SIGSTOP) never answers: the call gives up after the client's timeout_s."""
    q = np.zeros((1, H, D), np.float32)
    kv = np.zeros((1, HKV, D), np.float32)
    with ServerProcess(*SMALL) as stalled, ChunkAttnClient(stalled.target, timeout_s=1) as c:
        stream = c.stream()
        stream.attend(0, [BatchEntry("late", 0, 1)], q, kv, kv)  # answered
        stalled.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(ChunkAttnError) as err:
                stream.attend(0, [BatchEntry("late", 1, 1)], q, kv, kv)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "within 1 s" in err.value.message
            assert time.monotonic() - started < 5
            with pytest.raises(ChunkAttnError) as err:  # cancelled: later calls fail at once
                stream.attend(0, [BatchEntry("late", 1, 1)], q, kv, kv)
            assert err.value.code == grpc.StatusCode.CANCELLED
            stream.close()  # returns: nothing left to wait for
        finally:
            stalled.proc.send_signal(signal.SIGCONT)


def test_a_stream_dropped_without_close_is_cancelled(client: ChunkAttnClient) -> None:
    """Its reader thread holds only the call, so the stream is collected, cancelled, and the thread ends."""
    before = set(threading.enumerate())
    stream = client.stream()
    (reader,) = [t for t in set(threading.enumerate()) - before if t.name == "chunkattn-stream-reader"]
    Runner(stream.attend, seed=5).step(0, [BatchEntry("dropped", 0, 3)])
    del stream
    gc.collect()
    reader.join(10)
    assert not reader.is_alive()
    client.release(["dropped"])


def test_kv_pool_full_is_resource_exhausted_with_nothing_allocated() -> None:
    with (
        ServerProcess(*SMALL, "--num-blocks", "16", "--idle-timeout-s", "0") as small,
        ChunkAttnClient(small.target) as c,
    ):
        r = Runner(c.attend)
        r.step(3, [BatchEntry("fits", 0, 20)])  # global layer: 5 blocks
        free = c.info().free_blocks
        with pytest.raises(ChunkAttnError) as err:
            r.step(3, [BatchEntry("fits", 20, 1), BatchEntry("big", 0, 100)])
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "needs 26 new KV blocks" in err.value.message  # 1 for "fits" at 20, 25 for "big"
        assert c.info().free_blocks == free
        assert c.info().active_sequences == 1


def test_kv_sharing_layer_refuses_k_and_v() -> None:
    layers = [{"chunk_size": 16}, {"chunk_size": 16, "kv_source": 0}]
    config = {"heads": H, "kv_heads": HKV, "head_size": D, "block_size": 4, "num_blocks": 256, "layers": layers}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(config, f)
        f.flush()
        with ServerProcess("--config", f.name) as s, ChunkAttnClient(s.target) as c:
            assert [layer.kv_source for layer in c.info().layers] == [None, 0]
            z = np.zeros((1, H, D), np.float32), np.zeros((1, HKV, D), np.float32)
            c.attend(0, [BatchEntry("s", 0, 1)], z[0], z[1], z[1])
            with pytest.raises(ChunkAttnError) as err:
                c.attend(1, [BatchEntry("s", 0, 1)], z[0], z[1], z[1])
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "KV sharing" in err.value.message
            c.attend(1, [BatchEntry("s", 0, 1)], z[0])  # q only: served


# -- release, end of sequence, idle eviction --------------------------------------------------------


def test_release_and_end_of_sequence_return_every_block(client: ChunkAttnClient) -> None:
    total = client.info().num_blocks
    r = Runner(client.attend, seed=5)
    r.model_step([BatchEntry("r1", 0, 21), BatchEntry("r2", 0, 7)])
    assert client.info().free_blocks < total
    assert client.release(["r1"]) == 1
    with pytest.raises(ChunkAttnError) as err:
        client.release(["r1"])
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert client.release(["r1"], missing_ok=True) == 0
    r.step(0, [BatchEntry("r2", 7, 1)], end_of_sequence=["r2"])
    assert client.info().free_blocks == total
    with pytest.raises(ChunkAttnError) as err:
        r.step(0, [BatchEntry("r2", 8, 1)])
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_idle_sequences_are_evicted() -> None:
    with ServerProcess(*SMALL, "--num-blocks", "256", "--idle-timeout-s", "1") as s, ChunkAttnClient(s.target) as c:
        Runner(c.attend).step(0, [BatchEntry("idle", 0, 5)])
        assert c.info().active_sequences == 1
        deadline = time.monotonic() + 10
        while c.info().active_sequences and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.info().active_sequences == 0
        assert c.info().free_blocks == 256
        assert s.metrics()[("chunkattn_sequences_evicted_total", ())] == 1
        with pytest.raises(ChunkAttnError) as err:
            c.attend(
                0,
                [BatchEntry("idle", 5, 1)],
                np.zeros((1, H, D), np.float32),
                *([np.zeros((1, HKV, D), np.float32)] * 2),
            )
        assert err.value.code == grpc.StatusCode.NOT_FOUND


# -- shutdown, concurrency ---------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_finishes_the_call_in_flight(sig: signal.Signals) -> None:
    """NOT_SERVING, open streams and new calls refused with UNAVAILABLE, the call in flight answered, exit 0."""
    big = ["--layers", "1", "--global-every", "1", "--heads", "8", "--kv-heads", "8", "--head-size", "64"]
    flags = [*big, "--num-blocks", "4096", "--grace-s", "8", "--max-message-mib", "32", "--max-call-work", "0"]
    with ServerProcess(*flags) as s, ChunkAttnClient(s.target) as c:
        statuses: list[int] = []
        channel = grpc.insecure_channel(s.target)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))

        def watch_health() -> None:
            with contextlib.suppress(grpc.RpcError):
                statuses.extend(r.status for r in watch)

        watcher = threading.Thread(target=watch_health)
        watcher.start()
        stream = c.stream()
        one = np.zeros((1, 8, 64), np.float32)
        stream.attend(0, [BatchEntry("streamed", 0, 1)], one, one, one)

        n = 5000  # a global prefill of this size (29 MiB of q, k, v) computes for a second or more on the CPU
        q = np.random.default_rng(0).standard_normal((n, 8, 64)).astype(np.float32)
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["out"] = c.attend(0, [BatchEntry("long", 0, n)], q, q, q)
            except ChunkAttnError as e:
                result["err"] = e

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + 30
        while s.metrics().get(("chunkattn_engine_jobs_in_flight", ()), 0) < 1:
            assert "err" not in result, result["err"]
            assert time.monotonic() < deadline, "the call never reached the engine"
            time.sleep(0.005)
        s.proc.send_signal(sig)  # while the call computes
        time.sleep(0.3)
        with pytest.raises(ChunkAttnError) as err:
            c.info()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ChunkAttnError) as err:
            stream.attend(0, [BatchEntry("streamed", 1, 1)], one, one, one)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        stream.close()
        caller.join(60)
        assert not caller.is_alive()
        assert "err" not in result, result.get("err")
        assert result["out"].shape == (n, 8, 64)
        assert s.proc.wait(30) == 0
        assert "stopped" in s.log()
        watcher.join(30)
        channel.close()
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_sixteen_concurrent_clients_each_get_their_own_right_answers(server: ServerProcess, transport: str) -> None:
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with ChunkAttnClient(server.target, timeout_s=120) as c:
                seq = f"c{transport}{i}"
                if transport == "unary":
                    _client_session(Runner(c.attend, seed=100 + i), seq)
                else:
                    with c.stream() as stream:
                        _client_session(Runner(stream.attend, seed=100 + i), seq)
                c.release([seq])
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, failures[:3]


def _client_session(r: Runner, seq: str) -> None:
    r.model_step([BatchEntry(seq, 0, 18)])
    for i in range(4):
        r.model_step([BatchEntry(seq, 18 + i, 1)])


def test_bytes_that_are_not_an_attend_request_are_invalid_argument(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        attend: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/chunkattn.v1.ChunkAttn/Attend")
        with pytest.raises(grpc.RpcError) as err:
            attend(b"\x1a\x05ab", timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid chunkattn.v1.AttendRequest" in (err.value.details() or "")


@pytest.mark.slow  # ~25 s: five pings 5 s apart
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the connections from Linux's /proc/net/tcp")
def test_a_client_pinging_as_often_as_allowed_keeps_its_connection(server: ServerProcess) -> None:
    """The client's channel with the shortest keepalive (MIN_KEEPALIVE_S, 5 s) pings between calls at that
    pace, and the server takes it. With gRPC's own server policy (one ping per 5 minutes, none between
    calls) the third such ping gets GOAWAY "too_many_pings", which closes the connection."""
    options = channel_options(1 << 20, MIN_KEEPALIVE_S)
    with grpc.insecure_channel(server.target, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        first = connections(os.getpid(), server.port)
        assert len(first) == 1
        time.sleep(25)
        assert connections(os.getpid(), server.port) == first, "the server hung up on the pings"
