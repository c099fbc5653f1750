"""The contract of AttendStream and AsyncAttendStream, written once.

Calls over one AttendStream RPC are answered in order; a reader (a thread, or an asyncio task) hands each
answer over, so that a call can stop waiting. Then:

- a call answered with an error status raises ChunkAttnError, and the stream stays usable;
- a call that gets no answer within ``timeout_s`` (None: wait for ever) raises DEADLINE_EXCEEDED and
  cancels the stream, and so does an interrupted call (KeyboardInterrupt, a cancelled task): its answer
  would otherwise be taken for the next call's;
- a stream that ended (the server ended the RPC: UNAVAILABLE "the stream ended"; the connection was lost:
  UNAVAILABLE, see ``connection_lost``; it was cancelled: CANCELLED) raises that error for the call that
  finds out and the same for every later call, at once;
- ``close()`` ends the requests and waits up to ``timeout_s`` for the server to end the RPC, then cancels
  it; it never raises. ``cancel()`` ends the RPC at once, answered or not, while a call waits too.

``PlaneStream`` and ``AsyncPlaneStream`` keep the same contract over the data plane (a client's ``stream()``
where its Attend calls go over ZeroMQ): each call is a data-plane request matched to its answer by its id, a
lost connection breaks the stream, and close() / cancel() end it (later calls: CANCELLED).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from chunkattn_client._errors import ChunkAttnError, LostConnection, NoAnswer, lost_connection_message
from chunkattn_client._requests import Entries, Output, attend_blocks_request, attend_request, decode_attend_response
from chunkattn_client.batch import BlockRows

if TYPE_CHECKING:
    from chunkattn_client._zmqplane import AsyncZmqDataPlane, ZmqDataPlane

# What a reader hands over: a serialized response, the error that ended the stream, or None (it ended).
Answer = bytes | ChunkAttnError | None


class StreamState:
    """A stream's calls: their request ids, and why the stream is broken (every later call fails so)."""

    def __init__(self, timeout_s: float | None, cancel: Callable[[], object]) -> None:
        self.timeout_s = timeout_s
        self._cancel = cancel  # the RPC's (never the stream's: a dropped stream is collected and cancelled)
        self.broken: tuple[grpc.StatusCode, str] | None = None
        self._next_id = 0

    def request(self, layer: int, entries: Entries, q: Any, k: Any, v: Any, **options: Any) -> tuple[int, bytes]:
        """The next call's request id and request; the stream's error once it is broken."""
        return self._next(lambda rid: attend_request(layer, entries, q, k, v, **options, request_id=rid))

    def request_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any, v: Any, dtype: str | None
    ) -> tuple[int, bytes]:
        """As ``request``, for a block-addressed call."""
        return self._next(lambda rid: attend_blocks_request(layer, rows, q, k, v, dtype=dtype, request_id=rid))

    def _next(self, build: Callable[[int], bytes]) -> tuple[int, bytes]:
        self.check()
        self._next_id += 1
        return self._next_id, build(self._next_id)

    def check(self) -> None:
        """The stream's error once it is broken."""
        if self.broken is not None:
            raise ChunkAttnError(*self.broken)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a call's wait for its answer: a timeout (queue.Empty, TimeoutError, or the data plane's
        NoAnswer) becomes DEADLINE_EXCEEDED, and it or anything else that stops the wait (an interrupt, a
        cancelled task) cancels the stream; the data plane's LostConnection breaks it as a lost RPC does."""
        try:
            yield
        except (queue.Empty, TimeoutError, NoAnswer):
            self._break(f"an earlier call got no answer within {self.timeout_s:g} s")
            raise ChunkAttnError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer on the stream within {self.timeout_s:g} s; the stream was cancelled",
            ) from None
        except LostConnection as e:
            self.broken = (e.code, e.message)
            raise
        except ChunkAttnError:  # the call's own status: the stream goes on
            raise
        except BaseException:  # e.g. KeyboardInterrupt: the answer may still come, for nobody
            self._break("an earlier call on it was interrupted")
            raise

    def answer(self, request_id: int, answer: Answer) -> Output:
        """The call's output, or its error (the stream's, from now on, when the stream ended)."""
        if answer is None:
            self.broken = (grpc.StatusCode.UNAVAILABLE, "the stream ended")
            raise ChunkAttnError(*self.broken)
        if isinstance(answer, ChunkAttnError):
            self.broken = (answer.code, answer.message)
            raise answer
        return decode_attend_response(answer, request_id)

    def _break(self, why: str) -> None:
        self.broken = (grpc.StatusCode.CANCELLED, f"the stream was cancelled: {why}")
        self._cancel()


def failure(e: BaseException) -> ChunkAttnError:
    """What a reader hands over when reading the stream failed, so that no waiting call is left without an
    answer: the RPC's error, CANCELLED for a cancelled one (grpc.aio raises CancelledError), else UNKNOWN."""
    if isinstance(e, grpc.RpcError):
        if _unsent(e):
            code, details = grpc.StatusCode.INTERNAL, _UNSENT
            return ChunkAttnError(grpc.StatusCode.UNAVAILABLE, lost_connection_message(code, details))
        return ChunkAttnError.from_rpc(e)
    if isinstance(e, asyncio.CancelledError):
        return ChunkAttnError(grpc.StatusCode.CANCELLED, "the stream was cancelled")
    return ChunkAttnError(grpc.StatusCode.UNKNOWN, f"reading the stream failed: {e!r}")


# grpc.aio's status for a request it could not send, the stream having gone under it (the server died, a
# proxy reset it): it replaces the status the stream ended with, so the reader sees this instead of
# "Stream removed". Never a server's message; on a unary call it stays INTERNAL (``connection_lost``).
_UNSENT = "Internal error from Core"


def _unsent(e: grpc.RpcError) -> bool:
    code, details = getattr(e, "code", lambda: None)(), getattr(e, "details", lambda: None)()
    return code == grpc.StatusCode.INTERNAL and details == _UNSENT


class _PlaneStreamBase:
    """What PlaneStream and AsyncPlaneStream share: the stream's state and its requests' builders."""

    def __init__(self, timeout_s: float | None) -> None:
        self._state = StreamState(timeout_s, lambda: None)  # nothing to cancel: each call is a message

    def _end(self, why: str) -> None:
        if self._state.broken is None:
            self._state.broken = (grpc.StatusCode.CANCELLED, f"the stream was {why}")

    @staticmethod
    def _builder(layer: int, entries: Entries, q: Any, k: Any, v: Any, **options: Any) -> Callable[[int], bytes]:
        return lambda rid: attend_request(layer, entries, q, k, v, **options, request_id=rid)

    @staticmethod
    def _blocks_builder(
        layer: int, rows: BlockRows, q: Any, k: Any, v: Any, dtype: str | None
    ) -> Callable[[int], bytes]:
        return lambda rid: attend_blocks_request(layer, rows, q, k, v, dtype=dtype, request_id=rid)


class PlaneStream(_PlaneStreamBase):
    """AttendStream's contract over a ZmqDataPlane (see the module docstring). Use as a context manager."""

    def __init__(self, plane: ZmqDataPlane, timeout_s: float | None) -> None:
        super().__init__(timeout_s)
        self._plane = plane
        self._lock = threading.Lock()

    def __enter__(self) -> PlaneStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the stream (later calls: CANCELLED). Never raises."""
        self._end("closed")

    def cancel(self) -> None:
        """As close(): a call in flight still gets its answer."""
        self._end("cancelled")

    def attend(self, layer: int, entries: Entries, q: Any, k: Any = None, v: Any = None, **options: Any) -> Output:
        """As ``ChunkAttnClient.attend``, over the stream."""
        return self._call(self._builder(layer, entries, q, k, v, **options))

    def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Output:
        """As ``ChunkAttnClient.attend_blocks``, over the stream."""
        return self._call(self._blocks_builder(layer, rows, q, k, v, dtype))

    def _call(self, build: Callable[[int], bytes]) -> Output:
        with self._lock:
            self._state.check()
            with self._state.waiting():
                return self._plane.call(build, self._state.timeout_s)


class AsyncPlaneStream(_PlaneStreamBase):
    """AsyncAttendStream's contract over an AsyncZmqDataPlane; ``async with`` closes it."""

    def __init__(self, plane: AsyncZmqDataPlane, timeout_s: float | None) -> None:
        super().__init__(timeout_s)
        self._plane = plane
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncPlaneStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream (later calls: CANCELLED). Never raises."""
        self._end("closed")

    def cancel(self) -> None:
        self._end("cancelled")

    async def attend(
        self, layer: int, entries: Entries, q: Any, k: Any = None, v: Any = None, **options: Any
    ) -> Output:
        """ChunkAttnClient.attend, over the stream."""
        return await self._call(self._builder(layer, entries, q, k, v, **options))

    async def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Output:
        """ChunkAttnClient.attend_blocks, over the stream."""
        return await self._call(self._blocks_builder(layer, rows, q, k, v, dtype))

    async def _call(self, build: Callable[[int], bytes]) -> Output:
        async with self._lock:
            self._state.check()
            with self._state.waiting():
                return await self._plane.call(build, self._state.timeout_s)
