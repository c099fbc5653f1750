"""/healthz and /readyz: what each state of the server answers (the WSGI app, without a server)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from chunkattn_server.http import Probe, app


def _get(probe: Probe, path: str, method: str = "GET") -> tuple[str, str]:
    registry = CollectorRegistry()
    Counter("probe_test", "A counter.", registry=registry).inc()
    seen: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
        seen.append(status)

    body = b"".join(
        app(registry, probe)({"PATH_INFO": path, "REQUEST_METHOD": method, "QUERY_STRING": ""}, start_response)
    )
    return seen[0], body.decode()


def test_readyz_follows_the_server_state() -> None:
    probe = Probe()
    assert _get(probe, "/readyz") == ("503 Service Unavailable", "starting: the KV pool is being allocated\n")
    probe.state = "serving"
    assert _get(probe, "/readyz") == ("200 OK", "ready\n")
    assert _get(probe, "/readyz", "HEAD") == ("200 OK", "")
    probe.state = "draining"
    status, body = _get(probe, "/readyz")
    assert status == "503 Service Unavailable"
    assert body.startswith("draining")


def test_healthz_fails_when_the_event_loop_stops_beating() -> None:
    probe = Probe(stall_s=0.05)
    probe.state = "serving"
    assert _get(probe, "/healthz") == ("200 OK", "ok\n")

    async def stall_then_beat() -> None:
        await asyncio.sleep(0.1)  # no heartbeat task: as if the loop were stuck
        assert _get(probe, "/healthz")[0] == "503 Service Unavailable"
        beating = asyncio.create_task(probe.heartbeat(0.01))
        await asyncio.sleep(0.02)
        assert _get(probe, "/healthz") == ("200 OK", "ok\n")
        beating.cancel()

    asyncio.run(stall_then_beat())


def test_a_starting_server_is_alive_and_a_stalled_one_is_not_ready() -> None:
    probe = Probe(stall_s=0.05)
    time.sleep(0.1)  # no heartbeat while the pool is allocated (the loop may be busy): still alive
    assert _get(probe, "/healthz") == ("200 OK", "starting\n")
    probe.state = "serving"
    assert _get(probe, "/healthz")[0] == "503 Service Unavailable"
    status, body = _get(probe, "/readyz")
    assert status == "503 Service Unavailable"
    assert body.startswith("event loop stalled")


@pytest.mark.parametrize("path", ["/readyz/", "/ready", "/READYZ", "/healthz/x", "/metricsx"])
def test_unknown_paths_are_not_found(path: str) -> None:
    probe = Probe()
    probe.state = "serving"
    status, body = _get(probe, path)
    assert status == "404 Not Found"
    assert "/readyz" in body


@pytest.mark.parametrize("path", ["/metrics", "/"])
def test_the_metrics_paths_serve_the_metrics(path: str) -> None:
    status, body = _get(Probe(), path)
    assert status == "200 OK"
    assert "probe_test_total 1.0" in body
