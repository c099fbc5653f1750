"""The synchronous client. ``aio.py`` has the same methods for asyncio; both send the calls of ``_requests``.

    with ChunkAttnClient("localhost:50051") as c:
        out = c.attend(0, [BatchEntry("s", 0, 100)], q, k, v)   # numpy in, numpy out

Every failure surfaces as ``ChunkAttnError`` carrying the gRPC status code and the server's message; a call
whose connection to the server was lost gets UNAVAILABLE (``connection_lost``).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Unpack

import grpc

from chunkattn_client import _requests as calls
from chunkattn_client._base import ClientBase, Routed
from chunkattn_client._channel import (  # public here too, as they always were; the server imports _channel
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_KEEPALIVE_S,
    MIN_KEEPALIVE_S,
    ROUTE_HEADER,
    Credentials,
    bearer,
    channel_options,
    check_keepalive,
    open_channel,
)
from chunkattn_client._errors import ChunkAttnError, connection_lost, lost_connection_message, rpc_errors
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._requests import (
    ATTEND,
    ATTEND_STREAM,
    AttendOptions,
    Entries,
    Output,
    TransferOptions,
    attend_request,
    decode_attend_response,
    renamed,
    transfer_request,
)
from chunkattn_client._stream import Answer, PlaneStream, StreamState, failure
from chunkattn_client._types import (
    BlockSpace,
    Copied,
    Grant,
    KVImport,
    KVTransfer,
    LayerInfo,
    OpenSpace,
    ServerInfo,
    Truncated,
)
from chunkattn_client.batch import BlockRows

if TYPE_CHECKING:
    from chunkattn_client._zmqplane import ZmqDataPlane

__all__ = [
    "ATTEND",
    "ATTEND_STREAM",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_KEEPALIVE_S",
    "MIN_KEEPALIVE_S",
    "ROUTE_HEADER",
    "AttendStream",
    "ChunkAttnClient",
    "ChunkAttnError",
    "Credentials",
    "KVImport",
    "KVTransfer",
    "LayerInfo",
    "Routed",
    "ServerInfo",
    "Truncated",
    "attend_request",
    "bearer",
    "channel_options",
    "check_keepalive",
    "connection_lost",
    "decode_attend_response",
    "lost_connection_message",
    "open_channel",
    "renamed",
    "rpc_errors",
    "transfer_request",
]

T = TypeVar("T")


class ChunkAttnClient(ClientBase):
    """A blocking client. Thread-safe: gRPC channels may be shared between threads, and on the data plane
    each thread has its own socket.

    target: "host:port". root_certificates, certificate_chain, private_key, token: see ``Credentials``
    (none of them: plaintext, no token). timeout_s: the deadline of each call (None: none). route: the
    routing key for Envoy in front of several replicas (see ``Routed``; default: one random key per client).
    data_plane: "auto", "grpc" or "zmq" (see ``ClientBase``; default $CHUNKATTN_DATA_PLANE, else "auto").
    """

    api: ClassVar[Any] = grpc
    lock: ClassVar[Any] = threading.Lock

    def __enter__(self) -> ChunkAttnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close this client's data plane (its sockets and their context; a with_route client has its own) and
        the channel (unless this is a with_route client: the channel is its parent's)."""
        if self._plane is not None:
            self._plane.close()
            self._forget_plane()
        self._end_context()
        if self._owns_channel:
            self._channel.close()

    def open_data_plane(self) -> str:
        """Make the data-plane choice now (else the first Attend makes it); returns ``data_plane``."""
        self._data_plane()
        return self.data_plane

    def _data_plane(self) -> ZmqDataPlane | None:
        """The open data plane, or None for gRPC; the first call decides (one OpenDataPlane call)."""
        if self._plane_decided:
            plane: ZmqDataPlane | None = self._plane
            return plane
        with self._opening:  # its threads open one session
            if not self._plane_decided:
                opened = self._now()
                try:
                    outcome: Any = self._unary(calls.open_data_plane())
                except ChunkAttnError as e:
                    outcome = e
                offer = self._offer(outcome, opened)
                if offer is not None:
                    from chunkattn_client._zmqplane import ZmqDataPlane  # zmq only once it is used

                    self._plane = ZmqDataPlane(offer, self._reopen, self._context())
                    self._plane_decided = True
            opened_plane: ZmqDataPlane | None = self._plane
            return opened_plane

    def _reopen(self) -> Any:
        opened = self._now()
        return self._renewed(self._unary(calls.open_data_plane()), opened)

    def _unary(self, call: calls.Call[T]) -> T:
        with rpc_errors():
            return call.decode(self._start(call))

    def info(self) -> ServerInfo:
        return self._unary(calls.info())

    def health(self, service: str = "") -> str:
        """The standard health status name: "SERVING", "NOT_SERVING", ... ("" = the whole server)."""
        return self._unary(calls.health(service))

    def attend(
        self, layer: int, entries: Entries, q: Any, k: Any = None, v: Any = None, **options: Unpack[AttendOptions]
    ) -> Output:
        """One layer, one batch. q [T, H, D], k/v [T, Hkv, D] (numpy float32/float16, uint16 words with
        dtype="bfloat16", or torch tensors); k/v None for a KV-sharing layer. Sequences named in
        ``end_of_sequence`` are released after the call. Returns [T, H, D] (uint16 words for bfloat16)."""
        plane = self._data_plane()
        if plane is not None:
            return plane.call(
                lambda rid: calls.attend_request(layer, entries, q, k, v, **options, request_id=rid), self.timeout_s
            )
        return self._unary(calls.attend(layer, entries, q, k, v, **options))

    def release(self, seq_ids: Sequence[str], *, missing_ok: bool = False) -> int:
        """Release sequences; returns how many existed."""
        return self._unary(calls.release(seq_ids, missing_ok))

    def open_block_space(
        self, num_blocks: int, *, layer_planes: Sequence[int] = (), lease_s: float = 0.0
    ) -> BlockSpace:
        """Open a block space of ``num_blocks`` blocks (the block API; see docs/vllm.md). ``layer_planes``:
        per layer the plane its K/V takes in a block (empty: one per writing layer). ``lease_s``: seconds it
        may go unused before the server closes it (0: the server's --idle-timeout-s); renew it within that
        (``renew_block_space``). The answer's ``lease_s`` is the lease it got."""
        return self._unary(calls.open_block_space(num_blocks, layer_planes, lease_s))

    def close_block_space(self, space_id: str) -> int:
        """Close a block space; returns the pool blocks it gave back."""
        return self._unary(calls.close_block_space(space_id))

    def renew_block_space(self, space_id: str) -> float:
        """Mark a block space used now (its lease starts again); returns its lease in seconds (0: none)."""
        return self._unary(calls.renew_block_space(space_id))

    def list_block_spaces(self) -> list[OpenSpace]:
        """The caller's tenant's open block spaces, oldest first (one whose id was lost can still be closed)."""
        return self._unary(calls.list_block_spaces())

    def grant_blocks(
        self,
        space_id: str,
        block_ids: Sequence[int],
        grant_id: str,
        *,
        num_tokens: int = 0,
        ttl_s: float = 0.0,
        to_tenant: str = "",
        target: str = "",
        target_token: str = "",
        whole: bool = False,
        tag: str = "",
    ) -> Grant:
        """Hand blocks of a space over (GrantBlocks): the server parks a copy of them, every plane, under
        ``grant_id`` (32 to 64 characters of [A-Za-z0-9_-], random: it is the capability) until CopyBlocks takes
        it or ``ttl_s`` (0: 60 s) passes; ``to_tenant`` may take it too. ``num_tokens``: what the blocks hold.
        With ``target`` (host:port of another server) the grant is parked there instead, its live blocks sent
        by this server (``target_token``: the credentials it presents there; empty: its --transfer-token), or
        every block's every plane with ``whole``. ``tag``: what the blocks hold, in your words (``expect_tag``)."""
        return self._unary(
            calls.grant_blocks(
                space_id, block_ids, grant_id, num_tokens, ttl_s, to_tenant, target, target_token, whole, tag
            )
        )

    def copy_blocks(
        self,
        dest_space_id: str,
        dest_block_ids: Sequence[int],
        *,
        space_id: str | None = None,
        grant_id: str | None = None,
        source_block_ids: Sequence[int] = (),
        expect_tag: str = "",
    ) -> Copied:
        """Copy blocks into ``dest_space_id``'s ``dest_block_ids`` (CopyBlocks), every plane: from another of
        your spaces (``space_id``, its ``source_block_ids``) or from a grant (``grant_id``, which this takes;
        ``source_block_ids`` index its blocks, empty: all; with ``expect_tag``, only a grant of that tag)."""
        return self._unary(
            calls.copy_blocks(
                dest_space_id,
                dest_block_ids,
                space_id=space_id,
                grant_id=grant_id,
                source_block_ids=source_block_ids,
                expect_tag=expect_tag,
            )
        )

    def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Output:
        """One layer, one block-addressed batch (``BlockRows``): q [T, H, D], k/v [T, Hkv, D] as for
        ``attend`` (None for a KV-sharing layer). Each row is causal attention over its keys; the layer's chunk
        size is not applied (the caller windows). Returns [T, H, D]."""
        plane = self._data_plane()
        if plane is not None:
            return plane.call(
                lambda rid: calls.attend_blocks_request(layer, rows, q, k, v, dtype=dtype, request_id=rid),
                self.timeout_s,
            )
        return self._unary(calls.attend_blocks(layer, rows, q, k, v, dtype))

    def fork(self, parent: str, child: str) -> int:
        """A new sequence ``child`` sharing ``parent``'s KV copy-on-write; returns the blocks shared."""
        return self._unary(calls.fork(parent, child))

    def truncate(self, seq_id: str, length: int) -> Truncated:
        """Take a sequence back to its first ``length`` tokens in every layer, as if the later ones had never
        been sent (speculative decoding: drop the drafts a verify call rejected). FAILED_PRECONDITION when
        ``length`` is past the sequence's length or further back than the server holds (its message names
        min_length); NOT_FOUND for an unknown sequence; nothing changes then."""
        return self._unary(calls.truncate(seq_id, length))

    def export_kv(self, seq_id: str, *, layers: Sequence[int] = (), max_message_bytes: int = 0) -> Iterator[pb.KVChunk]:
        """A sequence's live KV as KVChunk messages (header, blocks, trailer), e.g. for ``kvfile.write``."""
        call = self._start(calls.export_kv(seq_id, layers, max_message_bytes))

        def messages() -> Iterator[pb.KVChunk]:
            with rpc_errors():
                yield from call

        return messages()

    def import_kv(self, messages: Iterable[pb.KVChunk], *, seq_id: str | None = None) -> KVImport:
        """Import an exported KV stream as a new sequence (named ``seq_id``, else the exported id)."""
        return self._unary(calls.import_kv(calls.renaming(messages, seq_id)))

    def transfer_kv(self, seq_id: str, target: str, **options: Unpack[TransferOptions]) -> KVTransfer:
        """Have this server stream ``seq_id``'s KV straight into the server at ``target`` ("host:port"),
        presenting ``target_token`` there (empty: the server's own --transfer-token, if any). Keywords
        (TransferOptions): new_seq_id (its id there; "": the same), release_after (release it here once
        moved), layers (only these; (): all), target_token."""
        return self._unary(calls.transfer_kv(seq_id, target, **options))

    def stream(self) -> AttendStream | PlaneStream:
        """A bidirectional stream for a long-lived model runner: one round trip per call, no new RPC.
        Each call on it waits at most ``timeout_s`` for its answer; then the stream is cancelled. On the data
        plane, a ``PlaneStream`` with the same contract (its calls are data-plane messages)."""
        plane = self._data_plane()
        if plane is not None:
            return PlaneStream(plane, self.timeout_s)
        return AttendStream(self._attend_stream, timeout_s=self.timeout_s, metadata=self._metadata)


class AttendStream:
    """Calls over one AttendStream RPC, answered in order. Use as a context manager.

    A failed call raises ChunkAttnError and the stream stays usable; a broken stream raises too, for
    that call and every later one. A call that gets no answer within ``timeout_s`` (None: wait for ever)
    raises DEADLINE_EXCEEDED and cancels the stream, and so does an interrupted call (its answer would
    otherwise be taken for the next call's). A stream dropped without ``close()`` is cancelled. The
    contract is AsyncAttendStream's too (``_stream``).
    """

    def __init__(
        self,
        method: grpc.StreamStreamMultiCallable[bytes, bytes],
        *,
        timeout_s: float | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._call: Any = method(iter(self._requests.get, None), metadata=metadata)
        # A reader thread hands answers over, so that a call can stop waiting (gRPC's iterator cannot). It
        # holds the call and the queue, not the stream, so that a dropped stream is collected and cancelled.
        self._answers: queue.Queue[Answer] = queue.Queue()
        self._reader = threading.Thread(
            target=_read_answers, args=(self._call, self._answers), name="chunkattn-stream-reader", daemon=True
        )
        self._reader.start()
        weakref.finalize(self, _end_stream, self._call, self._requests)
        self._state = StreamState(timeout_s, self._call.cancel)
        self._lock = threading.Lock()

    def __enter__(self) -> AttendStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """End the stream. Never raises: a stream that already failed has nothing left to close. With
        ``timeout_s`` None and a server that never ends the RPC this waits; ``cancel()`` does not."""
        with self._lock:
            self._requests.put(None)
            self._reader.join(self._state.timeout_s)  # the server ends the RPC once the requests end
            if self._reader.is_alive():
                self._call.cancel()
                self._reader.join()

    def cancel(self) -> None:
        """End the RPC at once, answered or not (takes no lock: works while a call waits)."""
        self._call.cancel()

    def attend(
        self, layer: int, entries: Entries, q: Any, k: Any = None, v: Any = None, **options: Unpack[AttendOptions]
    ) -> Output:
        """As ``ChunkAttnClient.attend``, over the stream."""
        with self._lock:
            return self._call_with(*self._state.request(layer, entries, q, k, v, **options))

    def attend_blocks(
        self, layer: int, rows: BlockRows, q: Any, k: Any = None, v: Any = None, *, dtype: str | None = None
    ) -> Output:
        """As ``ChunkAttnClient.attend_blocks``, over the stream."""
        with self._lock:
            return self._call_with(*self._state.request_blocks(layer, rows, q, k, v, dtype))

    def _call_with(self, rid: int, request: bytes) -> Output:
        self._requests.put(request)
        with self._state.waiting():
            answer = self._answers.get(timeout=self._state.timeout_s)
        return self._state.answer(rid, answer)


def _read_answers(call: Any, answers: queue.Queue[Answer]) -> None:
    """The reader thread: every answer of ``call`` into ``answers``, then None, or the error that ended it."""
    try:
        for answer in call:
            answers.put(answer)
        answers.put(None)
    except BaseException as e:  # never leave a waiting call without an answer
        answers.put(failure(e))


def _end_stream(call: Any, requests: queue.Queue[bytes | None]) -> None:
    """Finalizer of a dropped AttendStream: end the request iterator and cancel the RPC."""
    requests.put(None)
    call.cancel()
