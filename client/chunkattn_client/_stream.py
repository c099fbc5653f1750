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
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from chunkattn_client._errors import ChunkAttnError, lost_connection_message
from chunkattn_client._requests import Entries, Output, attend_blocks_request, attend_request, decode_attend_response
from chunkattn_client.batch import BlockRows

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
        if self.broken is not None:
            raise ChunkAttnError(*self.broken)
        self._next_id += 1
        return self._next_id, build(self._next_id)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a call's wait for its answer: a timeout (queue.Empty, TimeoutError) becomes DEADLINE_EXCEEDED,
        and it or anything else that stops the wait (an interrupt, a cancelled task) cancels the stream."""
        try:
            yield
        except (queue.Empty, TimeoutError):
            self._break(f"an earlier call got no answer within {self.timeout_s:g} s")
            raise ChunkAttnError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer on the stream within {self.timeout_s:g} s; the stream was cancelled",
            ) from None
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
