"""The synchronous client. ``aio.py`` has the same methods for asyncio.

    with ChunkAttnClient("localhost:50051") as c:
        out = c.attend(0, [BatchEntry("s", 0, 100)], q, k, v)   # numpy in, numpy out

Every failure surfaces as ``ChunkAttnError`` carrying the gRPC status code and the server's message; a call
whose connection to the server was lost gets UNAVAILABLE (``connection_lost``).
"""

from __future__ import annotations

import contextlib
import copy
import queue
import re
import secrets
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import grpc
import numpy.typing as npt
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkattn_client import codec, dtypes, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2_grpc as pb_grpc
from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import route_problem, token_problem

# Large enough for a 4,096-token prefill of Llama-4-Scout's shape in bf16 (q, k, v: 56 MiB) with room.
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20


class ChunkAttnError(Exception):
    """A call failed. ``code`` is the grpc.StatusCode; ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> ChunkAttnError:
        """The ChunkAttnError of a failed gRPC call: its status and details, except that a connection lost
        mid-call (see ``connection_lost``) is UNAVAILABLE, whatever status gRPC gave it, with a message
        that says so."""
        # Failed calls raise grpc.Call objects (code(), details()); a bare RpcError has neither.
        code = getattr(err, "code", lambda: None)()
        details: str = getattr(err, "details", lambda: None)() or str(err)
        code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
        if connection_lost(code, details):
            return cls(grpc.StatusCode.UNAVAILABLE, lost_connection_message(code, details))
        return cls(code, details)


# What gRPC core's HTTP/2 transport says of a call whose connection or stream went away under it, and never
# a chunkattn server's message: "Stream removed (Socket closed)" (the server died), "Stream removed
# (recvmsg:Connection reset by peer (104))", and "Stream removed (RST_STREAM (Received RST_STREAM with error
# code 2))" where a proxy reset the stream: Envoy, when the replica behind it dies mid-stream. gRPC gives
# the last INTERNAL (an RST_STREAM is INTERNAL by its HTTP/2 mapping), the others UNAVAILABLE.
_CONNECTION_LOST = re.compile(r"Stream removed(?: \(.*\))?|Received RST_STREAM with error code \d+", re.DOTALL)


def connection_lost(code: grpc.StatusCode, details: str) -> bool:
    """Whether a call failed because its connection to the server was lost (or a proxy reset it): INTERNAL
    or UNAVAILABLE with gRPC core's own words for it. An INTERNAL with the server's message (a server bug)
    is not."""
    transport = code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    return transport and _CONNECTION_LOST.fullmatch(details) is not None


def lost_connection_message(code: grpc.StatusCode, details: str) -> str:
    """The message of a call whose connection was lost: what happened, gRPC's original status, what it means."""
    return (
        f"the connection to the server was lost mid-call (gRPC: {code.name}: {details}): the server went away"
        " or a proxy in between reset the call. Whether the server carried this call out is unknown; on a"
        " stream, the answers received before stand, and an export or import cut short is incomplete. Retry on"
        " a new call or stream (the channel reconnects); the server that answers it, a restarted one or, behind"
        " Envoy, another replica, may not hold this session's KV (NOT_FOUND): then start the sequence again"
    )


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Turn a failed gRPC call into ChunkAttnError (works around ``await`` too)."""
    try:
        yield
    except grpc.RpcError as err:
        raise ChunkAttnError.from_rpc(err) from None


@dataclass(frozen=True)
class LayerInfo:
    index: int
    chunk_size: int
    kv_group: int
    kv_source: int | None
    scale: float
    alibi: bool
    alibi_slopes: tuple[float, ...] = ()  # one per query head when alibi
    # A float8 cache holds K / k_scale and V / v_scale (1 for other cache dtypes; 0 while the server
    # calibrates them and the layer has had no write).
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class ServerInfo:
    """What Info returns: the model's shape and the server's state."""

    version: str
    backend: str
    device: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    layers: tuple[LayerInfo, ...]
    block_size: int
    num_blocks: int
    free_blocks: int
    bytes_per_block: int
    cache_dtype: str
    dtypes: tuple[str, ...]
    active_sequences: int
    max_message_bytes: int
    compute_dtype: str = ""  # "" from a server older than the field
    # Tokens a chunked layer keeps before its current chunk: how far Truncate may go back across a chunk
    # boundary (chunkattn-server --spec-window; 0 from a server older than the field).
    spec_window: int = 0

    @classmethod
    def from_pb(cls, r: pb.InfoResponse) -> ServerInfo:
        return cls(
            version=r.version,
            backend=r.backend,
            device=r.device,
            num_heads=r.num_heads,
            num_kv_heads=r.num_kv_heads,
            head_size=r.head_size,
            layers=tuple(
                LayerInfo(
                    index=x.index,
                    chunk_size=x.chunk_size,
                    kv_group=x.kv_group,
                    kv_source=x.kv_source if x.HasField("kv_source") else None,
                    scale=x.scale,
                    alibi=x.alibi,
                    alibi_slopes=tuple(x.alibi_slopes),
                    k_scale=x.k_scale,
                    v_scale=x.v_scale,
                )
                for x in r.layers
            ),
            block_size=r.block_size,
            num_blocks=r.num_blocks,
            free_blocks=r.free_blocks,
            bytes_per_block=r.bytes_per_block,
            cache_dtype=_dtype_name(r.cache_dtype),
            dtypes=tuple(_dtype_name(d) for d in r.dtypes),
            active_sequences=r.active_sequences,
            max_message_bytes=r.max_message_bytes,
            compute_dtype=_dtype_name(r.compute_dtype) if r.compute_dtype else "",
            spec_window=r.spec_window,
        )


@dataclass(frozen=True)
class Truncated:
    """What Truncate did: the blocks the sequence no longer holds (a block still shared with a fork stays
    with it), and how far back it may now be truncated: any length from ``min_length`` on (and a chunk
    boundary of every chunked layer, where none reads older keys)."""

    released_blocks: int
    min_length: int

    @classmethod
    def from_pb(cls, r: pb.TruncateResponse) -> Truncated:
        return cls(int(r.released_blocks), int(r.min_length))


@dataclass(frozen=True)
class KVImport:
    """What ImportKV created: the sequence, its blocks, and the blocks (records) and bytes received."""

    seq_id: str
    blocks: int
    records: int
    bytes: int


@dataclass(frozen=True)
class KVTransfer:
    """What TransferKV moved, how long it took, and whether the source released the sequence."""

    blocks: int
    records: int
    bytes: int
    seconds: float
    released: bool

    @classmethod
    def from_pb(cls, r: pb.TransferKVResponse) -> KVTransfer:
        return cls(r.blocks, r.records, r.bytes, r.seconds, r.released)


def renamed(chunk: pb.KVChunk, seq_id: str | None) -> pb.KVChunk:
    """The chunk, with its header's sequence id replaced when ``seq_id`` is given (import under a new id)."""
    if not seq_id or chunk.WhichOneof("part") != "header":
        return chunk
    copy = pb.KVChunk()
    copy.CopyFrom(chunk)
    copy.header.seq_id = seq_id
    return copy


def transfer_request(
    seq_id: str, target: str, new_seq_id: str, release_after: bool, layers: Sequence[int], target_token: str = ""
) -> pb.TransferKVRequest:
    return pb.TransferKVRequest(
        seq_id=seq_id,
        target=target,
        new_seq_id=new_seq_id,
        release_after=release_after,
        layers=list(layers),
        target_token=target_token,
    )


@dataclass(frozen=True)
class Credentials:
    """How a client proves who it is and checks whom it talks to (docs/security.md).

    root_certificates: PEM CA(s) the server's certificate must chain to; setting it (or a client
    certificate) turns TLS on. certificate_chain, private_key: PEM, a client certificate for servers that
    require one (mutual TLS); both or neither. token: sent as ``authorization: Bearer <token>`` call
    metadata on every call (over plaintext too: keep that to trusted networks).
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain and private_key go together: give both (mutual TLS), or neither")
        problem = None if self.token is None else token_problem(self.token)
        if problem:
            raise ValueError(problem)

    @property
    def tls(self) -> bool:
        return self.root_certificates is not None or self.certificate_chain is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """gRPC's credentials for a TLS channel (None: plaintext)."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that presents ``token`` (None or empty: none)."""
    return (("authorization", f"Bearer {token}"),) if token else None


# Envoy in front of several replicas hashes this header to pick one (deploy/envoy/envoy.yaml): the calls
# of one session must reach the replica that holds its KV. A direct connection ignores it.
ROUTE_HEADER = "x-chunkattn-route"


class Routed:
    """What ChunkAttnClient and AsyncChunkAttnClient share: the call metadata (token, routing key).

    route: the ``x-chunkattn-route`` value of every call. None (the default) makes a random key for this
    client, so that behind Envoy all of its calls reach one replica; "" sends no header (Envoy then picks a
    replica per call: only for servers that hold no state for you). ``with_route(key)`` gives a client on
    the same channel with another key: one per session spreads the sessions over the replicas.
    """

    _metadata: tuple[tuple[str, str], ...] | None

    def _set_metadata(self, token: str | None, route: str | None) -> None:
        route = secrets.token_hex(8) if route is None else route
        problem = route_problem(route)
        if problem:
            raise ValueError(problem)
        self._token, self.route = token, route
        self._metadata = (*(bearer(token) or ()), *(((ROUTE_HEADER, route),) if route else ())) or None
        self._owns_channel = True

    def with_route(self, route: str) -> Self:
        """This client, on the same channel (closing it leaves the channel open), with another route."""
        other = copy.copy(self)
        other._set_metadata(self._token, route)
        other._owns_channel = False
        return other


def open_channel(
    api: Any, target: str, max_message_bytes: int, keepalive_s: float | None, credentials: Credentials
) -> Any:
    """A channel from ``api`` (the grpc module, or grpc.aio): TLS when the credentials say so."""
    options = channel_options(max_message_bytes, keepalive_s)
    creds = credentials.channel_credentials()
    if creds is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, creds, options=options)


# Keepalive pings: chunkattn servers take one every MIN_KEEPALIVE_S or more (server.PING_POLICY).
MIN_KEEPALIVE_S = 5.0
MAX_KEEPALIVE_S = 86_400.0


def check_keepalive(keepalive_s: float | None) -> None:
    """ValueError unless ``keepalive_s`` is None or 0 (no pings) or within [MIN_KEEPALIVE_S, MAX_KEEPALIVE_S]."""
    if keepalive_s and not MIN_KEEPALIVE_S <= keepalive_s <= MAX_KEEPALIVE_S:  # NaN fails the comparison too
        raise ValueError(
            f"keepalive must be None or 0 (no pings), or from {MIN_KEEPALIVE_S:g} s (chunkattn servers refuse more"
            f" frequent pings) to {MAX_KEEPALIVE_S:g} s; got {keepalive_s!r}"
        )


def channel_options(max_message_bytes: int, keepalive_s: float | None) -> list[tuple[str, Any]]:
    """gRPC channel arguments. With ``keepalive_s``, the channel pings the server after that long without
    activity (between calls too) and closes the connection, failing its calls with UNAVAILABLE, when a ping
    is not answered within as long: a server that vanished without closing the connection is found out
    within ~2 x keepalive_s. ValueError for a keepalive servers would refuse (see check_keepalive)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if keepalive_s:
        check_keepalive(keepalive_s)
        ms = int(keepalive_s * 1000)
        options += [
            ("grpc.keepalive_time_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # else, between calls, two pings and then one a minute
            # Both timeouts: with the keepalive one alone, gRPC 1.85 still waits its 60 s ping timeout.
            ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms),
        ]
    return options


def attend_request(
    layer: int,
    entries: Sequence[BatchEntry],
    q: Any,
    k: Any = None,
    v: Any = None,
    *,
    end_of_sequence: Sequence[str] = (),
    dtype: str | None = None,
    request_id: int = 0,
) -> bytes:
    """The serialized AttendRequest of one call (see ``ChunkAttnClient.attend``)."""
    ending = set(end_of_sequence)
    unknown = ending - {e.seq_id for e in entries}
    if unknown:
        raise ValueError(f"end_of_sequence names sequences not in the batch: {sorted(unknown)}")
    return wire.encode_attend_request(
        layer,
        [
            pb.SequenceEntry(
                seq_id=e.seq_id, position=e.position, num_tokens=e.num_tokens, end_of_sequence=e.seq_id in ending
            )
            for e in entries
        ],
        codec.to_raw(q, dtype),
        None if k is None else codec.to_raw(k, dtype),
        None if v is None else codec.to_raw(v, dtype),
        request_id,
    )


ATTEND = "/chunkattn.v1.ChunkAttn/Attend"
ATTEND_STREAM = "/chunkattn.v1.ChunkAttn/AttendStream"


class ChunkAttnClient(Routed):
    """A blocking client. Thread-safe: gRPC channels may be shared between threads.

    target: "host:port". root_certificates, certificate_chain, private_key, token: see ``Credentials``
    (none of them: plaintext, no token). timeout_s: the deadline of each call (None: none). route: the
    routing key for Envoy in front of several replicas (see ``Routed``; default: one random key per client).
    """

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keepalive_s: float | None = None,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        token: str | None = None,
        timeout_s: float | None = None,
        route: str | None = None,
    ) -> None:
        credentials = Credentials(root_certificates, certificate_chain, private_key, token)
        self._set_metadata(token, route)
        self._channel: grpc.Channel = open_channel(grpc, target, max_message_bytes, keepalive_s, credentials)
        self._stub = pb_grpc.ChunkAttnStub(self._channel)
        # Attend requests are serialized by wire.encode_attend_request (protobuf's serializer is slow on MiBs).
        self._attend = self._channel.unary_unary(
            ATTEND, request_serializer=wire.identity, response_deserializer=wire.identity
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes

    def __enter__(self) -> ChunkAttnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def info(self) -> ServerInfo:
        with rpc_errors():
            return ServerInfo.from_pb(
                self._stub.Info(pb.InfoRequest(), timeout=self.timeout_s, metadata=self._metadata)
            )

    def health(self, service: str = "") -> str:
        """The standard health status name: "SERVING", "NOT_SERVING", ... ("" = the whole server)."""
        with rpc_errors():
            r = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s, metadata=self._metadata
            )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    def attend(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        q: Any,
        k: Any = None,
        v: Any = None,
        *,
        end_of_sequence: Sequence[str] = (),
        dtype: str | None = None,
    ) -> npt.NDArray[Any]:
        """One layer, one batch. q [T, H, D], k/v [T, Hkv, D] (numpy float32/float16, uint16 words with
        dtype="bfloat16", or torch tensors); k/v None for a KV-sharing layer. Sequences named in
        ``end_of_sequence`` are released after the call. Returns [T, H, D] (uint16 words for bfloat16)."""
        request = attend_request(layer, entries, q, k, v, end_of_sequence=end_of_sequence, dtype=dtype)
        with rpc_errors():
            response = self._attend(request, timeout=self.timeout_s, metadata=self._metadata)
        return decode_attend_response(response)

    def release(self, seq_ids: Sequence[str], *, missing_ok: bool = False) -> int:
        """Release sequences; returns how many existed."""
        with rpc_errors():
            r = self._stub.Release(
                pb.ReleaseRequest(seq_ids=list(seq_ids), missing_ok=missing_ok),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        return int(r.released)

    def fork(self, parent: str, child: str) -> int:
        """A new sequence ``child`` sharing ``parent``'s KV copy-on-write; returns the blocks shared."""
        with rpc_errors():
            r = self._stub.Fork(
                pb.ForkRequest(parent=parent, child=child), timeout=self.timeout_s, metadata=self._metadata
            )
        return int(r.shared_blocks)

    def truncate(self, seq_id: str, length: int) -> Truncated:
        """Take a sequence back to its first ``length`` tokens in every layer, as if the later ones had never
        been sent (speculative decoding: drop the drafts a verify call rejected). FAILED_PRECONDITION when
        ``length`` is past the sequence's length or further back than the server holds (its message names
        min_length); NOT_FOUND for an unknown sequence; nothing changes then."""
        with rpc_errors():
            r = self._stub.Truncate(
                pb.TruncateRequest(seq_id=seq_id, length=length), timeout=self.timeout_s, metadata=self._metadata
            )
        return Truncated.from_pb(r)

    def export_kv(self, seq_id: str, *, layers: Sequence[int] = (), max_message_bytes: int = 0) -> Iterator[pb.KVChunk]:
        """A sequence's live KV as KVChunk messages (header, blocks, trailer), e.g. for ``kvfile.write``."""
        request = pb.ExportKVRequest(seq_id=seq_id, layers=list(layers), max_message_bytes=max_message_bytes)
        call = self._stub.ExportKV(request, timeout=self.timeout_s, metadata=self._metadata)

        def chunks() -> Iterator[pb.KVChunk]:
            with rpc_errors():
                yield from call

        return chunks()

    def import_kv(self, chunks: Iterable[pb.KVChunk], *, seq_id: str | None = None) -> KVImport:
        """Import an exported KV stream as a new sequence (named ``seq_id``, else the exported id)."""
        with rpc_errors():
            r = self._stub.ImportKV(
                (renamed(c, seq_id) for c in chunks), timeout=self.timeout_s, metadata=self._metadata
            )
        return KVImport(r.seq_id, r.blocks, r.records, r.bytes)

    def transfer_kv(
        self,
        seq_id: str,
        target: str,
        *,
        new_seq_id: str = "",
        release_after: bool = False,
        layers: Sequence[int] = (),
        target_token: str = "",
    ) -> KVTransfer:
        """Have this server stream ``seq_id``'s KV straight into the server at ``target`` ("host:port"),
        presenting ``target_token`` there (empty: the server's own --transfer-token, if any)."""
        request = transfer_request(seq_id, target, new_seq_id, release_after, layers, target_token)
        with rpc_errors():
            return KVTransfer.from_pb(self._stub.TransferKV(request, timeout=self.timeout_s, metadata=self._metadata))

    def stream(self) -> AttendStream:
        """A bidirectional stream for a long-lived model runner: one round trip per call, no new RPC.
        Each call on it waits at most ``timeout_s`` for its answer; then the stream is cancelled."""
        return AttendStream(
            self._channel.stream_stream(
                ATTEND_STREAM, request_serializer=wire.identity, response_deserializer=wire.identity
            ),
            timeout_s=self.timeout_s,
            metadata=self._metadata,
        )


class AttendStream:
    """Calls over one AttendStream RPC, answered in order. Use as a context manager.

    A failed call raises ChunkAttnError and the stream stays usable; a broken stream raises too, for
    that call and every later one. A call that gets no answer within ``timeout_s`` (None: wait for ever)
    raises DEADLINE_EXCEEDED and cancels the stream, and so does an interrupted call (its answer would
    otherwise be taken for the next call's). A stream dropped without ``close()`` is cancelled.
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
        self._answers: queue.Queue[bytes | ChunkAttnError | None] = queue.Queue()
        self._reader = threading.Thread(
            target=_read_answers, args=(self._call, self._answers), name="chunkattn-stream-reader", daemon=True
        )
        self._reader.start()
        weakref.finalize(self, _end_stream, self._call, self._requests)
        self._timeout_s = timeout_s
        self._broken: tuple[grpc.StatusCode, str] | None = None  # why every later call fails
        self._next_id = 0
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
            self._reader.join(self._timeout_s)  # the server ends the RPC once the requests end
            if self._reader.is_alive():
                self._call.cancel()
                self._reader.join()

    def cancel(self) -> None:
        """End the RPC at once, answered or not (takes no lock: works while a call waits)."""
        self._call.cancel()

    def attend(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        q: Any,
        k: Any = None,
        v: Any = None,
        *,
        end_of_sequence: Sequence[str] = (),
        dtype: str | None = None,
    ) -> npt.NDArray[Any]:
        """As ``ChunkAttnClient.attend``, over the stream."""
        with self._lock:
            if self._broken is not None:
                raise ChunkAttnError(*self._broken)
            self._next_id += 1
            rid = self._next_id
            self._requests.put(
                attend_request(layer, entries, q, k, v, end_of_sequence=end_of_sequence, dtype=dtype, request_id=rid)
            )
            try:
                answer = self._answers.get(timeout=self._timeout_s)
            except queue.Empty:
                self._break(grpc.StatusCode.CANCELLED, f"an earlier call got no answer within {self._timeout_s:g} s")
                raise ChunkAttnError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no answer on the stream within {self._timeout_s:g} s; the stream was cancelled",
                ) from None
            except BaseException:  # e.g. KeyboardInterrupt: the answer may still come, for nobody
                self._break(grpc.StatusCode.CANCELLED, "an earlier call on it was interrupted")
                raise
            if answer is None:
                self._broken = (grpc.StatusCode.UNAVAILABLE, "the stream ended")
                raise ChunkAttnError(*self._broken)
            if isinstance(answer, ChunkAttnError):
                self._broken = (answer.code, answer.message)
                raise answer
        return decode_attend_response(answer, rid)

    def _break(self, code: grpc.StatusCode, why: str) -> None:
        self._broken = (code, f"the stream was cancelled: {why}")
        self._call.cancel()


def _read_answers(call: Any, answers: queue.Queue[bytes | ChunkAttnError | None]) -> None:
    """The reader thread: every answer of ``call`` into ``answers``, then None, or the error that ended it."""
    try:
        for answer in call:
            answers.put(answer)
        answers.put(None)
    except grpc.RpcError as e:
        answers.put(ChunkAttnError.from_rpc(e))
    except BaseException as e:  # never leave a waiting call without an answer
        answers.put(ChunkAttnError(grpc.StatusCode.UNKNOWN, f"reading the stream failed: {e!r}"))


def _end_stream(call: Any, requests: queue.Queue[bytes | None]) -> None:
    """Finalizer of a dropped AttendStream: end the request iterator and cancel the RPC."""
    requests.put(None)
    call.cancel()


def decode_attend_response(raw: bytes, request_id: int | None = None) -> npt.NDArray[Any]:
    """The output of a serialized AttendResponse (a view of its bytes), or its failure as ChunkAttnError.

    With ``request_id`` (streams), a response to another request is an error in itself, checked first.
    """
    small = len(raw) <= _SMALL_RESPONSE_BYTES  # protobuf's C parser: its copy of the output costs nothing
    try:
        if small:
            response = pb.AttendResponse.FromString(raw)
        else:  # the output stays a view of the received bytes
            parts = wire.split(raw, _RESPONSE_TENSORS)
            response = pb.AttendResponse.FromString(parts.rest)
    except (wire.WireError, DecodeError) as e:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, f"the server's response does not parse: {e}") from None
    unparsed_request = response.status.code and response.request_id == 0  # the server could not read its id
    if request_id is not None and response.request_id != request_id and not unparsed_request:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, f"response {response.request_id} answers request {request_id}")
    if response.status.code:
        code = _STATUS_BY_VALUE.get(response.status.code, grpc.StatusCode.UNKNOWN)
        raise ChunkAttnError(code, response.status.message)
    if not (response.HasField("output") if small else 1 in parts.tensors):
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, "the server's response has no output")
    try:
        return codec.decode(response.output) if small else codec.from_parts(*parts.tensors[1])
    except (codec.CodecError, DecodeError) as e:
        raise ChunkAttnError(grpc.StatusCode.INTERNAL, f"the server's output does not decode: {e}") from None


_RESPONSE_TENSORS = frozenset({1})
_SMALL_RESPONSE_BYTES = 64 << 10


def _dtype_name(dtype: int) -> str:
    """A dtype's name; a newer server's dtype this client does not know is reported, not fatal."""
    d = dtypes.BY_WIRE.get(dtype)
    return f"unknown({dtype})" if d is None else d.name


_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
