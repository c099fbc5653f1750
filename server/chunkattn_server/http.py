"""The HTTP side of the server, on --metrics-port: Prometheus's /metrics, and /healthz and /readyz for
orchestrators that do not speak gRPC health (Kubernetes probes, Docker's HEALTHCHECK, load balancers).

- ``/healthz`` (liveness): 200 while the server's event loop turns. The loop stamps a heartbeat every
  ``HEARTBEAT_S``; a loop stuck for ``STALL_S`` (a handler that blocks, a deadlock) answers 503: restart it.
  While the server starts (the KV pool being allocated, which can take a minute) it answers 200.
- ``/readyz`` (readiness): 200 while the gRPC health status is SERVING (the pool is allocated, the port
  listens, no drain has begun) and the loop turns; 503 with the reason otherwise (starting, draining,
  stalled).
- ``/metrics`` and ``/``: the metrics, as prometheus_client's own server answers them. Other paths: 404
  (a probe with a typo fails instead of reading the metrics as a yes).

The server starts before the KV pool is allocated, so the probes answer from the first seconds.
The answers are plain text, one line. The server runs in daemon threads; answering never touches the engine.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

HEARTBEAT_S = 1.0
STALL_S = 10.0

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class Probe:
    """What /healthz and /readyz report: set from the event loop, read from the HTTP threads."""

    def __init__(self, stall_s: float = STALL_S) -> None:
        self.stall_s = stall_s
        self.state = "starting"  # starting -> serving -> draining
        self._beat = time.monotonic()

    def beat(self) -> None:
        self._beat = time.monotonic()

    async def heartbeat(self, period_s: float = HEARTBEAT_S) -> None:
        """Stamp the heartbeat every period_s, for ever (a task on the server's event loop)."""
        while True:
            self.beat()
            await asyncio.sleep(period_s)

    def live(self) -> tuple[bool, str]:
        if self.state == "starting":
            return True, "starting"
        stalled = time.monotonic() - self._beat
        if stalled > self.stall_s:
            return False, f"event loop stalled: no heartbeat for {stalled:.1f} s (limit {self.stall_s:g} s)"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if self.state == "serving":
            live, why = self.live()
            return (True, "ready") if live else (False, why)
        if self.state == "starting":
            return False, "starting: the KV pool is being allocated"
        return False, "draining: this replica refuses new calls and stops when the calls in flight end"


def app(registry: CollectorRegistry, probe: Probe) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    """The WSGI application: the probes, and the metrics on every other path."""
    metrics = make_wsgi_app(registry)
    checks = {"/healthz": probe.live, "/readyz": probe.ready}

    def serve(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/metrics", "/"):
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        check = checks.get(path)
        if check is None:
            status, why = "404 Not Found", "no such path: the server has /metrics, /healthz and /readyz"
        else:
            ok, why = check()
            status = "200 OK" if ok else "503 Service Unavailable"
        body = (why + "\n").encode()
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return serve


class _Quiet(WSGIRequestHandler):
    timeout = 10  # seconds a connection may sit without sending its request (each holds a thread)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would flood the log."""


def start(host: str, port: int, registry: CollectorRegistry, probe: Probe) -> Callable[[], None]:
    """Serve on host:port (IPv4 or IPv6) in a daemon thread; returns the function that stops it."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(str(address[0]), port, app(registry, probe), Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="chunkattn-http", daemon=True).start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()

    return stop
