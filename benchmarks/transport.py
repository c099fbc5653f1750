"""Attend round trips against a plain gRPC echo of the same bytes, side by side in one run on this machine.

What is measured: the real server (``python -m chunkattn_server``, its own process, 127.0.0.1 only) serving a
model whose compute is tiny, so that the transport shows: 1 chunked layer with C = 16, 64 query / 64 KV
heads of size 128 (96 KiB of q/k/v per token), float32 on the CPU. Every Attend call prefills a new
sequence at position 0 with T tokens, T chosen so that q + k + v is about the nominal request size, and
ends it (end_of_sequence), so nothing accumulates on the server. "ours" is the public client,
``ChunkAttnClient.attend`` for unary and ``ChunkAttnClient.stream().attend`` for stream: numpy arrays in, numpy
array out, so it includes encoding q/k/v into the message (``chunkattn_client.wire``), parsing on both
sides, the server's checks, the hand-off to the engine thread, the attention and the encode of the output.

The baseline, "echo", is a plain gRPC server in another process of its own (a ``grpc.aio`` server, the
stack the real server runs on, with a generic handler and identity (de)serialisers) that receives the
serialised AttendRequest bytes and answers with a precomputed bytes object as long as the serialised
AttendResponse: the same bytes up and the same number of bytes down as Attend, and nothing else. Both
channels use the same options (max message sizes), and the echo process gets the glibc malloc thresholds the
server gives itself (chunkattn_server/malloc.py), through MALLOC_*_THRESHOLD_: without them its cost per
message depended on what it had received before (glibc adapts its thresholds to the largest blocks freed),
which moved the KV row's baseline between ~1,400 and ~2,200 MB/s from run to run. This process (the client
of both) imports chunkattn_server for those numbers and for the engines of the KV row's last line, and with
it torch; it runs no engine while gRPC is timed.

Payloads: 64 KiB, 1 MiB and 16 MiB requests, each unary (one RPC per call) and stream (one long-lived
bidirectional stream per contender, each request awaited before the next is sent, as a model runner does).
MB/s = (request bytes + response bytes) / seconds per round trip, 1 MB = 10^6 bytes. Each timed sample
runs a batch of calls; the reported figure is the median over rounds that run every contender in turn
(ours and echo, unary and stream), so drift hits all alike. Target: ours / echo >= 0.8 at 1 MiB and above;
64 KiB is reported without a target (there the per-call fixed costs dominate).

KV transfer: two more servers serve one global layer of the same heads (64 KiB of K+V per token), so the
live KV grows with the prompt. A sequence of ``kv_tokens`` tokens (64 MiB of K/V) is prefilled on the first;
"ours" is ``ChunkAttnClient.transfer_kv`` (TransferKV: the first server exports, checksums (XXH3-64) and streams it
to the second, which checks, writes and commits it), timed from the call to its answer; the copy is then
released on the second server, untimed. The source keeps its channel to the target between transfers, as a
server does (chunkattn_server/service/channels.py). The baseline streams the very bytes of that export's messages
from this process to the echo process in one client-streaming RPC, which only counts them. MB/s = the
stream's bytes / seconds. The CPU time of each process per transfer is reported beside it, and, once every
server has stopped, the CPU time of the engines' own part of a transfer measured alone in this process (the
export's engine jobs, and decoding and writing the import; no gRPC): what a transfer costs beyond moving
the bytes. Target: ours / echo >= 0.8.

Before any timing, one Attend output (a 100-token sequence, so it crosses chunk boundaries) is compared
against the float64 reference, unary and stream (float32 tolerance 1e-4), and the echo's answer length is
checked; the run fails loudly otherwise.

    python benchmarks/transport.py [--json PATH] [--repeats N] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import date
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import torch

from chunkattn_client import BatchEntry, chunked_attention, codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.client import ChunkAttnClient, attend_request, channel_options
from chunkattn_server import Engine, malloc
from chunkattn_server.__main__ import engine_config
from chunkattn_server.flags import parse
from chunkattn_server.service import kvwire
from chunkattn_server.service.transfer import DEFAULT_KV_MESSAGE_BYTES, exporter, message_batches

from timing import cpu_name, publish, rounds  # benchmarks/timing.py

KIB = 1 << 10
MIB = 1 << 20
MAX_MESSAGE_MIB = 64  # 16 MiB requests and their ~5.3 MiB responses, with room
ECHO_UNARY = "/echo.Echo/Unary"
ECHO_STREAM = "/echo.Echo/Stream"
ECHO_SET_REPLY = "/echo.Echo/SetReply"
ECHO_SINK = "/echo.Echo/Sink"
VERIFY_TOKENS = 100
TOLERANCE = 1e-4
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Model:
    """The served model: small compute, so the bytes on the wire dominate."""

    chunk_size: int = 16
    # Wide and short: 96 KiB of q/k/v per token, so 16 MiB is 175 tokens (11 chunks) and the attention
    # itself (175 x 16 keys x 64 heads) is a fraction of a millisecond.
    heads: int = 64
    kv_heads: int = 64
    head_size: int = 128
    itemsize: int = 4  # float32

    @property
    def request_bytes_per_token(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_size * self.itemsize

    def server_args(self) -> list[str]:
        return [
            "--layers=1",
            "--global-every=0",
            f"--chunk-size={self.chunk_size}",
            f"--heads={self.heads}",
            f"--kv-heads={self.kv_heads}",
            f"--head-size={self.head_size}",
            "--dtype=float32",
            "--device=cpu",
            "--kv-memory-mib=64",
        ]

    def kv_server_args(self) -> list[str]:
        """One global layer of the same heads: its live KV is the whole sequence (two copies fit)."""
        return [*self.server_args(), "--global-every=1", "--kv-memory-mib=192"]


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]  # nominal request sizes in bytes (q + k + v)
    repeats: int  # timed rounds
    sample_bytes: int  # request bytes per timed sample: calls = sample_bytes / request size, clamped
    min_calls: int
    max_calls: int
    kv_tokens: int  # the transferred sequence's length (64 KiB of K/V per token)


FULL = Plan(
    sizes=(64 * KIB, MIB, 16 * MIB), repeats=7, sample_bytes=24 * MIB, min_calls=2, max_calls=300, kv_tokens=1024
)
SMOKE = Plan(sizes=(16 * KIB, 64 * KIB), repeats=2, sample_bytes=256 * KIB, min_calls=2, max_calls=10, kv_tokens=40)


# -- processes ---------------------------------------------------------------------------------------


class Child:
    """A server subprocess: started, awaited until it logs that it serves (the port is read from that
    line), and always stopped with SIGTERM (then SIGKILL if it lingers)."""

    def __init__(self, name: str, argv: list[str], ready: re.Pattern[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self._ready = ready
        self._lines: deque[str] = deque(maxlen=40)
        self._port: queue.Queue[int] = queue.Queue()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a Ctrl-C in the terminal reaches us, not the servers directly
            env={**os.environ, **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # keeps draining after "ready", so the pipe never fills
            self._lines.append(line.rstrip())
            m = self._ready.search(line)
            if m:
                self._port.put(int(m.group(1)))

    def wait_ready(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                return self._port.get(timeout=0.1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving:\n{self.log()}")
        raise RuntimeError(f"{self.name} did not report serving within {timeout_s:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return "\n".join(self._lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)


def start_server(model: Model, *, kv: bool = False) -> Child:
    argv = [
        sys.executable,
        "-m",
        "chunkattn_server",
        "--host=127.0.0.1",
        "--port=0",
        "--metrics-port=0",
        "--idle-timeout-s=0",
        "--grace-s=2",
        f"--max-message-mib={MAX_MESSAGE_MIB}",
        *(model.kv_server_args() if kv else model.server_args()),
    ]
    return Child("chunkattn server", argv, re.compile(r"serving chunkattn\.v1\.ChunkAttn on 127\.0\.0\.1:(\d+)"))


def start_echo() -> Child:
    """The echo, with the malloc thresholds the chunkattn server sets itself (given through the environment,
    so that the echo process stays plain gRPC: it imports neither chunkattn_server nor torch)."""
    argv = [sys.executable, os.path.abspath(__file__), "--echo-server"]
    thresholds = {
        "MALLOC_MMAP_THRESHOLD_": str(malloc.MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(malloc.TRIM_THRESHOLD),
    }
    return Child("echo server", argv, re.compile(r"echo serving on 127\.0\.0\.1:(\d+)"), env=thresholds)


# -- the echo server (runs in its own process: `transport.py --echo-server`) -------------------------


async def _serve_echo() -> None:
    reply = [b""]

    async def unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return reply[0]

    async def stream(
        requests: Any, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> Any:  # AsyncIterator[bytes] -> AsyncIterator[bytes]
        async for _ in requests:
            yield reply[0]

    async def sink(requests: Any, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        n = 0
        async for request in requests:
            n += len(request)
        return n.to_bytes(8, "little")

    async def set_reply(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        reply[0] = bytes(int.from_bytes(request, "little"))  # precomputed once per payload size
        return b""

    identity: dict[str, Any] = {"request_deserializer": wire.identity, "response_serializer": wire.identity}
    handler = grpc.method_handlers_generic_handler(
        "echo.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, **identity),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, **identity),
            "SetReply": grpc.unary_unary_rpc_method_handler(set_reply, **identity),
            "Sink": grpc.stream_unary_rpc_method_handler(sink, **identity),
        },
    )
    server = grpc.aio.server(options=channel_options(MAX_MESSAGE_MIB * MIB, None))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"echo serving on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    await stop.wait()
    await server.stop(1)


class EchoClient:
    """The echo's client side: raw bytes over a channel with the same options as ChunkAttnClient's."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target, options=channel_options(MAX_MESSAGE_MIB * MIB, None))
        identity: dict[str, Any] = {"request_serializer": wire.identity, "response_deserializer": wire.identity}
        self._unary = self._channel.unary_unary(ECHO_UNARY, **identity)
        self._stream = self._channel.stream_stream(ECHO_STREAM, **identity)
        self._set_reply = self._channel.unary_unary(ECHO_SET_REPLY, **identity)
        self._sink = self._channel.stream_unary(ECHO_SINK, **identity)

    def sink(self, payloads: list[bytes]) -> int:
        """Stream the payloads in one client-streaming RPC; returns the bytes the echo counted."""
        return int.from_bytes(self._sink(iter(payloads)), "little")

    def set_reply(self, nbytes: int) -> None:
        self._set_reply(nbytes.to_bytes(8, "little"))

    def call(self, payload: bytes) -> bytes:
        return bytes(self._unary(payload))

    def stream(self) -> EchoStream:
        return EchoStream(self._stream)

    def close(self) -> None:
        self._channel.close()


class EchoStream:
    """One long-lived bidirectional stream, fed as AttendStream is: a queue of requests, one answer each."""

    def __init__(self, method: grpc.StreamStreamMultiCallable[bytes, bytes]) -> None:
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._responses: Iterator[bytes] = method(iter(self._requests.get, None))

    def call(self, payload: bytes) -> bytes:
        self._requests.put(payload)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        for _ in self._responses:
            pass


# -- the benchmark -----------------------------------------------------------------------------------


def _inputs(model: Model, tokens: int, seed: int) -> tuple[npt.NDArray[np.float32], ...]:
    rng = np.random.default_rng(seed)
    shapes = ((tokens, model.heads, model.head_size), *((tokens, model.kv_heads, model.head_size),) * 2)
    return tuple(rng.standard_normal(s, dtype=np.float32) for s in shapes)


def verify(client: ChunkAttnClient, model: Model) -> float:
    """The first sequence, unary and stream, against the float64 reference; SystemExit when off."""
    q, k, v = _inputs(model, VERIFY_TOKENS, seed=1)
    want = chunked_attention(q, k, v, np.arange(VERIFY_TOKENS), chunk_size=model.chunk_size)
    entries = [BatchEntry("verify-unary", 0, VERIFY_TOKENS)]
    got_unary = client.attend(0, entries, q, k, v, end_of_sequence=["verify-unary"])
    with client.stream() as s:
        got_stream = s.attend(
            0, [BatchEntry("verify-stream", 0, VERIFY_TOKENS)], q, k, v, end_of_sequence=["verify-stream"]
        )
    err = max(float(np.abs(got.astype(np.float64) - want).max()) for got in (got_unary, got_stream))
    if not err <= TOLERANCE:
        raise SystemExit(f"Attend output differs from the reference by {err} (tolerance {TOLERANCE})")
    return err


def bench_size(
    client: ChunkAttnClient, echo: EchoClient, model: Model, nominal: int, plan: Plan, ids: Iterator[int]
) -> dict[str, dict[str, Any]]:
    tokens = max(1, round(nominal / model.request_bytes_per_token))
    q, k, v = _inputs(model, tokens, seed=2)

    def entries(sid: str) -> list[BatchEntry]:
        return [BatchEntry(sid, 0, tokens)]

    # Byte-identical payload for the echo: the serialised AttendRequest (ids are fixed width, so every
    # call's request has this size). The echo answers with as many bytes as the serialised AttendResponse.
    sample_id = f"s{next(ids):09d}"
    request = attend_request(0, entries(sample_id), q, k, v, end_of_sequence=[sample_id])
    out = client.attend(0, entries(sample_id), q, k, v, end_of_sequence=[sample_id])
    response_bytes = pb.AttendResponse(output=codec.encode(out)).ByteSize()
    echo.set_reply(response_bytes)
    if len(echo.call(request)) != response_bytes:
        raise SystemExit("the echo answered with the wrong number of bytes")
    calls = max(plan.min_calls, min(plan.max_calls, plan.sample_bytes // len(request)))

    def ours_unary() -> None:
        for _ in range(calls):
            sid = f"s{next(ids):09d}"
            client.attend(0, entries(sid), q, k, v, end_of_sequence=[sid])

    def echo_unary() -> None:
        for _ in range(calls):
            echo.call(request)

    with client.stream() as ours_stream_rpc, contextlib.closing(echo.stream()) as echo_stream_rpc:

        def ours_stream() -> None:
            for _ in range(calls):
                sid = f"s{next(ids):09d}"
                ours_stream_rpc.attend(0, entries(sid), q, k, v, end_of_sequence=[sid])

        def echo_stream() -> None:
            for _ in range(calls):
                echo_stream_rpc.call(request)

        t = rounds(
            {
                "ours_unary": ours_unary,
                "echo_unary": echo_unary,
                "ours_stream": ours_stream,
                "echo_stream": echo_stream,
            },
            plan.repeats,
        )

    moved = (len(request) + response_bytes) * calls / 1e6
    common = {"tokens": tokens, "request_bytes": len(request), "response_bytes": response_bytes, "calls": calls}
    return {
        mode: {"ours_mbps": moved / t[f"ours_{mode}"], "echo_mbps": moved / t[f"echo_{mode}"], **common}
        for mode in ("unary", "stream")
    }


def _kv_prompt(model: Model, plan: Plan, piece: int = 256) -> Iterator[tuple[int, int, Any, Any, Any]]:
    """The transferred sequence's prefill: (position, tokens, q, k, v) of each call."""
    for pos in range(0, plan.kv_tokens, piece):
        n = min(piece, plan.kv_tokens - pos)
        q, k, v = _inputs(model, n, seed=3 + pos)
        yield pos, n, q, k, v


def bench_kv_transfer(
    source: ChunkAttnClient,
    target: ChunkAttnClient,
    target_address: str,
    echo: EchoClient,
    model: Model,
    plan: Plan,
    pids: dict[str, int],
) -> dict[str, Any]:
    """TransferKV of one sequence between two servers against streaming the same bytes with plain gRPC.

    ``pids``: the source, target and echo processes, whose CPU time per transfer is reported (Linux)."""
    for pos, n, q, k, v in _kv_prompt(model, plan):
        source.attend(0, [BatchEntry("kv-src", pos, n)], q, k, v)
    # The baseline streams the very bytes of the export's messages (real K/V, not zeros).
    payloads = [c.SerializeToString() for c in source.export_kv("kv-src")]
    sizes = [len(p) for p in payloads]
    if echo.sink(payloads) != sum(sizes):
        raise SystemExit("the echo counted the wrong number of bytes")
    copies: list[str] = []
    kv_bytes = [0]
    cpu = CpuTimes({"source": pids["source"], "target": pids["target"], "echo": pids["echo"], "client": 0})

    def ours() -> None:
        copies.append(f"kv-copy-{len(copies)}")
        kv_bytes[0] = source.transfer_kv("kv-src", target_address, new_seq_id=copies[-1]).bytes

    def release_copy() -> None:  # untimed: freeing the copy is not part of moving it
        target.release([copies[-1]])

    t = rounds(
        {"ours": cpu.track("ours", ours), "echo": cpu.track("echo", lambda: echo.sink(payloads))},
        plan.repeats,
        cleanup={"ours": release_copy},
    )
    stream_mb = sum(sizes) / 1e6
    return {
        "tokens": plan.kv_tokens,
        "kv_bytes": kv_bytes[0],
        "messages": len(sizes),
        "stream_bytes": sum(sizes),
        "ours_mbps": stream_mb / t["ours"],
        "echo_mbps": stream_mb / t["echo"],
        # Mean CPU ms per call of each process (this one is "client"); {} where /proc is missing.
        "cpu_ms": {
            "ours": cpu.mean_ms("ours", ("source", "target", "client")),
            "echo": cpu.mean_ms("echo", ("client", "echo")),
        },
    }


def engine_work(model: Model, plan: Plan) -> tuple[dict[str, float], str]:
    """The engines' own share of a transfer, without gRPC: median CPU ms, in this process, of the source's
    export (each message's engine job as TransferKV runs it: read the pages, checksum, encode) and of the
    target's import (decode each message, check its checksums, write it into the pages), on two engines
    configured as the KV servers are, holding the same sequence; and the malloc setting it ran under.

    As in the servers, each exported message is dropped once encoded (it was sent), and each imported one
    is read just after it was written: a fresh copy of a message, as gRPC's receive makes, untimed. The
    import is then aborted, untimed. This process takes the servers' malloc thresholds for it
    (chunkattn_server/malloc.py), after every row that gRPC times."""
    setting = malloc.keep_freed_memory()
    config = engine_config(parse(model.kv_server_args()))
    source, target = Engine(config), Engine(config)
    for pos, n, q, k, v in _kv_prompt(model, plan):
        source.attend(0, [BatchEntry("kv-src", pos, n)], *(torch.from_numpy(x) for x in (q, k, v)), tenant="")
    manifest = source.transfer.export_manifest("kv-src", None, tenant="")
    jobs = [
        exporter(manifest, batch)
        for batch in message_batches(manifest.expected(), manifest.model, DEFAULT_KV_MESSAGE_BYTES)
    ]
    export_s: list[float] = []
    import_s: list[float] = []
    for _ in range(plan.repeats + 1):  # the first round warms up, untimed
        started = time.thread_time()
        for job in jobs:
            job(source)
        export_s.append(time.thread_time() - started)
        session = target.transfer.begin_import(manifest, tenant="")
        spent = 0.0
        for job in jobs:
            received = bytes(memoryview(job(source)[0]))  # a copy: fresh memory, as gRPC's receive makes
            started = time.thread_time()
            part, records = kvwire.decode(received)
            if part != "blocks" or not isinstance(records, list):
                raise SystemExit(f"an export message decoded as {part!r}, not blocks")
            target.transfer.import_records(session, records)
            spent += time.thread_time() - started
        import_s.append(spent)
        target.transfer.abort_import(session)
    cpu_ms = {"export": 1e3 * statistics.median(export_s[1:]), "import": 1e3 * statistics.median(import_s[1:])}
    return cpu_ms, setting


class CpuTimes:
    """CPU seconds that processes spend during tracked calls, read from /proc (pid 0: this process)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._spent: dict[str, dict[str, float]] = {}
        self._calls: dict[str, int] = {}

    def track(self, contender: str, fn: Callable[[], object]) -> Callable[[], None]:
        def tracked() -> None:
            before = self.now()
            fn()
            after = self.now()
            spent = self._spent.setdefault(contender, dict.fromkeys(self._pids, 0.0))
            for name in self._pids:
                spent[name] += after.get(name, 0.0) - before.get(name, 0.0)
            self._calls[contender] = self._calls.get(contender, 0) + 1

        return tracked

    def mean_ms(self, contender: str, names: tuple[str, ...]) -> dict[str, float]:
        if not os.path.exists("/proc/self/stat") or not self._calls.get(contender):
            return {}
        return {n: 1e3 * self._spent[contender][n] / self._calls[contender] for n in names}

    def now(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pid in self._pids.items():
            try:
                with open(f"/proc/{pid or 'self'}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        return out


def run(model: Model, plan: Plan) -> dict[str, Any]:
    started = time.perf_counter()
    children: list[Child] = []
    try:
        children.append(start_server(model))
        children.append(start_echo())
        children.append(start_server(model, kv=True))
        children.append(start_server(model, kv=True))
        ports = [c.wait_ready(START_TIMEOUT_S) for c in children]
        max_bytes = MAX_MESSAGE_MIB * MIB
        with (
            ChunkAttnClient(f"127.0.0.1:{ports[0]}", max_message_bytes=max_bytes) as client,
            contextlib.closing(EchoClient(f"127.0.0.1:{ports[1]}")) as echo,
        ):
            info = client.info()
            if info.device != "cpu" or info.cache_dtype != "float32" or info.head_size != model.head_size:
                raise SystemExit(f"the server does not serve the expected model: {info}")
            err = verify(client, model)
            ids = itertools.count()
            per_size = {n: bench_size(client, echo, model, n, plan, ids) for n in plan.sizes}
            if client.info().active_sequences:
                raise SystemExit("sequences were left on the server: end_of_sequence did not release them")
            with (
                ChunkAttnClient(f"127.0.0.1:{ports[2]}", max_message_bytes=max_bytes) as kv_source,
                ChunkAttnClient(f"127.0.0.1:{ports[3]}", max_message_bytes=max_bytes) as kv_target,
            ):
                pids = {"source": children[2].proc.pid, "target": children[3].proc.pid, "echo": children[1].proc.pid}
                kv = bench_kv_transfer(kv_source, kv_target, f"127.0.0.1:{ports[3]}", echo, model, plan, pids)
    finally:
        for child in reversed(children):
            child.stop()
    kv["engine_cpu_ms"], kv["engine_malloc"] = engine_work(model, plan)  # with every server stopped
    return {
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" grpcio {grpc.__version__}",
        "model": asdict(model),
        "repeats": plan.repeats,
        "verify_max_abs_err": err,
        "unary": {str(n): r["unary"] for n, r in per_size.items()},
        "stream": {str(n): r["stream"] for n, r in per_size.items()},
        "kv_transfer": kv,
        "duration_s": time.perf_counter() - started,
    }


# -- report ------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n / KIB:.0f} KiB"


def report(result: dict[str, Any]) -> str:
    """The human-readable table: MB/s of both, their ratio and the target's verdict."""
    m = result["model"]
    lines = [
        f"chunkattn transport benchmark, {result['date']}, {result['machine']}",
        "",
        f"Attend (1 layer, C = {m['chunk_size']}, {m['heads']}/{m['kv_heads']} heads x {m['head_size']}, float32,"
        f" a new sequence per call) against a plain gRPC echo of the same bytes; MB/s of request + response",
        f"{'mode':<7} {'request':>8} {'tokens':>6} {'up/down bytes':>19} {'calls':>5}"
        f" {'ours MB/s':>10} {'echo MB/s':>10} {'ours/echo':>13}",
    ]
    for mode in ("unary", "stream"):
        for nominal, r in result[mode].items():
            ratio = r["ours_mbps"] / r["echo_mbps"]
            verdict = ("ok" if ratio >= 0.8 else "MISS") if int(nominal) >= MIB else "-"
            lines.append(
                f"{mode:<7} {_size(int(nominal)):>8} {r['tokens']:>6}"
                f" {r['request_bytes']:>9}/{r['response_bytes']:<9} {r['calls']:>5}"
                f" {r['ours_mbps']:>10.1f} {r['echo_mbps']:>10.1f} {ratio:>7.2f}x {verdict:>4}"
            )
    kv = result["kv_transfer"]
    ratio = kv["ours_mbps"] / kv["echo_mbps"]
    lines += [
        "",
        f"KV transfer: TransferKV of {kv['tokens']} tokens ({kv['kv_bytes'] / MIB:.0f} MiB of K/V, {kv['messages']}"
        " messages) between two servers, against a plain gRPC client stream of the same bytes",
        f"{'':<7} {'':>8} {'':>6} {'stream bytes':>19} {'':>5} {'ours MB/s':>10} {'echo MB/s':>10} {'ours/echo':>13}",
        f"{'kv':<7} {'':>8} {'':>6} {kv['stream_bytes']:>19} {'':>5} {kv['ours_mbps']:>10.1f} {kv['echo_mbps']:>10.1f}"
        f" {ratio:>7.2f}x {'ok' if ratio >= 0.8 else 'MISS':>4}",
    ]
    if kv["cpu_ms"]["ours"]:
        cpu = kv["cpu_ms"]
        lines.append(
            "CPU ms per transfer: ours "
            + ", ".join(f"{n} {ms:.0f}" for n, ms in cpu["ours"].items())
            + "; echo "
            + ", ".join(f"{n} {ms:.0f}" for n, ms in cpu["echo"].items())
        )
    work = kv["engine_cpu_ms"]
    lines.append(
        f"the engines' own work, measured alone (no gRPC), CPU ms per transfer: export {work['export']:.0f},"
        f" import {work['import']:.0f} ({kv['engine_malloc']})"
    )
    lines += [
        "",
        "target: ours/echo >= 0.8x at 1 MiB and above (64 KiB and below: no target), and for the KV transfer;"
        f" medians of {result['repeats']} rounds; verified against the reference"
        f" (max abs err {result['verify_max_abs_err']:.1e})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeats", type=int, help=f"timed rounds per contender (default {FULL.repeats})")
    parser.add_argument("--smoke", action="store_true", help="tiny payloads, few calls: checks the code paths")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)  # the baseline's process
    args = parser.parse_args(argv)
    if args.echo_server:
        asyncio.run(_serve_echo())
        return 0
    plan = SMOKE if args.smoke else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        plan = dataclasses.replace(plan, repeats=args.repeats)

    result = run(Model(), plan)
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
