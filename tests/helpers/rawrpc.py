"""Calls of a client that does not use our client library: raw bytes to each method, statuses back, and a
watcher that measures how long health checks and small calls take while something else goes on."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb

SERVICE = "/chunkattn.v1.ChunkAttn/"
UNARY = ("Info", "Attend", "Release", "Fork", "Truncate", "TransferKV")
BIG = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]


class Answer:
    """What a call gave: its status code, details and (when OK) the response's bytes."""

    def __init__(self, code: grpc.StatusCode, details: str = "", data: Any = None) -> None:
        self.code = code
        self.details = details
        self.data = data

    def __repr__(self) -> str:
        return f"Answer({self.code.name}, {self.details[:200]!r})"


class Raw:
    """``with Raw(target) as r: r.call("Release", b"...")`` over a channel that takes large messages."""

    def __init__(self, target: str, options: list[tuple[str, Any]] | None = None) -> None:
        self.channel = grpc.insecure_channel(target, options=options or BIG)

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def unary(self, method: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
        return self.channel.unary_unary(SERVICE + method)

    def call(self, method: str, data: bytes, timeout: float = 60) -> Answer:
        """A unary call (or, for ExportKV, the whole response stream)."""
        try:
            if method == "ExportKV":
                exporting: grpc.UnaryStreamMultiCallable[bytes, bytes] = self.channel.unary_stream(SERVICE + method)
                return Answer(grpc.StatusCode.OK, data=list(exporting(data, timeout=timeout)))
            return Answer(grpc.StatusCode.OK, data=self.unary(method)(data, timeout=timeout))
        except grpc.RpcError as e:
            return _failed(e)

    def stream(self, method: str, messages: Iterable[bytes], timeout: float = 60) -> Answer:
        """ImportKV (one answer) or AttendStream (the answers' bytes, a list)."""
        try:
            if method == "AttendStream":
                return Answer(grpc.StatusCode.OK, data=list(bidi(self.channel)(iter(messages), timeout=timeout)))
            importing: grpc.StreamUnaryMultiCallable[bytes, bytes] = self.channel.stream_unary(SERVICE + method)
            return Answer(grpc.StatusCode.OK, data=importing(iter(messages), timeout=timeout))
        except grpc.RpcError as e:
            return _failed(e)

    def health(self, timeout: float = 10) -> Answer:
        try:
            answer = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return Answer(grpc.StatusCode.OK, data=answer.status)
        except grpc.RpcError as e:
            return _failed(e)

    def info(self) -> pb.InfoResponse:
        return pb.InfoResponse.FromString(self.unary("Info")(b"", timeout=30))


def bidi(channel: grpc.Channel) -> grpc.StreamStreamMultiCallable[bytes, bytes]:
    return channel.stream_stream(SERVICE + "AttendStream")


def _failed(e: grpc.RpcError) -> Answer:
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return Answer(code, details or "")


class Watch:
    """``with Watch(fn) as w:`` calls ``fn()`` back to back on a thread of its own and keeps how long each call
    took and what it returned, until the block ends."""

    def __init__(self, fn: Callable[[], Any], pause_s: float = 0.005) -> None:
        self._fn = fn
        self._pause_s = pause_s
        self._stop = threading.Event()
        self.seconds: list[float] = []
        self.results: list[Any] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            result = self._fn()
            self.seconds.append(time.perf_counter() - started)
            self.results.append(result)
            self._stop.wait(self._pause_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def worst(self) -> float:
        return max(self.seconds, default=0.0)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (or its peak, "VmHWM") in MiB, from Linux's /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


@contextlib.contextmanager
def idle_streams(channel: grpc.Channel, n: int) -> Iterator[Any]:
    """``n`` AttendStreams that send nothing until the generator is closed (then they end)."""
    stop = threading.Event()

    def nothing() -> Iterator[bytes]:
        stop.wait()
        yield from ()

    calls = [bidi(channel)(nothing()) for _ in range(n)]
    try:
        yield calls
    finally:
        stop.set()
        for call in calls:
            call.cancel()
