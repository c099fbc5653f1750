"""Channels to the servers that TransferKV pushes to, kept open from one transfer to the next.

A channel per transfer costs a TCP connect and an HTTP/2 handshake, and starts flow control again from
a 64 KiB window that gRPC's BDP probing then has to grow: on the dev machine a 64 MiB transfer took
about 10% longer that way (benchmarks/transport.py). Channels not in use beyond ``limit`` are closed,
least recently used first.

A kept channel can go bad while idle. One that gRPC reports in TRANSIENT_FAILURE or SHUTDOWN is replaced
when next used, and one whose transfer failed with UNAVAILABLE or DEADLINE_EXCEEDED is dropped, so the
next transfer connects afresh instead of waiting out gRPC's reconnect backoff (the pool's channels do not
share connections with any other channel: a local subchannel pool). A target whose host vanished without
resetting the connection is found by the keepalive pings the caller's ``options`` configure
(service/transfer.py): the unanswered ping fails the transfer with UNAVAILABLE, which drops the channel.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from chunkattn_client.limits import dial_target

DEFAULT_LIMIT = 8
BROKEN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
DROP_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class _Entry:
    channel: grpc.aio.Channel
    users: int = 0
    dropped: bool = False


class ChannelPool:
    """Channels by target address, shared by the transfers to that target (one event loop): TLS with
    ``credentials(target)``, plaintext where that is None."""

    def __init__(
        self,
        options: Sequence[tuple[str, Any]],
        credentials: Callable[[str], grpc.ChannelCredentials | None] = lambda target: None,
        limit: int = DEFAULT_LIMIT,
    ) -> None:
        self._options = [*options, ("grpc.use_local_subchannel_pool", 1)]
        self._credentials = credentials
        self._limit = limit
        self._entries: dict[str, _Entry] = {}  # least recently used first
        self._closed = False

    @contextlib.asynccontextmanager
    async def use(self, target: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to ``target`` (a new one if there is none, or if the kept one is broken) for the
        duration of the block. An RPC error UNAVAILABLE or DEADLINE_EXCEEDED leaving the block drops it."""
        if self._closed:
            raise RuntimeError("the channel pool is closed (the server is stopping)")
        entry = self._entries.pop(target, None)
        if entry is not None and entry.channel.get_state() in BROKEN:
            await self._retire(entry)
            entry = None
        entry = entry or _Entry(self._open(target))
        self._entries[target] = entry
        entry.users += 1
        try:
            await self._trim()
            yield entry.channel
        except grpc.aio.AioRpcError as e:
            if e.code() in DROP_ON and self._entries.get(target) is entry:
                del self._entries[target]
                await self._retire(entry)  # in use here: closed below, when its last user leaves
            raise
        finally:
            entry.users -= 1
            if entry.dropped:
                await self._retire(entry)
            await self._trim()

    def _open(self, target: str) -> grpc.aio.Channel:
        credentials = self._credentials(target)
        if credentials is None:
            return grpc.aio.insecure_channel(dial_target(target), options=self._options)
        return grpc.aio.secure_channel(dial_target(target), credentials, options=self._options)

    async def close(self) -> None:
        """Close every channel (at shutdown, once no transfer runs); later uses raise RuntimeError."""
        self._closed = True
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            await entry.channel.close()

    def __len__(self) -> int:
        return len(self._entries)

    async def _retire(self, entry: _Entry) -> None:
        """Mark a channel that has left the pool; close it once no transfer uses it."""
        entry.dropped = True
        if entry.users == 0:
            await entry.channel.close()

    async def _trim(self) -> None:
        """Close idle channels beyond the limit, least recently used first. The victims leave the pool
        before any close is awaited, so no other transfer can pick one up meanwhile."""
        idle = [target for target, entry in self._entries.items() if entry.users == 0]
        victims = [self._entries.pop(target) for target in idle[: max(0, len(self._entries) - self._limit)]]
        for entry in victims:
            await entry.channel.close()
