"""AttendStream and AsyncAttendStream keep one contract (chunkattn_client._stream): the same cases, run against
both through a real server. A call is answered as the reference answers it; a failed call leaves the stream
usable; a call without an answer within the client's timeout_s raises DEADLINE_EXCEEDED and cancels the
stream, and so does an interrupted call; a broken stream (cancelled, closed, its connection lost) raises the
same error for every later call; close() and cancel() never raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from chunkattn_client import AsyncChunkAttnClient, BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel
from chunkattn_client._stream import failure
from tests.helpers.grpc_fakes import FakeCall
from tests.helpers.reset_proxy import ResettingProxy
from tests.helpers.server_process import SMALL, ServerProcess
from tests.helpers.tensors import qkv

H, HKV, D = 4, 2, 16
LOST = "the connection to the server was lost mid-call"


class Sync:
    """The blocking client and its stream, as the cases drive them."""

    def __init__(self, target: str, timeout_s: float | None) -> None:
        self.client = ChunkAttnClient(target, timeout_s=timeout_s)

    def stream(self) -> Any:
        return self.client.stream()

    def attend(self, stream: Any, *args: Any, **options: Any) -> Any:
        return stream.attend(*args, **options)

    def interrupted(self, stream: Any, *args: Any) -> type[BaseException]:
        """A call interrupted while it waits (Ctrl-C: a SIGINT to the main thread, here from a timer; a real
        signal, which wakes the wait at once, where _thread.interrupt_main waits for the call's timeout); the
        exception it raised."""
        main = threading.main_thread().ident
        assert main is not None
        timer = threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                stream.attend(*args)
        finally:
            timer.cancel()
        return KeyboardInterrupt

    def close(self, stream: Any) -> None:
        stream.close()

    def cancel(self, stream: Any) -> None:
        stream.cancel()

    def release(self, seq_ids: list[str]) -> int:
        return self.client.release(seq_ids, missing_ok=True)

    def shutdown(self) -> None:
        self.client.close()


class Async:
    """The asyncio client and its stream, each step run to completion on one event loop."""

    def __init__(self, target: str, timeout_s: float | None) -> None:
        self._runner = asyncio.Runner()
        self.client = self._run(lambda: AsyncChunkAttnClient(target, timeout_s=timeout_s))

    def _run(self, step: Callable[[], Any]) -> Any:
        async def on_the_loop() -> Any:
            result = step()
            return await result if asyncio.iscoroutine(result) else result

        return self._runner.run(on_the_loop())

    def stream(self) -> Any:
        return self._run(self.client.stream)

    def attend(self, stream: Any, *args: Any, **options: Any) -> Any:
        return self._run(lambda: stream.attend(*args, **options))

    def interrupted(self, stream: Any, *args: Any) -> type[BaseException]:
        """A call whose task is cancelled while it waits (here by wait_for); the exception it raised."""
        with pytest.raises(TimeoutError):
            self._run(lambda: asyncio.wait_for(stream.attend(*args), 0.5))
        return TimeoutError

    def close(self, stream: Any) -> None:
        self._run(stream.close)

    def cancel(self, stream: Any) -> None:
        self._run(stream.cancel)

    def release(self, seq_ids: list[str]) -> int:
        return int(self._run(lambda: self.client.release(seq_ids, missing_ok=True)))

    def shutdown(self) -> None:
        self._run(self.client.close)
        self._runner.close()


Side = Sync | Async
SIDES: dict[str, type[Sync] | type[Async]] = {"sync": Sync, "async": Async}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "1024", "--idle-timeout-s", "0") as s:
        yield s


@contextlib.contextmanager
def side_for(kind: str, target: str, timeout_s: float | None = 60) -> Iterator[Side]:
    side = SIDES[kind](target, timeout_s)
    try:
        yield side
    finally:
        side.shutdown()


def call(seq_id: str, position: int, n: int = 1) -> tuple[Any, ...]:
    """attend's arguments: layer 0, one sequence's ``n`` tokens from ``position``."""
    q, k, v = qkv(np.random.default_rng(position), n)
    return 0, [BatchEntry(seq_id, position, n)], q, k, v


def failing(side: Side, stream: Any, *args: Any) -> ChunkAttnError:
    with pytest.raises(ChunkAttnError) as err:
        side.attend(stream, *args)
    return err.value


def assert_broken(side: Side, stream: Any, error: ChunkAttnError, seq_id: str, position: int) -> None:
    """Every later call raises the stream's error, at once."""
    for later in range(2):
        started = time.monotonic()
        again = failing(side, stream, *call(seq_id, position + later))
        assert (again.code, again.message) == (error.code, error.message)
        assert time.monotonic() - started < 1


@contextlib.contextmanager
def stopped(server: ServerProcess) -> Iterator[None]:
    """The server stopped (SIGSTOP): it answers nothing until the block ends."""
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


KINDS = pytest.mark.parametrize("kind", list(SIDES))


@pytest.mark.server
@KINDS
def test_calls_are_answered_as_the_reference_answers_them(server: ServerProcess, kind: str) -> None:
    ref = ReferenceModel([16, 16, 16, 0])
    with side_for(kind, server.target) as side:
        stream = side.stream()
        for layer in range(4):
            for entries in ([BatchEntry(f"{kind}-a", 0, 20)], [BatchEntry(f"{kind}-a", 20, 1)]):
                q, k, v = qkv(np.random.default_rng(layer), entries[0].num_tokens)
                out = side.attend(stream, layer, entries, q, k, v)
                assert np.abs(out - ref.attend(layer, entries, q, k, v)).max() < 1e-5
        side.close(stream)
        assert side.release([f"{kind}-a"]) == 1


@pytest.mark.server
@KINDS
def test_a_failed_call_leaves_the_stream_usable(server: ServerProcess, kind: str) -> None:
    seq = f"{kind}-usable"
    with side_for(kind, server.target) as side:
        stream = side.stream()
        side.attend(stream, *call(seq, 0, 3))
        err = failing(side, stream, *call(seq, 9))  # a gap: the sequence holds 3 tokens
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert side.attend(stream, *call(seq, 3)).shape == (1, H, D)
        with pytest.raises(ValueError, match="end_of_sequence names"):  # refused before it is sent
            side.attend(stream, *call(seq, 4), end_of_sequence=["other"])
        assert side.attend(stream, *call(seq, 4)).shape == (1, H, D)
        side.close(stream)
        side.release([seq])


@pytest.mark.server
@KINDS
def test_a_call_without_an_answer_times_out_and_cancels_the_stream(server: ServerProcess, kind: str) -> None:
    seq = f"{kind}-late"
    with side_for(kind, server.target, timeout_s=1) as side:
        stream = side.stream()
        side.attend(stream, *call(seq, 0))  # answered
        with stopped(server):
            started = time.monotonic()
            err = failing(side, stream, *call(seq, 1))
            assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "within 1 s" in err.message
            assert time.monotonic() - started < 5
            broken = failing(side, stream, *call(seq, 1))  # cancelled: later calls fail at once
            assert broken.code == grpc.StatusCode.CANCELLED
            assert "no answer within 1 s" in broken.message
            assert_broken(side, stream, broken, seq, 1)
            side.close(stream)  # returns: nothing left to wait for
        side.release([seq])


@pytest.mark.server
@KINDS
def test_an_interrupted_call_cancels_the_stream(server: ServerProcess, kind: str) -> None:
    seq = f"{kind}-interrupted"
    with side_for(kind, server.target) as side:
        stream = side.stream()
        side.attend(stream, *call(seq, 0))
        with stopped(server):
            side.interrupted(stream, *call(seq, 1))
            broken = failing(side, stream, *call(seq, 1))
            assert broken.code == grpc.StatusCode.CANCELLED
            assert "interrupted" in broken.message
            assert_broken(side, stream, broken, seq, 1)
            side.close(stream)
        side.release([seq])


@pytest.mark.server
@KINDS
def test_a_cancelled_stream_fails_every_later_call(server: ServerProcess, kind: str) -> None:
    seq = f"{kind}-cancelled"
    with side_for(kind, server.target) as side:
        stream = side.stream()
        side.attend(stream, *call(seq, 0))
        side.cancel(stream)
        broken = failing(side, stream, *call(seq, 1))
        assert broken.code == grpc.StatusCode.CANCELLED
        assert_broken(side, stream, broken, seq, 2)
        side.cancel(stream)  # again: nothing happens
        side.close(stream)  # never raises
        side.release([seq])


@pytest.mark.server
@KINDS
def test_a_closed_stream_has_ended(server: ServerProcess, kind: str) -> None:
    seq = f"{kind}-closed"
    with side_for(kind, server.target) as side:
        stream = side.stream()
        side.attend(stream, *call(seq, 0))
        side.close(stream)
        side.close(stream)  # twice: nothing happens
        ended = failing(side, stream, *call(seq, 1))
        assert (ended.code, ended.message) == (grpc.StatusCode.UNAVAILABLE, "the stream ended")
        assert_broken(side, stream, ended, seq, 1)
        side.release([seq])


@pytest.mark.server
@KINDS
@pytest.mark.parametrize("via", ["direct", "envoy-like proxy"])
def test_a_lost_connection_is_unavailable_for_this_call_and_every_later_one(kind: str, via: str) -> None:
    with ServerProcess(*SMALL, "--idle-timeout-s", "0") as server, contextlib.ExitStack() as stack:
        target = server.target if via == "direct" else stack.enter_context(ResettingProxy(server.port)).target
        side = stack.enter_context(side_for(kind, target))
        stream = side.stream()
        side.attend(stream, *call("a", 0, 2))
        server.proc.send_signal(signal.SIGKILL)  # no drain, no goodbye
        server.proc.wait()
        lost = failing(side, stream, *call("a", 2, 2))
        assert lost.code == grpc.StatusCode.UNAVAILABLE, lost
        assert lost.message.startswith(LOST), lost
        assert_broken(side, stream, lost, "a", 4)
        side.close(stream)


def test_a_request_that_grpc_aio_could_not_send_is_a_lost_stream() -> None:
    """grpc.aio replaces the status of a stream gone under a request it sends with INTERNAL "Internal error
    from Core": on a stream, that is UNAVAILABLE as a lost connection is; on a unary call it stays INTERNAL."""
    unsent = FakeCall(grpc.StatusCode.INTERNAL, "Internal error from Core")
    lost = failure(unsent)
    assert lost.code == grpc.StatusCode.UNAVAILABLE
    assert lost.message.startswith(LOST)
    assert ChunkAttnError.from_rpc(unsent).code == grpc.StatusCode.INTERNAL
    server_bug = failure(FakeCall(grpc.StatusCode.INTERNAL, "unexpected error: KeyError('a')"))
    assert (server_bug.code, server_bug.message) == (grpc.StatusCode.INTERNAL, "unexpected error: KeyError('a')")
