"""Decode-sized Attend calls from many clients, over gRPC and over the data plane (ZeroMQ), against a plain
gRPC echo and a plain ZeroMQ echo of the same bytes, side by side.

What is measured: how many small calls per second the real server sustains, and how close that is to what
Python gRPC and pyzmq themselves allow. Four servers run at once, each its own process on 127.0.0.1:

- "ours": ``python -m chunkattn_server`` with the demo model (4 layers: 3 chunked with C = 1024, then a
  global one; 8 query and 2 KV heads of size 64), float32 on the CPU, batching on (the default: the
  concurrent calls of one layer that are queued together share one engine step), and its data plane on
  tcp and ipc; "ours_zmq" is the same server called over the data plane (the client picks ipc: one host);
- "ours --no-batching": the same server, one call per engine step;
- "echo": a plain ``grpc.aio`` server (benchmarks/transport.py's, generic handler, identity (de)serialisers)
  that answers the serialised AttendRequest bytes of such a call with a precomputed reply as long as the
  serialised AttendResponse: the same bytes up and down, and nothing else. It is the floor Python gRPC sets.
- "zmq_echo": a plain zmq.asyncio ROUTER on an ipc socket (``calls.py --zmq-echo PATH BYTES``) that answers
  each [key, AttendRequest] message of a DEALER with a precomputed reply as long as the AttendResponse: the
  floor pyzmq sets. Its client is a DEALER per thread that sends the prebuilt request and waits for the reply.

Each client thread is a decoding session, as a model runner's remote attention sends it: one call per
layer per token, 1 token per call (a 3 KiB request and a 2 KiB reply), layers 0..3 in turn and then the next
position; after ``WINDOW`` tokens the session ends its sequence (end_of_sequence on the last layer's call)
and starts a new one, so the global layer's context stays within WINDOW keys and the measure stays on the
per-call path, not on attention over long contexts. Every thread has its own channel (its own connection,
as separate model runners have). "ours" is the public client, ``ChunkAttnClient.attend`` for unary and one
``ChunkAttnClient.stream()`` per thread for stream, numpy in and out, with data_plane="grpc" for "ours" and
"zmq" for "ours_zmq": it includes the client's encoding and decoding. The echoes' clients send the prebuilt
request bytes (the zmq echo has no stream: its "stream" rows are its unary ones, measured again).

With 1, 8 and 32 client threads (all in this process), unary and stream, each contender runs for
``seconds`` per round; rounds run every contender in turn, so drift on a shared machine hits all alike;
calls/s is the median over rounds, p50/p99 over every call of every round. Beside them: the calls merged
per engine step (from the batching server's chunkattn_step_calls histogram) and the CPU time each process
spent per call (/proc), which says where the time goes.

Before any timing, 8 concurrent sessions (half unary, half stream, random q/k/v each call) run on both of
our servers over gRPC, and on the batching one over the data plane, and every output is compared with the
float64 reference (float32 tolerance); afterwards every session is ended and the servers must hold no
sequence. The run fails loudly otherwise.

Targets: ours / echo >= 0.6 at 1, 8 and 32 clients (aim: 0.8); batching on / off > 1 from 8 clients on; over
the data plane (#37), ours_zmq / ours >= 4 at 1 client and ours_zmq / zmq_echo >= 0.6 at 1, 8 and 32.

    python benchmarks/calls.py [--json PATH] [--repeats N] [--seconds S] [--smoke]

``--json`` writes ``{"unary"|"stream": {"<clients>": {"ours_cps", "ours_nobatch_cps", "echo_cps",
"ours_zmq_cps", "zmq_echo_cps", "zmq_vs_grpc", "zmq_vs_zmq_echo", "ours_p50_ms", "ours_p99_ms", ...}}}``
beside "date", "machine" and the run's settings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import os
import platform
import re
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import zmq

from chunkattn_client import BatchEntry, codec
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.bench import promtext
from chunkattn_client.client import ChunkAttnClient, ServerInfo, attend_request
from chunkattn_client.reference import ReferenceModel, within_tolerance

from timing import cpu_name, publish  # benchmarks/timing.py
from transport import START_TIMEOUT_S, Child, CpuTimes, EchoClient, start_echo  # benchmarks/transport.py

WINDOW = 256  # tokens per decoding session before it ends its sequence and starts a new one
TRANSPORTS = ("unary", "stream")
CONTENDERS = ("ours", "ours_nobatch", "echo", "ours_zmq", "zmq_echo")
GRPC_CONTENDERS = CONTENDERS[:3]  # the first table; the data plane's are the second
STEPPED = ("ours", "ours_zmq")  # the batching server: its calls merged per step are read from its metrics
DATA_PLANE_ARGS = ("--data-plane-tcp=127.0.0.1:0", "--data-plane-ipc=auto")  # the batching server's
SERVER_ARGS = ["--preset=demo", "--dtype=float32", "--device=cpu", "--idle-timeout-s=0", "--grace-s=2"]


@dataclass(frozen=True)
class Plan:
    clients: tuple[int, ...]  # client threads
    repeats: int  # timed rounds
    seconds: float  # per contender per round
    verify_sessions: int  # concurrent sessions checked against the reference
    verify_tokens: int  # tokens each of them decodes (every layer)
    server_args: tuple[str, ...] = ()  # more flags for both of our servers (e.g. --no-inline-steps)


FULL = Plan(clients=(1, 8, 32), repeats=3, seconds=2.0, verify_sessions=8, verify_tokens=12)
SMOKE = Plan(clients=(1, 4), repeats=1, seconds=0.3, verify_sessions=4, verify_tokens=3)


# -- the servers -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ours:
    """One of our servers (a subprocess) and the address of its metrics page."""

    def __init__(self, name: str, *extra: str) -> None:
        self.metrics_port = _free_port()
        argv = [
            sys.executable,
            "-m",
            "chunkattn_server",
            "--host=127.0.0.1",
            "--port=0",
            f"--metrics-port={self.metrics_port}",
            *SERVER_ARGS,
            *extra,
        ]
        self.child = Child(name, argv, re.compile(r"serving chunkattn\.v1\.ChunkAttn on 127\.0\.0\.1:(\d+)"))

    def metrics(self) -> promtext.Samples:
        return promtext.fetch(f"http://127.0.0.1:{self.metrics_port}/metrics")


# -- the sessions ------------------------------------------------------------------------------------

Call = Callable[[int, list[BatchEntry], Any, Any, Any, list[str]], npt.NDArray[Any]]


class Session:
    """One decoding session: 1-token calls, layer after layer, position after position, a new sequence
    every WINDOW tokens. ``call`` sends one Attend (unary or over a stream)."""

    def __init__(self, name: str, call: Call, info: ServerInfo, rng: np.random.Generator, fresh: bool) -> None:
        self._name = name
        self._call = call
        self._layers = len(info.layers)
        self._rng = rng
        self._fresh = fresh  # new random q/k/v every call (verification) or the same arrays (timing)
        self._shapes = ((1, info.num_heads, info.head_size), *((1, info.num_kv_heads, info.head_size),) * 2)
        self._qkv = self._draw()
        self._ids = itertools.count()
        self.seq_id = f"{name}-{next(self._ids)}"
        self.position = 0
        self.layer = 0

    def _draw(self) -> tuple[npt.NDArray[np.float32], ...]:
        return tuple(self._rng.standard_normal(s, dtype=np.float32) for s in self._shapes)

    def step(self, window: int = WINDOW) -> tuple[int, BatchEntry, tuple[npt.NDArray[np.float32], ...], Any]:
        """One call; returns (layer, entry, (q, k, v), output)."""
        qkv = self._draw() if self._fresh else self._qkv
        entry = BatchEntry(self.seq_id, self.position, 1)
        ending = self.layer == self._layers - 1 and self.position == window - 1
        q, k, v = qkv
        out = self._call(self.layer, [entry], q, k, v, [self.seq_id] if ending else [])
        done = (self.layer, entry, qkv, out)
        self.layer = (self.layer + 1) % self._layers
        if self.layer == 0:
            self.position += 1
            if ending:
                self.seq_id, self.position = f"{self._name}-{next(self._ids)}", 0
        return done

    def end(self, client: ChunkAttnClient) -> None:
        client.release([self.seq_id], missing_ok=True)


def _unary(client: ChunkAttnClient) -> Call:
    return lambda layer, entries, q, k, v, eos: client.attend(layer, entries, q, k, v, end_of_sequence=eos)


def _streamed(stream: Any) -> Call:
    return lambda layer, entries, q, k, v, eos: stream.attend(layer, entries, q, k, v, end_of_sequence=eos)


def verify(address: str, plan: Plan, data_plane: str = "grpc") -> float:
    """``plan.verify_sessions`` concurrent sessions (half unary, half stream), every output against the
    float64 reference; returns the largest error, SystemExit when one is off."""
    errors: list[float] = []
    failures: list[BaseException] = []
    with ChunkAttnClient(address, data_plane="grpc") as client:
        info = client.info()

        def run(i: int) -> None:
            try:
                with contextlib.ExitStack() as stack:
                    own = stack.enter_context(ChunkAttnClient(address, data_plane=data_plane))
                    if own.open_data_plane() != data_plane and not own.data_plane.startswith(data_plane):
                        raise SystemExit(f"{address}: asked for {data_plane}, the client uses {own.data_plane}")
                    call = _unary(own) if i % 2 == 0 else _streamed(stack.enter_context(own.stream()))
                    session = Session(f"verify{i}", call, info, np.random.default_rng(i), fresh=True)
                    ref = ReferenceModel.for_server(info)
                    for _ in range(plan.verify_tokens * len(info.layers)):
                        layer, entry, (q, k, v), out = session.step()
                        ok, err = within_tolerance(out, ref.attend(layer, [entry], q, k, v), "float32")
                        errors.append(err)
                        if not ok:
                            raise SystemExit(f"{address}: layer {layer} at {entry.position} is off by {err}")
                    session.end(own)
            except BaseException as e:  # re-raised below, in the main thread
                failures.append(e)

        _together([lambda i=i: run(i) for i in range(plan.verify_sessions)])  # type: ignore[misc]
        if failures:
            raise failures[0]
        if client.info().active_sequences:
            raise SystemExit(f"{address}: sequences were left after every session ended")
    return max(errors)


def _together(fns: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=fn) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# -- one contender at one client count ---------------------------------------------------------------


class Contender:
    """``n`` client threads, each with its own channel, calling one server over one transport."""

    def __init__(self, kind: str, transport: str, n: int, address: str, info: ServerInfo, echo_payload: bytes):
        self.kind = kind
        self._stack = contextlib.ExitStack()
        self._clients: list[ChunkAttnClient] = []
        self._sessions: list[Session] = []
        self.calls: list[Callable[[], object]] = []
        for i in range(n):
            if kind == "echo":
                echo = self._stack.enter_context(contextlib.closing(EchoClient(address)))
                target = echo if transport == "unary" else self._stack.enter_context(contextlib.closing(echo.stream()))
                self.calls.append(functools.partial(target.call, echo_payload))
                continue
            if kind == "zmq_echo":
                zecho = self._stack.enter_context(contextlib.closing(ZmqEchoClient(address)))
                self.calls.append(functools.partial(zecho.call, echo_payload))
                continue
            plane = "zmq" if kind == "ours_zmq" else "grpc"
            client = self._stack.enter_context(ChunkAttnClient(address, data_plane=plane))
            call = _unary(client) if transport == "unary" else _streamed(self._stack.enter_context(client.stream()))
            session = Session(
                f"{'zmq-' if plane == 'zmq' else ''}{transport}{n}-{i}",
                call,
                info,
                np.random.default_rng(100 + i),
                fresh=False,
            )
            self._clients.append(client)
            self._sessions.append(session)
            self.calls.append(session.step)
        self.cps: list[float] = []
        self.latency_s: list[float] = []

    def run(self, seconds: float, record: bool = True) -> int:
        """Every thread calls in a loop for ``seconds``; returns the calls made (a zmq DEALER is used by the
        thread that made it: each thread makes its own on its first call, during the warm-up)."""
        latencies: list[list[float]] = [[] for _ in self.calls]
        failures: list[BaseException] = []
        start = threading.Barrier(len(self.calls) + 1)
        deadline = [0.0]

        def loop(i: int) -> None:
            call, mine, clock = self.calls[i], latencies[i], time.perf_counter
            try:
                start.wait()
                while (t := clock()) < deadline[0]:
                    call()
                    mine.append(clock() - t)
            except BaseException as e:  # re-raised below, in the main thread
                failures.append(e)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(self.calls))]
        for t in threads:
            t.start()
        began = time.perf_counter()
        deadline[0] = began + seconds
        start.wait()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - began
        if failures:
            raise failures[0]
        calls = sum(len(x) for x in latencies)
        if record:
            self.cps.append(calls / elapsed)
            self.latency_s.extend(itertools.chain.from_iterable(latencies))
        return calls

    def close(self) -> None:
        for client, session in zip(self._clients, self._sessions, strict=True):
            session.end(client)
        self._stack.close()


# -- the plain ZeroMQ echo (its server runs in its own process: `calls.py --zmq-echo PATH BYTES`) ----------


class ZmqEchoClient:
    """The zmq echo's client: a DEALER (made by the thread that first calls, as a socket must be used by one
    thread), the request sent as the data plane sends it ([key, request]), its reply awaited."""

    KEY = bytes(32)

    def __init__(self, address: str) -> None:
        self._address = address
        self._context = zmq.Context()
        self._socket: zmq.Socket[Any] | None = None

    def call(self, payload: bytes) -> bytes:
        if self._socket is None:
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self._address)
        self._socket.send_multipart((self.KEY, payload))
        return self._socket.recv()

    def close(self) -> None:
        self._context.destroy(linger=0)


def start_zmq_echo(path: str, reply_bytes: int) -> Child:
    argv = [sys.executable, os.path.abspath(__file__), "--zmq-echo", path, str(reply_bytes)]
    return Child("zmq echo", argv, re.compile(r"zmq echo serving (\d+)"))


def serve_zmq_echo(path: str, reply_bytes: int) -> None:
    """The zmq echo's server: a zmq.asyncio ROUTER on ``ipc://path`` (as the data plane's ROUTER is) that
    answers every message with ``reply_bytes`` bytes."""
    import asyncio

    import zmq.asyncio

    async def serve() -> None:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"ipc://{path}")
        print("zmq echo serving 1", file=sys.stderr, flush=True)
        reply = bytes(reply_bytes)
        while True:
            identity, _key, _request = await router.recv_multipart()
            await router.send_multipart((identity, reply))

    asyncio.run(serve())


def _ms(xs: list[float], q: float) -> float:
    return 1e3 * float(np.quantile(np.asarray(xs), q))


# -- the run -----------------------------------------------------------------------------------------


def run(plan: Plan) -> dict[str, Any]:
    started = time.perf_counter()
    extra = plan.server_args
    ours = Ours("chunkattn server", *DATA_PLANE_ARGS, *extra)
    nobatch = Ours("chunkattn server --no-batching", "--no-batching", *extra)
    echo_child = start_echo()
    children = [ours.child, nobatch.child, echo_child]
    folder = tempfile.TemporaryDirectory(prefix="chunkattn-calls-")
    try:
        ports = [c.wait_ready(START_TIMEOUT_S) for c in children]
        address = dict(zip(GRPC_CONTENDERS, (f"127.0.0.1:{p}" for p in ports), strict=True))
        address["ours_zmq"] = address["ours"]
        pids = dict(zip(GRPC_CONTENDERS, (c.proc.pid for c in children), strict=True))
        pids["ours_zmq"] = pids["ours"]
        with ChunkAttnClient(address["ours"], data_plane="grpc") as client:
            info = client.info()
        if info.device != "cpu" or info.cache_dtype != "float32":
            raise SystemExit(f"the server does not serve the expected model: {info}")
        err = max(
            verify(address["ours"], plan),
            verify(address["ours_nobatch"], plan),
            verify(address["ours"], plan, data_plane="zmq"),
        )
        payloads, reply_bytes = _echo_payloads(address["echo"], info)
        zmq_path = os.path.join(folder.name, "echo.sock")
        children.append(start_zmq_echo(zmq_path, reply_bytes))
        children[-1].wait_ready(START_TIMEOUT_S)
        address["zmq_echo"], pids["zmq_echo"] = f"ipc://{zmq_path}", children[-1].proc.pid
        with contextlib.closing(ZmqEchoClient(address["zmq_echo"])) as zecho:
            if len(zecho.call(payloads["unary"])) != reply_bytes:
                raise SystemExit("the zmq echo answered with the wrong number of bytes")

        contenders: dict[tuple[str, int], dict[str, Contender]] = {}
        for transport, n in itertools.product(TRANSPORTS, plan.clients):
            contenders[transport, n] = {
                kind: Contender(kind, transport, n, address[kind], info, payloads[transport]) for kind in CONTENDERS
            }
        cpu = CpuTimes({**pids, "client": 0})
        cpu_s: dict[tuple[str, int, str], dict[str, float]] = {}
        calls_made: dict[tuple[str, int, str], int] = {}
        merged: dict[tuple[str, int, str], list[float]] = {}
        for group in contenders.values():  # warm-up: connections, first calls, the engines' first steps
            for c in group.values():
                c.run(min(0.3, plan.seconds), record=False)
        for _ in range(plan.repeats):
            for (transport, n), group in contenders.items():
                for kind, c in group.items():
                    before_cpu = cpu.now()
                    before_steps = ours.metrics() if kind in STEPPED else {}
                    made = c.run(plan.seconds)
                    after_cpu = cpu.now()
                    key = (transport, n, kind)
                    calls_made[key] = calls_made.get(key, 0) + made
                    spent = cpu_s.setdefault(key, {})
                    for name in (kind, "client"):
                        spent[name] = spent.get(name, 0.0) + after_cpu.get(name, 0.0) - before_cpu.get(name, 0.0)
                    if kind in STEPPED:
                        after = ours.metrics()
                        steps = promtext.delta(after, before_steps, "chunkattn_step_calls_count")
                        served = promtext.delta(after, before_steps, "chunkattn_step_calls_sum")
                        merged.setdefault(key, []).append(served / steps if steps else 0.0)
        for group in contenders.values():
            for c in group.values():
                c.close()
        for kind in ("ours", "ours_nobatch"):
            with ChunkAttnClient(address[kind], data_plane="grpc") as client:
                if client.info().active_sequences:
                    raise SystemExit(f"{kind}: sequences were left on the server after every session ended")
    finally:
        for child in reversed(children):
            child.stop()
        folder.cleanup()

    results: dict[str, dict[str, Any]] = {t: {} for t in TRANSPORTS}
    for (transport, n), group in contenders.items():
        o, nb, e, oz, ze = (group[k] for k in CONTENDERS)
        results[transport][str(n)] = {
            "ours_cps": statistics.median(o.cps),
            "ours_nobatch_cps": statistics.median(nb.cps),
            "echo_cps": statistics.median(e.cps),
            "ours_p50_ms": _ms(o.latency_s, 0.5),
            "ours_p99_ms": _ms(o.latency_s, 0.99),
            "ours_nobatch_p50_ms": _ms(nb.latency_s, 0.5),
            "ours_nobatch_p99_ms": _ms(nb.latency_s, 0.99),
            "echo_p50_ms": _ms(e.latency_s, 0.5),
            "echo_p99_ms": _ms(e.latency_s, 0.99),
            "calls_per_step": statistics.median(merged[transport, n, "ours"]),
            "ours_zmq_cps": statistics.median(oz.cps),
            "zmq_echo_cps": statistics.median(ze.cps),
            "zmq_vs_grpc": statistics.median(oz.cps) / statistics.median(o.cps),
            "zmq_vs_zmq_echo": statistics.median(oz.cps) / statistics.median(ze.cps),
            "ours_zmq_p50_ms": _ms(oz.latency_s, 0.5),
            "ours_zmq_p99_ms": _ms(oz.latency_s, 0.99),
            "zmq_echo_p50_ms": _ms(ze.latency_s, 0.5),
            "zmq_echo_p99_ms": _ms(ze.latency_s, 0.99),
            "ours_zmq_calls_per_step": statistics.median(merged[transport, n, "ours_zmq"]),
            # CPU ms per call of the server (ours, ours_nobatch, echo) and of this process (the clients).
            "cpu_ms_per_call": {
                kind: {
                    name: 1e3 * s / calls_made[transport, n, kind]
                    for name, s in cpu_s[transport, n, kind].items()
                    if calls_made[transport, n, kind]
                }
                for kind in CONTENDERS
            },
        }
    return {
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" grpcio {grpc.__version__}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})",
        "model": "demo: 4 layers (3 chunked, C = 1024, then 1 global), 8/2 heads x 64, float32, CPU",
        "window": WINDOW,
        "request_bytes": len(payloads["unary"]),
        "response_bytes": reply_bytes,
        "repeats": plan.repeats,
        "seconds": plan.seconds,
        "server_args": list(plan.server_args),
        "verify_max_abs_err": err,
        **results,
        "duration_s": time.perf_counter() - started,
    }


def _echo_payloads(address: str, info: ServerInfo) -> tuple[dict[str, bytes], int]:
    """The serialised requests of one decode call (unary; stream, which numbers its requests) and the
    length of its answer, which the echo is told to send back; checked once."""
    shapes = ((1, info.num_heads, info.head_size), *((1, info.num_kv_heads, info.head_size),) * 2)
    q, k, v = (np.ones(s, dtype=np.float32) for s in shapes)
    entries = [BatchEntry("zmq-unary32-31-0", 100, 1)]  # an id as long as the timed sessions' longest
    payloads = {
        "unary": attend_request(0, entries, q, k, v),
        "stream": attend_request(0, entries, q, k, v, request_id=1 << 20),
    }
    reply_bytes = pb.AttendResponse(output=codec.encode(q)).ByteSize()  # the output has q's shape
    with contextlib.closing(EchoClient(address)) as echo:
        echo.set_reply(reply_bytes)
        if len(echo.call(payloads["unary"])) != reply_bytes:
            raise SystemExit("the echo answered with the wrong number of bytes")
    return payloads, reply_bytes


# -- report ------------------------------------------------------------------------------------------


def report(result: dict[str, Any]) -> str:
    lines = [
        f"chunkattn calls benchmark, {result['date']}, {result['machine']}",
        "",
        f"decode-sized Attend calls ({result['model']}; 1 token per call: {result['request_bytes']} B up,"
        f" {result['response_bytes']} B down) from N client threads against a plain grpc.aio echo of the same bytes"
        + (f"; our servers with {' '.join(result['server_args'])}" if result.get("server_args") else ""),
        f"{'mode':<7} {'clients':>7} {'ours c/s':>9} {'no-batch':>9} {'echo c/s':>9} {'ours/echo':>10}"
        f" {'on/off':>7} {'p50 ms':>7} {'p99 ms':>7} {'calls/step':>10} {'CPU ms/call srv/cli':>20}"
        f" {'echo srv/cli':>12}",
    ]
    for transport in TRANSPORTS:
        for n, r in result[transport].items():
            ratio = r["ours_cps"] / r["echo_cps"]
            on_off = r["ours_cps"] / r["ours_nobatch_cps"]
            cpu = r["cpu_ms_per_call"]
            ours_cpu = f"{cpu['ours'].get('ours', 0):.2f}/{cpu['ours'].get('client', 0):.2f}"
            echo_cpu = f"{cpu['echo'].get('echo', 0):.2f}/{cpu['echo'].get('client', 0):.2f}"
            lines.append(
                f"{transport:<7} {n:>7} {r['ours_cps']:>9.0f} {r['ours_nobatch_cps']:>9.0f} {r['echo_cps']:>9.0f}"
                f" {ratio:>5.2f}x {'ok' if ratio >= 0.6 else 'MISS':>4} {on_off:>6.2f}x"
                f" {r['ours_p50_ms']:>7.2f} {r['ours_p99_ms']:>7.2f} {r['calls_per_step']:>10.2f}"
                f" {ours_cpu:>20} {echo_cpu:>12}"
            )
    lines += [
        "",
        "the data plane: the same calls to the batching server over ZeroMQ (ipc), against our gRPC Attend and a"
        " plain zmq.asyncio ROUTER echo of the same bytes",
        f"{'mode':<10} {'clients':>7} {'zmq c/s':>9} {'grpc c/s':>9} {'zecho c/s':>9} {'zmq/grpc':>9}"
        f" {'zmq/zecho':>10} {'p50 ms':>7} {'p99 ms':>7} {'zecho p50':>9} {'calls/step':>10}"
        f" {'CPU ms/call srv/cli':>20} {'zecho srv/cli':>13}",
    ]
    for transport in TRANSPORTS:
        for n, r in result[transport].items():
            cpu = r["cpu_ms_per_call"]
            zmq_cpu = f"{cpu['ours_zmq'].get('ours_zmq', 0):.2f}/{cpu['ours_zmq'].get('client', 0):.2f}"
            zecho_cpu = f"{cpu['zmq_echo'].get('zmq_echo', 0):.2f}/{cpu['zmq_echo'].get('client', 0):.2f}"
            vs_grpc, vs_echo = r["zmq_vs_grpc"], r["zmq_vs_zmq_echo"]
            grpc_verdict = ("ok" if vs_grpc >= 4 else "MISS") if n == "1" else ""
            lines.append(
                f"{'zmq-' + transport:<10} {n:>7} {r['ours_zmq_cps']:>9.0f} {r['ours_cps']:>9.0f}"
                f" {r['zmq_echo_cps']:>9.0f} {vs_grpc:>4.2f}x {grpc_verdict:>4} {vs_echo:>4.2f}x"
                f" {'ok' if vs_echo >= 0.6 else 'MISS':>4} {r['ours_zmq_p50_ms']:>7.2f} {r['ours_zmq_p99_ms']:>7.2f}"
                f" {r['zmq_echo_p50_ms']:>9.2f} {r['ours_zmq_calls_per_step']:>10.2f} {zmq_cpu:>20} {zecho_cpu:>13}"
            )
    lines += [
        "",
        "targets: ours/echo >= 0.6x at every client count (aim 0.8x); batching on/off > 1x from 8 clients on;"
        " over the data plane zmq/grpc >= 4x at 1 client and zmq/zecho >= 0.6x at every client count;"
        f" calls/s: medians of {result['repeats']} rounds of {result['seconds']:g} s; p50/p99 over every call;"
        f" verified against the reference (max abs err {result['verify_max_abs_err']:.1e})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeats", type=int, help=f"timed rounds (default {FULL.repeats})")
    parser.add_argument("--seconds", type=float, help=f"seconds per contender per round (default {FULL.seconds:g})")
    parser.add_argument("--smoke", action="store_true", help="1 and 4 clients, short rounds: checks the code paths")
    parser.add_argument("--zmq-echo", nargs=2, metavar=("PATH", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--server-args",
        default="",
        help="more flags for both of our servers, as one string (e.g. --server-args=--no-inline-steps)",
    )
    args = parser.parse_args(argv)
    if args.zmq_echo:  # the zmq echo's own process
        serve_zmq_echo(args.zmq_echo[0], int(args.zmq_echo[1]))
        return 0
    plan = SMOKE if args.smoke else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        plan = dataclasses.replace(plan, repeats=args.repeats)
    if args.seconds is not None:
        if not args.seconds > 0:
            parser.error("--seconds must be positive")
        plan = dataclasses.replace(plan, seconds=args.seconds)
    if args.server_args:
        plan = dataclasses.replace(plan, server_args=tuple(shlex.split(args.server_args)))
    result = run(plan)
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
