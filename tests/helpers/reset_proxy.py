"""A loopback HTTP/2 relay that, like Envoy, resets the streams of a server that dies under it.

Envoy in front of replicas (``make cluster``) keeps the client's connection when a replica dies and resets
the streams that were on it with RST_STREAM (INTERNAL_ERROR), which gRPC reports as INTERNAL; a client
connected to the server itself sees its socket close instead (UNAVAILABLE). ``ResettingProxy`` reproduces
the first without Envoy: it passes whole HTTP/2 frames through unchanged, and when the server's connection
ends it resets every stream still open on the client's connection, and every stream opened on it later.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator
from types import TracebackType

PREFACE_BYTES = 24  # "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", the client's first bytes
HEADERS, RST_STREAM = 0x1, 0x3  # frame types
END_STREAM = 0x1  # a HEADERS frame's flag: the server's trailers
INTERNAL_ERROR = 0x2  # the HTTP/2 error code Envoy resets with


def rst_stream(stream_id: int, error_code: int = INTERNAL_ERROR) -> bytes:
    """An RST_STREAM frame: 9-byte header (length, type, flags, stream id), then the 4-byte error code."""
    return (
        (4).to_bytes(3, "big") + bytes([RST_STREAM, 0]) + stream_id.to_bytes(4, "big") + error_code.to_bytes(4, "big")
    )


async def frames(reader: asyncio.StreamReader) -> AsyncIterator[tuple[bytes, bytes]]:
    """(header, payload) of each HTTP/2 frame until the connection ends."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            header = await reader.readexactly(9)
            yield header, await reader.readexactly(int.from_bytes(header[:3], "big"))


def stream_id(header: bytes) -> int:
    return int.from_bytes(header[5:9], "big") & 0x7FFF_FFFF


class ResettingProxy:
    """``with ResettingProxy(server_port) as proxy:`` relays ``proxy.target`` to 127.0.0.1:server_port.

    ``streams`` counts the streams clients opened (HEADERS frames), so that a test can wait for a call to
    reach the relay.
    """

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self.streams = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reset-proxy", daemon=True)
        self._thread.start()
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{listening.getsockname()[1]}"
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, sock=listening), self._loop
        ).result(10)

    def __enter__(self) -> ResettingProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening, drop every connection, and end the relay's thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in relays:
            t.cancel()
        await asyncio.gather(*relays, return_exceptions=True)

    async def _relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        """One client connection: frames both ways until the server's connection ends, then resets."""
        open_streams: set[int] = set()
        lost = False
        try:
            server_in, server_out = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        except OSError:
            client_out.transport.abort()
            return

        async def to_server() -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                server_out.write(await client_in.readexactly(PREFACE_BYTES))
            async for header, payload in frames(client_in):
                if header[3] == HEADERS:  # a new stream (gRPC clients send no trailers)
                    self.streams += 1
                    if lost:
                        client_out.write(rst_stream(stream_id(header)))
                        continue
                    open_streams.add(stream_id(header))
                elif header[3] == RST_STREAM:
                    open_streams.discard(stream_id(header))
                if not lost:
                    server_out.write(header + payload)
            server_out.close()

        async def to_client() -> None:
            nonlocal lost
            async for header, payload in frames(server_in):
                if (header[3] == HEADERS and header[4] & END_STREAM) or header[3] == RST_STREAM:
                    open_streams.discard(stream_id(header))
                client_out.write(header + payload)
                with contextlib.suppress(ConnectionError):
                    await client_out.drain()
            lost = True  # the server is gone: reset its streams, keep the client's connection
            for s in sorted(open_streams):
                client_out.write(rst_stream(s))
            open_streams.clear()

        try:
            await asyncio.gather(to_server(), to_client())
        finally:
            client_out.transport.abort()
            server_out.transport.abort()
