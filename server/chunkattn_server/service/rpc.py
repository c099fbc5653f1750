"""Every chunkattn.v1 RPC's scaffolding, written once: parse -> admit -> run -> answer, or a status.

Handlers are plain coroutines over parsed requests that raise domain errors (errors.py); this module
registers them with gRPC as raw bytes (so that gRPC never parses a request: a parse failure here is
INVALID_ARGUMENT naming the field, never UNKNOWN), names each call's tenant first (auth.py: a call without
valid credentials is UNAUTHENTICATED; auth.Gate refuses a missing or wrong token even before gRPC reads
the request) and hands it to the handler, maps every error to its status through service/status.py's table
(``status_code``) with a bounded message, counts every answer, and enforces the server's limits:

- ``Admission``: how many calls the server works on at once (--max-concurrent-rpcs), and each tenant
  (its max_calls quota), and how many request bytes it holds (--max-inflight-mib). A unary call counts
  from the arrival of its request to its answer; a stream counts for each of its messages, from its arrival
  until it is answered (AttendStream) or written (ImportKV), and for an export's next message while it is
  read from the cache: an idle stream holds nothing. Health, reflection and Info are not counted. (Calls
  gRPC is still receiving are bounded apart, by server.py's --max-open-calls.)
- Parsing (``Parse``: a protobuf message's, ``message``, or an RPC's own, as Attend's): a request longer than
  any valid one is refused, one over SMALL_REQUEST_BYTES is read in a thread, its fields counted first, so
  that no request holds up the event loop for long; a parse failure is explained field by field, within
  bounds.
- Streams: a read or a write that makes no progress for the stream's idle limit (--stream-idle-s, or
  --kv-import-stall-s for ImportKV) ends the stream with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from chunkattn_client import wire
from chunkattn_client.limits import SMALL_MESSAGE_BYTES, bounded
from chunkattn_server.errors import InvalidArgument, Overloaded, ShuttingDown, StreamStalled, TooManyCalls
from chunkattn_server.service.auth import ANONYMOUS, Authenticator, Tenant
from chunkattn_server.service.status import status_code

Context = grpc.aio.ServicerContext[Any, Any]
DRAINING = "this server is shutting down (draining); reconnect elsewhere"
M = TypeVar("M", bound=Message)
P = TypeVar("P")

# A request of at most this many bytes (the client's and the server's one threshold) is small: parsed by
# protobuf's C parser on the event loop (the worst, 32K empty AttendRequest entries, takes ~0.4 ms) and never
# refused for the byte budget (decode-sized calls go on while large prefills are shed), though it counts in
# it. Control RPCs (Fork, ExportKV, TransferKV) take only small requests.
SMALL_REQUEST_BYTES = SMALL_MESSAGE_BYTES


class Count(Protocol):
    """Count a call's outcome; ``seconds``: how long the server took over it (None: a stream as a whole);
    ``tenant``: the caller's, when known; ``transport``: what carried it, "grpc" or "zmq" (the data plane)."""

    def __call__(
        self, rpc: str, code: grpc.StatusCode, seconds: float | None, tenant: Tenant | None, transport: str = "grpc"
    ) -> None: ...


class Ticket:
    """One admitted piece of work: a call slot (of the server's and of its tenant's) and ``nbytes`` of the
    byte budget, held until ``release`` (idempotent) or the end of its ``with`` block."""

    def __init__(self, admission: Admission, nbytes: int, tenant: str) -> None:
        self._admission: Admission | None = admission
        self.nbytes = nbytes
        self.tenant = tenant

    def release(self) -> None:
        if self._admission is not None:
            self._admission._leave(self.nbytes, self.tenant)
            self._admission = None

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """The limits on what the server works on at once (event-loop only: not thread-safe).

    ``max_calls`` 0: no limit. ``max_bytes``: the request bytes held by admitted work; a request over
    SMALL_REQUEST_BYTES that would pass it is refused.
    """

    def __init__(self, max_calls: int, max_bytes: int) -> None:
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self.calls = 0
        self.bytes = 0
        self.by_tenant: dict[str, int] = {}  # calls worked on, per tenant
        self._waiting: list[asyncio.Future[None]] = []

    def admit(self, nbytes: int = 0, *, refusable: bool = True, tenant: Tenant = ANONYMOUS) -> Ticket:
        """A ticket for work on a request of ``nbytes``; Overloaded when the server or the tenant is full
        (TooManyCalls: its max_calls), unless the work belongs to a stream already admitted
        (``refusable=False``: a stream is never refused halfway)."""
        held = self.by_tenant.get(tenant.name, 0)
        if refusable:
            if tenant.max_calls is not None and held >= tenant.max_calls:
                raise TooManyCalls(
                    f"your tenant is working on {held} calls, its quota (max_calls {tenant.max_calls}); retry when"
                    " one has finished, or ask the operator for more"
                )
            if self.max_calls and self.calls >= self.max_calls:
                raise Overloaded(
                    f"the server is working on {self.calls} calls, its limit (chunkattn-server"
                    f" --max-concurrent-rpcs {self.max_calls}); retry later or elsewhere"
                )
            if nbytes > SMALL_REQUEST_BYTES and self.bytes + nbytes > self.max_bytes:
                raise Overloaded(
                    f"a request of {nbytes / 2**20:.1f} MiB would take the requests in flight to"
                    f" {(self.bytes + nbytes) / 2**20:.1f} MiB, past the server's budget of"
                    f" {self.max_bytes / 2**20:.0f} MiB (chunkattn-server --max-inflight-mib); retry later, or"
                    " send smaller calls"
                )
        self.calls += 1
        self.bytes += nbytes
        self.by_tenant[tenant.name] = held + 1
        return Ticket(self, nbytes, tenant.name)

    async def admit_when_room(self, nbytes: int, tenant: Tenant = ANONYMOUS) -> Ticket:
        """A ticket for the next message of a stream already admitted: never refused, but while the byte
        budget is full it waits (and, not reading on, holds its client back through gRPC's flow control).
        What it waits for is admitted work, which never waits, so it ends."""
        while nbytes > SMALL_REQUEST_BYTES and self.bytes and self.bytes + nbytes > self.max_bytes:
            room = asyncio.get_running_loop().create_future()
            self._waiting.append(room)
            await room
        return self.admit(nbytes, refusable=False, tenant=tenant)

    def _leave(self, nbytes: int, tenant: str) -> None:
        self.calls -= 1
        self.bytes -= nbytes
        _drop_one(self.by_tenant, tenant)
        waiting, self._waiting = self._waiting, []
        for room in waiting:  # each looks again
            if not room.done():
                room.set_result(None)


def parse_now(message: type[M], raw: bytes, max_fields: int | None = None) -> M:
    """``raw`` as a ``message``; InvalidArgument naming the field when it does not parse, or when it has more
    than ``max_fields`` fields (counted first: protobuf's parse costs time in their number)."""
    name = message.DESCRIPTOR.full_name
    try:
        if max_fields is not None:
            wire.check_fields(raw, max_fields)
        return message.FromString(raw)
    except wire.TooManyFields:
        raise InvalidArgument(f"the {name} has more than {max_fields} fields, more than any valid one") from None
    except (DecodeError, wire.WireError) as e:
        why = wire.explain(message.DESCRIPTOR, raw) or str(e)
        raise InvalidArgument(f"the request is not a valid {name}: {why}") from None


@dataclass(frozen=True)
class Parse(Generic[P]):
    """How an RPC's raw request becomes what its handler takes: ``read(raw, tenant)`` (the caller's tenant's
    name: a block-addressed Attend call carries it), which raises InvalidArgument naming the field when the
    request does not parse; ``name``: the message's full name; ``max_bytes``: the longest valid request."""

    name: str
    max_bytes: int
    read: Callable[[bytes, str], P]


def message(cls: type[M], max_bytes: int, max_fields: int | None = None) -> Parse[M]:
    """A protobuf request's Parse (``parse_now``)."""
    return Parse(cls.DESCRIPTOR.full_name, max_bytes, functools.partial(_parse_message, cls, max_fields))


def _parse_message(cls: type[M], max_fields: int | None, raw: bytes, tenant: str) -> M:
    return parse_now(cls, raw, max_fields)


class Stream:
    """A stream's reads and writes, each bounded in time: a client that sends nothing (or reads nothing)
    for ``idle_s`` ends the stream with StreamStalled (DEADLINE_EXCEEDED). ``idle_s`` 0: no bound. Each
    message read, and the stream's end, is checked by ``recheck()`` once it has arrived and before it is
    handed over (its error ends the stream): a token revoked while the stream is open ends it at its next
    message, which is not carried out, or at its end (an import is not committed). A write is not checked:
    it answers a message accepted under a valid token."""

    def __init__(
        self,
        requests: AsyncIterator[bytes] | None,
        context: Context,
        idle_s: float,
        flag: str,
        recheck: Callable[[], object] = lambda: None,
    ) -> None:
        self._requests = None if requests is None else requests.__aiter__()
        self._context = context
        self._idle_s = idle_s
        self._flag = flag
        self._recheck = recheck
        self.received = 0

    async def read(self) -> bytes | None:
        """The next request (None at the stream's end)."""
        assert self._requests is not None
        try:
            async with asyncio.timeout(self._idle_s or None):  # no task per message, as wait_for makes
                data = await anext(self._requests, None)
        except TimeoutError:
            raise StreamStalled(
                f"the stream sent nothing for {self._idle_s:g} s (messages so far: {self.received}), so the"
                f" server closed it and returned what it held (chunkattn-server {self._flag})"
            ) from None
        # Checked on arrival: the credentials may have been revoked while the stream waited. At its end too:
        # an import is committed when its stream ends.
        self._recheck()
        self.received += data is not None
        return data

    async def write(self, data: bytes) -> None:
        try:
            async with asyncio.timeout(self._idle_s or None):
                await self._context.write(data)
        except TimeoutError:
            raise StreamStalled(
                f"the client read nothing for {self._idle_s:g} s, so the server closed the stream"
                f" (chunkattn-server {self._flag})"
            ) from None


def serialize(message: Message | bytes) -> bytes:
    """Responses: messages through protobuf, bytes (built by ``wire``) as they are."""
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


class Rpcs:
    """Builds the gRPC handlers of one service's RPCs around plain coroutines (see the module docstring)."""

    def __init__(self, count: Count, admission: Admission, auth: Authenticator) -> None:
        self._count = count
        self.admission = admission
        self.auth = auth
        self.open_calls: dict[str, int] = {}  # per tenant: calls open, idle streams included
        self.draining = False  # set on SIGTERM: new calls and open streams' next requests get UNAVAILABLE
        # Large requests are parsed here, off the event loop.
        self.parser = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunkattn-parse")

    def close(self) -> None:
        self.parser.shutdown(wait=False, cancel_futures=True)

    async def parse(self, parse: Parse[P], raw: bytes, tenant: Tenant) -> P:
        """``parse.read``, in the parser threads for a large request; first InvalidArgument when ``raw`` is
        longer than any valid request of its kind."""
        if len(raw) > parse.max_bytes:
            raise InvalidArgument(
                f"a {parse.name} of {len(raw)} bytes is longer than any valid one (at most {parse.max_bytes})"
            )
        if len(raw) <= SMALL_REQUEST_BYTES:
            return parse.read(raw, tenant.name)
        return await asyncio.get_running_loop().run_in_executor(self.parser, parse.read, raw, tenant.name)

    def _rechecker(self, tenant: Tenant, context: Context) -> Callable[[], object]:
        if not self.auth.enabled:
            return _nothing
        return lambda: self.auth.current(tenant, context)

    @contextlib.asynccontextmanager
    async def _answering(self, rpc: str, context: Context, *, count_ok: bool = True) -> AsyncIterator[Tenant]:
        """Name the caller's tenant (UNAUTHENTICATED without credentials) and give it to the block; count the
        call's outcome (an OK one unless ``count_ok`` is False: a stream whose requests are counted one by
        one, ``answers``); turn any error into its status (the one place that aborts a call)."""
        code = grpc.StatusCode.OK
        started = time.perf_counter()
        tenant: Tenant | None = None  # known once authenticated
        held = False  # whether this call counts among its tenant's open calls
        try:
            if self.auth.enabled:  # (else skip reading the call's metadata and TLS peer)
                tenant = self.auth.tenant_of(context.invocation_metadata(), context.auth_context())
            else:
                tenant = ANONYMOUS
            if self.draining:
                raise ShuttingDown(DRAINING)
            self._open_call(tenant)
            held = True
            yield tenant
        except asyncio.CancelledError:  # the client went away, or its deadline passed: nobody to answer
            remaining = context.time_remaining()
            late = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED
            raise
        except Exception as e:
            code = status_code(e)
            await context.abort(code, bounded(str(e)))
        finally:
            if held and tenant is not None:
                _drop_one(self.open_calls, tenant.name)
            if count_ok or code != grpc.StatusCode.OK:
                self._count(rpc, code, time.perf_counter() - started if count_ok else None, tenant)

    def _open_call(self, tenant: Tenant) -> None:
        """Count a call open for ``tenant`` (idle streams included); TooManyCalls past its max_open_calls."""
        held = self.open_calls.get(tenant.name, 0)
        if tenant.max_open_calls is not None and held >= tenant.max_open_calls:
            raise TooManyCalls(
                f"your tenant has {held} calls open (streams included), its quota (max_open_calls"
                f" {tenant.max_open_calls}); close some, or ask the operator for more"
            )
        self.open_calls[tenant.name] = held + 1

    @contextlib.contextmanager
    def open_call(self, tenant: Tenant) -> Iterator[None]:
        """The block counts as one of ``tenant``'s open calls (a data-plane message while it is handled);
        TooManyCalls past its max_open_calls, before the block runs."""
        self._open_call(tenant)
        try:
            yield
        finally:
            _drop_one(self.open_calls, tenant.name)

    async def answer(
        self,
        rpc: str,
        raw: bytes,
        tenant: Tenant,
        parse: Parse[P],
        handler: Callable[[P, Tenant], Awaitable[bytes]],
        failed: Callable[[P | None, grpc.StatusCode, str], bytes],
        *,
        transport: str = "grpc",
        started: float | None = None,
    ) -> bytes:
        """One request answered on its own, as each AttendStream message and each data-plane message is:
        admitted (refusable: the server's limits, the tenant's max_calls, the byte budget), parsed (``parse``),
        handled (``handler(request, tenant)``: its serialized answer), counted as a call of ``rpc`` over
        ``transport`` from ``started`` (perf_counter; default now). A request that fails is answered with
        ``failed(the request, or None when it did not parse, its status, a bounded message)``: this never
        raises but for cancellation."""
        if started is None:
            started = time.perf_counter()
        request: P | None = None
        try:
            with self.admission.admit(len(raw), tenant=tenant):
                request = await self.parse(parse, raw, tenant)
                response = await handler(request, tenant)
        except Exception as e:
            code = status_code(e)
            response = failed(request, code, bounded(str(e)))
        else:
            code = grpc.StatusCode.OK
        self._count(rpc, code, time.perf_counter() - started, tenant, transport)
        return response

    def count(self, rpc: str, code: grpc.StatusCode, seconds: float, tenant: Tenant | None, transport: str) -> None:
        """Count an answer given outside this module's wrappers (a data-plane message refused before it had a
        tenant, say)."""
        self._count(rpc, code, seconds, tenant, transport)

    def unary(
        self,
        rpc: str,
        handler: Callable[[P, Context, Tenant], Awaitable[Message | bytes]],
        parse: Parse[P],
        *,
        admit: bool = True,
    ) -> grpc.RpcMethodHandler[bytes, Any]:
        """``handler(request, context, tenant)``: the request parsed (``parse``), the call admitted for its
        whole duration unless ``admit`` is False."""

        async def behavior(raw: bytes, context: Context) -> Message | bytes:
            async with self._answering(rpc, context) as tenant:
                with self.admission.admit(len(raw), tenant=tenant) if admit else contextlib.nullcontext():
                    return await handler(await self.parse(parse, raw, tenant), context, tenant)
            raise AssertionError("unreachable: _answering aborted the call")  # for mypy: abort raises

        return grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=wire.identity, response_serializer=serialize
        )

    def server_stream(
        self,
        rpc: str,
        handler: Callable[[P, Context, Tenant], AsyncIterator[bytes]],
        parse: Parse[P],
        idle_s: float,
        flag: str,
    ) -> grpc.RpcMethodHandler[bytes, bytes]:
        """``handler(request, context, tenant)`` yields serialized responses. The call counts while the
        handler makes its next response, not while the client reads the last one (bounded by ``idle_s``)."""

        async def behavior(raw: bytes, context: Context) -> None:
            async with self._answering(rpc, context) as tenant:
                out = Stream(None, context, idle_s, flag)
                recheck = self._rechecker(tenant, context)
                ticket = self.admission.admit(len(raw), tenant=tenant)
                try:
                    responses = handler(await self.parse(parse, raw, tenant), context, tenant)
                    async with contextlib.aclosing(responses):  # type: ignore[type-var]
                        while True:
                            response = await anext(responses, None)
                            ticket.release()
                            if response is None:
                                break
                            recheck()  # a token revoked during the stream gets none of its later messages
                            await out.write(response)
                            ticket = self.admission.admit(refusable=False, tenant=tenant)
                finally:
                    ticket.release()

        return grpc.unary_stream_rpc_method_handler(
            behavior, request_deserializer=wire.identity, response_serializer=wire.identity
        )

    def client_stream(
        self, rpc: str, handler: Callable[[Stream, Context, Tenant], Awaitable[Message]], idle_s: float, flag: str
    ) -> grpc.RpcMethodHandler[bytes, Any]:
        """``handler(stream, context, tenant)`` reads the requests (raw bytes) itself and admits its own work."""

        async def behavior(requests: AsyncIterator[bytes], context: Context) -> Message:
            async with self._answering(rpc, context) as tenant:
                stream = Stream(requests, context, idle_s, flag, self._rechecker(tenant, context))
                return await handler(stream, context, tenant)
            raise AssertionError("unreachable: _answering aborted the call")

        return grpc.stream_unary_rpc_method_handler(
            behavior, request_deserializer=wire.identity, response_serializer=serialize
        )

    def answers(
        self,
        rpc: str,
        handler: Callable[[P, Context, Tenant], Awaitable[bytes]],
        parse: Parse[P],
        failed: Callable[[P | None, grpc.StatusCode, str], bytes],
        idle_s: float,
        flag: str,
    ) -> grpc.RpcMethodHandler[bytes, bytes]:
        """A bidirectional stream answered request by request, in order: each request is admitted on its own
        (an idle stream holds nothing), parsed (``parse``), handled (``handler(request, context, tenant)``,
        its serialized answer) and counted as a call of ``rpc``; one that fails is answered with ``failed(the
        request, or None when it did not parse, its status, a bounded message)`` and the stream goes on. Only
        a stream that ends badly (idle, draining, cancelled) is a status, and a count, of the stream."""

        async def behavior(requests: AsyncIterator[bytes], context: Context) -> None:
            async with self._answering(rpc, context, count_ok=False) as tenant:
                stream = Stream(requests, context, idle_s, flag, self._rechecker(tenant, context))

                def handle(request: P, tenant: Tenant) -> Awaitable[bytes]:
                    return handler(request, context, tenant)

                while (raw := await stream.read()) is not None:
                    if self.draining:
                        raise ShuttingDown(DRAINING)
                    await stream.write(await self.answer(rpc, raw, tenant, parse, handle, failed))

        return grpc.stream_stream_rpc_method_handler(
            behavior, request_deserializer=wire.identity, response_serializer=wire.identity
        )


def _nothing() -> None:
    pass


def _drop_one(counts: dict[str, int], key: str) -> None:
    """One fewer of ``key`` in ``counts``; a key that reaches 0 goes (so the dict holds live tenants only)."""
    if counts[key] > 1:
        counts[key] -= 1
    else:
        del counts[key]
