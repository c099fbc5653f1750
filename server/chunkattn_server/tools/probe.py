"""What Envoy and the replicas say about themselves, over HTTP: readiness, Envoy's healthy replicas, and
whether its calls reach every replica (``routable``, ``wait_routable``: CI and ``make cluster`` send traffic
only once it does). Reading only; starting and stopping processes is tools/cluster.py's.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkattn_client._channel import ROUTE_HEADER


def get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    """(HTTP status, body) of a GET; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()
    except (OSError, ValueError) as e:
        return 0, str(e)


def ready(host: str, metrics_port: int) -> bool:
    """Whether a replica's readiness probe (/readyz on its metrics port) answers 200."""
    return get(f"http://{host}:{metrics_port}/readyz")[0] == 200


def healthy(admin_url: str) -> int:
    """How many replicas Envoy's health checks pass now, as its admin page says (0: Envoy does not answer)."""
    status, body = get(f"{admin_url}/clusters?format=json")
    if status != 200:
        return 0
    hosts = [h for c in json.loads(body).get("cluster_statuses", []) for h in c.get("host_statuses", [])]
    return sum(not h.get("health_status", {}).get("failed_active_health_check", False) for h in hosts)


def routable(target: str, admin_url: str, replicas: int, connections: int = 8) -> bool:
    """Whether Envoy (clients' ``target``, admin at ``admin_url``) has ``replicas`` healthy replicas and its
    calls reach each of them from every one of ``connections`` new connections: per connection, health checks
    with 32 routing keys per replica, counted per replica. Envoy's workers (the compose stack runs two) each
    take a replica that passed its health check a moment after the admin page shows it, and a connection
    belongs to one worker: until every worker has it, sessions on a late worker's connections start on
    another replica and then move (NOT_FOUND). Eight connections, spread over the workers by the kernel,
    leave a late worker unseen 1 time in 2^7 with two workers."""
    if healthy(admin_url) != replicas:
        return False
    for _ in range(connections):
        before = requests_per_replica(admin_url)
        # A channel of its own subchannels: a new connection (gRPC shares them between like channels).
        with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            for i in range(32 * replicas):
                with contextlib.suppress(grpc.RpcError):
                    check(health_pb2.HealthCheckRequest(), timeout=2, metadata=((ROUTE_HEADER, f"probe-{i}"),))
        after = requests_per_replica(admin_url)
        if len(after) != replicas or not all(after[h] > before.get(h, 0) for h in after):
            return False
    return True


def wait_routable(target: str, admin_url: str, replicas: int, timeout_s: float) -> None:
    """Return once ``routable``; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not routable(target, admin_url, replicas):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Envoy at {target} did not route to {replicas} healthy replicas within {timeout_s:g} s")
        time.sleep(0.5)


def requests_per_replica(admin_url: str) -> dict[str, int]:
    """Envoy's count of requests sent to each replica ("host:port" -> requests)."""
    status, body = get(f"{admin_url}/clusters")
    if status != 200:
        return {}
    fields = (line.split("::") for line in body.splitlines())
    return {f[1]: int(f[3]) for f in fields if len(f) == 4 and f[0] == "chunkattn" and f[2] == "rq_total"}
