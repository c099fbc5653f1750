"""Channels to the servers that TransferKV pushes to, kept open from one transfer to the next.

A channel per transfer costs a TCP connect and an HTTP/2 handshake, and starts flow control again from
a 64 KiB window that gRPC's BDP probing then has to grow: on the dev machine a 64 MiB transfer took
about 10% longer that way (benchmarks/transport.py). Channels not in use beyond ``limit`` are closed,
least recently used first; a channel whose target turned out to be unavailable is dropped, so that the
next transfer connects afresh instead of waiting out gRPC's reconnect backoff.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

DEFAULT_LIMIT = 8


@dataclass
class _Entry:
    channel: grpc.aio.Channel
    users: int = 0
    dropped: bool = False


class ChannelPool:
    """Insecure channels by target address, shared by the transfers to that target (one event loop)."""

    def __init__(self, options: Sequence[tuple[str, Any]], limit: int = DEFAULT_LIMIT) -> None:
        self._options = list(options)
        self._limit = limit
        self._entries: dict[str, _Entry] = {}  # least recently used first

    @contextlib.asynccontextmanager
    async def use(self, target: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to ``target`` (opened if there is none) for the duration of the block. An RPC error
        UNAVAILABLE leaving the block drops the channel."""
        entry = self._entries.pop(target, None) or _Entry(grpc.aio.insecure_channel(target, options=self._options))
        self._entries[target] = entry
        entry.users += 1
        await self._trim()
        try:
            yield entry.channel
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and self._entries.get(target) is entry:
                del self._entries[target]
                entry.dropped = True
            raise
        finally:
            entry.users -= 1
            if entry.dropped and entry.users == 0:
                await entry.channel.close()
            await self._trim()

    async def close(self) -> None:
        """Close every channel (at shutdown, once no transfer runs)."""
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            await entry.channel.close()

    def __len__(self) -> int:
        return len(self._entries)

    async def _trim(self) -> None:
        idle = [target for target, entry in self._entries.items() if entry.users == 0]
        for target in idle[: max(0, len(self._entries) - self._limit)]:
            await self._entries.pop(target).channel.close()
