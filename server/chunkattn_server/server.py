"""Wiring: the gRPC server, standard health and reflection, the metrics endpoint, idle eviction, signals.

Life cycle: allocate the KV pool (engine) first, then serve with health SERVING; on SIGHUP reload the
token file and the TLS files (a bad file keeps the old one); on SIGTERM/SIGINT set NOT_SERVING, end open
streams before their next request (UNAVAILABLE), refuse new calls (UNAVAILABLE) for at least the drain
delay, let calls in flight finish and their answers reach their peers within the grace period, stop the
scheduler and return (exit 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import math
import signal
import socket
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkattn_client._channel import MIN_KEEPALIVE_S, channel_options
from chunkattn_server import http, reflection
from chunkattn_server.config import EngineConfig, ServerConfig, check_together
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.scheduler import Scheduler
from chunkattn_server.engine.types import EngineStats, Swept
from chunkattn_server.errors import ConfigError
from chunkattn_server.metrics import Metrics
from chunkattn_server.service import dataplane
from chunkattn_server.service.app import SERVICE_NAME, ChunkAttnService
from chunkattn_server.service.auth import Authenticator, Gate
from chunkattn_server.service.dataplane import DataPlane
from chunkattn_server.service.tls import ServerTLS, transfer_credentials

log = logging.getLogger("chunkattn_server")

# At most this many calls open at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a client
# that opens more waits for one to end (its channel queues them), so one connection cannot pile up calls
# without bound. gRPC's own default sets no limit.
MAX_STREAMS_PER_CONNECTION = 256
STREAM_LIMITS = [("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)]

# Keepalive pings from clients (ChunkAttnClient(keepalive_s=...)) and from other servers' TransferKV channels
# are accepted every MIN_KEEPALIVE_S or more, between calls too (the policy allows a second less: pings are
# timed on two clocks). gRPC's own policy takes one ping per 5 minutes while the server sends nothing, none
# between calls, and answers the third ping too many with GOAWAY "too_many_pings", closing the connection
# and failing every call on it.
PING_POLICY = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", int((MIN_KEEPALIVE_S - 1) * 1000)),
]

# The port is this server's alone. gRPC sets SO_REUSEPORT by default, so a second server on a port in use
# would bind it too, start, and take a share of the new connections (whose sequences live on the other).
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


async def serve(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # first: a signal while the pool is allocated still drains
        loop.add_signal_handler(sig, stop.set)
    auth, tls = _checked_before_the_pool(engine_config, config)
    metrics = Metrics()
    # The probes answer from the start ("starting" while the pool is allocated, which may take a minute).
    probe = http.Probe()
    stop_http = _start_http(config, metrics, probe)
    scheduler = _start_engine(engine_config, config, metrics)  # allocates the KV pool: SERVING only after this
    server = _grpc_server(config, auth, tls is not None and tls.mutual, metrics)
    await scheduler.run("quotas", _quotas(auth))
    if auth.enabled:
        metrics.watch_tenants(lambda: (auth.tenants.by_name, scheduler.stats))
    service = ChunkAttnService(scheduler, metrics, config, auth)
    health_servicer = _add_services(server, service)
    try:
        port = _listen(server, config, tls)
        if service.data_plane is not None:
            service.data_plane.start()
    except (OSError, ConfigError):
        scheduler.stop()
        if stop_http is not None:
            stop_http()
        raise
    heartbeat = asyncio.create_task(probe.heartbeat())
    await server.start()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    probe.state = "serving"
    _log_serving(engine_config, config, scheduler, port, tls, auth, service.data_plane)
    loop.add_signal_handler(signal.SIGHUP, _reloader(tls, auth, scheduler, service))
    sweeper = asyncio.create_task(_sweep_idle(scheduler, metrics, config.idle_timeout_s, service.spaces_opened))

    await stop.wait()
    log.info("draining: NOT_SERVING, refusing new calls, %.1f s for calls in flight", config.grace_s)
    probe.state = "draining"
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    service.drain()
    await _cancel(sweeper)
    try:
        # Load balancers learn of the drain from health checks: until they have, they still send calls here,
        # which the service refuses with UNAVAILABLE (safe to retry elsewhere). Stopping gRPC sooner would
        # fail them with CANCELLED instead, or cut the connection.
        await asyncio.sleep(config.drain_delay_s)
        started = loop.time()
        await _delivered(service, port, config.grace_s)
        await server.stop(max(config.grace_s - (loop.time() - started), 0.0))
    finally:
        if service.data_plane is not None:  # its messages in flight were open calls: _delivered waited for them
            await service.data_plane.close(max(config.grace_s - (loop.time() - started), 0.0))
        await service.close()
        scheduler.stop()
        await _cancel(heartbeat)  # /healthz stays 200 while the calls in flight finish
        if stop_http is not None:
            stop_http()
    log.info("stopped")


# -- the pieces serve wires, in its order ----------------------------------------------------------------


def _checked_before_the_pool(
    engine_config: EngineConfig, config: ServerConfig
) -> tuple[Authenticator, ServerTLS | None]:
    """The token file and the TLS files read, the ports and the configs checked: before the pool is
    allocated, so that a mistake fails at once, not after a minute."""
    if config.port and config.port == config.metrics_port:
        raise ConfigError(f"--port and --metrics-port are both {config.port}: give each a port of its own")
    _check_free(config.host, config.port, "--port")
    auth = Authenticator(config.auth_tokens)
    tls = None if config.tls_cert is None else ServerTLS(config.tls_cert, config.tls_key or "", config.tls_client_ca)
    transfer_credentials(config)  # TransferKV's files, read (once) now: mistakes show before the pool
    check_together(engine_config, config)
    dataplane.check(config)
    return auth, tls


def _start_http(config: ServerConfig, metrics: Metrics, probe: http.Probe) -> Callable[[], None] | None:
    """The HTTP endpoint (/metrics, /healthz, /readyz) on --metrics-port, started; what stops it (None: off)."""
    if not config.metrics_port:
        return None
    try:
        return http.start(config.host, config.metrics_port, metrics.registry, probe)
    except OSError as e:
        raise OSError(_cannot_listen(config.host, config.metrics_port, "--metrics-port", e)) from None


def _start_engine(engine_config: EngineConfig, config: ServerConfig, metrics: Metrics) -> Scheduler:
    """The scheduler, its engine built (the KV pool allocated) on its engine thread."""
    scheduler = Scheduler(
        lambda: Engine(engine_config),
        metrics,
        batching=config.batching,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_delay_us=config.max_batch_delay_us,
        inline=config.inline_steps,
    )
    metrics.describe(scheduler.engine.backend.name, str(scheduler.engine.device))
    return scheduler


def _grpc_server(config: ServerConfig, auth: Authenticator, mutual_tls: bool, metrics: Metrics) -> grpc.aio.Server:
    """The gRPC server, nothing registered yet: the clients' message limits, the ping policy, the limits on
    open calls, and (with tenants) the gate that refuses bad credentials before a request is read."""
    # The clients' message limits. The service admits the calls it works on (rpc.Admission: health checks
    # and idle streams never count); gRPC's own limit, far above, bounds the calls open at once, those still
    # being received included, which the service cannot see.
    options = [*channel_options(config.max_message_bytes, None), *PING_POLICY, *STREAM_LIMITS, *EXCLUSIVE_PORT]

    def refused(rpc: str) -> None:
        metrics.of(metrics.requests, rpc, grpc.StatusCode.UNAUTHENTICATED.name, "grpc").inc()

    gate = Gate(auth, mutual_tls, f"/{SERVICE_NAME}/", refused)
    return grpc.aio.server(
        options=options,
        maximum_concurrent_rpcs=config.max_open_calls or None,
        interceptors=[gate] if auth.enabled else [],
    )


def _add_services(server: grpc.aio.Server, service: ChunkAttnService) -> health.aio.HealthServicer:
    """chunkattn.v1.ChunkAttn, standard health (returned, NOT_SERVING until set) and reflection, on ``server``."""
    service.add_to_server(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    return health_servicer


def _listen(server: grpc.aio.Server, config: ServerConfig, tls: ServerTLS | None) -> int:
    """Bind --host:--port (plaintext or TLS); the port bound. OSError saying why when it cannot."""
    address = f"{config.host}:{config.port}"
    try:
        port = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls.credentials())
    except RuntimeError:  # gRPC says only "Failed to bind to address" (taken since _check_free, say)
        port = 0
    if port == 0:
        raise OSError(_cannot_listen(config.host, config.port, "--port", _bind_error(config.host, config.port)))
    return port


async def _set_health(health_servicer: health.aio.HealthServicer, status: int) -> None:
    """The server's health, and its service's, to ``status``."""
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)


def _log_serving(
    engine_config: EngineConfig,
    config: ServerConfig,
    scheduler: Scheduler,
    port: int,
    tls: ServerTLS | None,
    auth: Authenticator,
    data_plane: DataPlane | None,
) -> None:
    """The startup log: what is served where, the limits, batching, authentication and the data plane."""
    stats = scheduler.stats
    log.info(
        "serving %s on %s:%d (%s, metrics %s) on %s: %d layers, %d KV blocks of %d tokens (%.1f MiB)",
        SERVICE_NAME,
        config.host,
        port,
        "plaintext" if tls is None else "mutual TLS" if tls.mutual else "TLS",
        f"http://{config.host}:{config.metrics_port}/metrics, /healthz, /readyz" if config.metrics_port else "off",
        scheduler.engine.device,
        engine_config.model.num_layers,
        stats.num_blocks,
        stats.block_size,
        stats.num_blocks * stats.bytes_per_block / 2**20,
    )
    log.info(
        "limits: messages of %d MiB, %s calls worked on and %s open at once, %d MiB of requests in flight,"
        " streams idle %s",
        config.max_message_bytes >> 20,
        config.max_concurrent_rpcs or "any number of",
        config.max_open_calls or "any number",
        config.inflight_bytes >> 20,
        f"{config.stream_idle_s:g} s at most" if config.stream_idle_s else "for ever",
    )
    log.info(
        "batching: %s",
        f"Attend calls of one layer merged up to {config.max_batch_tokens} tokens per step, waiting"
        f" {config.max_batch_delay_us} us at most"
        if config.batching
        else "off (--no-batching): one call per step",
    )

    log.info(
        "authentication: %s",
        f"{len(auth.tenants.by_name)} tenants from {config.auth_tokens}"
        if auth.enabled
        else "off (every caller is one tenant)",
    )
    log.info(
        "data plane: %s",
        "off (--data-plane-tcp, --data-plane-ipc)"
        if data_plane is None
        else f"{', '.join(e.address for e in data_plane.endpoints)}"
        f" ({'CURVE' if data_plane.curve_public_key else 'plaintext'}; sessions of {config.data_plane_session_s:g} s)",
    )


def _reloader(
    tls: ServerTLS | None, auth: Authenticator, scheduler: Scheduler, service: ChunkAttnService
) -> Callable[[], None]:
    """SIGHUP's handler: reload the TLS files (for later handshakes) and the token file, give the tenants their
    new quotas and end the data-plane sessions whose credentials no longer name their tenant (a bad file keeps
    the old one)."""

    async def reload() -> None:
        if tls is not None:
            tls.reload()
        if auth.reload():
            revoked = service.recheck_sessions()
            if revoked:
                log.info("revoked %d data-plane sessions whose credentials no longer name their tenant", revoked)
            await scheduler.run("quotas", _quotas(auth))

    def on_sighup() -> None:
        reloading = asyncio.ensure_future(reload())
        reloading.add_done_callback(lambda f: f.cancelled() or f.exception())

    return on_sighup


def _cannot_listen(host: str, port: int, flag: str, e: OSError | None) -> str:
    """The one-line reason a server cannot listen on host:port (flag: the option that named the port)."""
    if e is None:
        return f"cannot listen on {host}:{port} ({flag})"
    if e.errno == errno.EADDRINUSE:
        return f"cannot listen on {host}:{port} ({flag}): the port is in use, by another server perhaps"
    return f"cannot listen on {host}:{port} ({flag}): {e.strerror or e}"


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a listening socket cannot bind host:port, on the first of the addresses host names that fails,
    bound as gRPC binds them (SO_REUSEADDR, no SO_REUSEPORT); None when every one binds."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host or None  # "": every address
    try:
        addresses = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
                s.bind(address)
    except OSError as e:
        return e
    return None


def _check_free(host: str, port: int, flag: str) -> None:
    """OSError when another socket holds host:port (on any address host names). Other failures are left to
    gRPC, which listens on the addresses it can bind (localhost without IPv6, say). Port 0 always passes."""
    e = _bind_error(host, port) if port else None
    if e is not None and e.errno == errno.EADDRINUSE:
        raise OSError(_cannot_listen(host, port, flag, e))


def _unsent(port: int) -> int | None:
    """Bytes sent on connections accepted on ``port`` that their peers have not acknowledged yet (Linux's
    /proc/net/tcp send queues; None without them)."""
    unsent, read = 0, False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # (a kernel without IPv6 has no tcp6)
        try:
            with open(table) as f:
                rows = [line.split() for line in list(f)[1:]]
        except OSError:
            continue
        read = True
        unsent += sum(int(r[4].split(":")[0], 16) for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port)
    return unsent if read else None


async def _delivered(service: ChunkAttnService, port: int, timeout_s: float) -> None:
    """Wait, timeout_s at most, until no call is open in the service and its answers have reached their
    peers. gRPC closes every connection when it stops, and a close while the peer still sends (window
    updates, pings) is a reset that loses what the socket still held: a proxy reading a large answer slowly
    would get it cut."""
    loop = asyncio.get_running_loop()
    deadline, quiet = loop.time() + timeout_s, 0
    while quiet < 3 and loop.time() < deadline:
        await asyncio.sleep(0.02)
        quiet = quiet + 1 if service.open_calls() == 0 and not _unsent(port) else 0


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _quotas(auth: Authenticator) -> Callable[[Engine], None]:
    """The engine job that gives each tenant of the token file its quota (run at start and on reload)."""
    quotas = {name: tenant.quota for name, tenant in auth.tenants.by_name.items()}
    return lambda e: e.set_quotas(quotas)


async def _sweep_idle(scheduler: Scheduler, metrics: Metrics, idle_timeout_s: float, opened: asyncio.Event) -> None:
    """Release sequences untouched for longer than idle_timeout_s (0: never), checking every quarter of it (at
    most 30 s); close block spaces unused past their lease (kv/spaces.py) and end grants past their ttl
    (kv/grants.py) as soon as the earliest can. ``opened`` is set when a space or a grant opens (a new
    deadline). No engine job runs while nothing can expire."""
    loop = asyncio.get_running_loop()  # its clock is time.monotonic, as the spaces' and sequences' last use
    period = max(0.05, min(idle_timeout_s / 4, 30.0)) if idle_timeout_s else math.inf
    next_sequences = loop.time() + period
    next_space = math.inf
    while True:
        wait = min(next_sequences, next_space) - loop.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(opened.wait(), None if wait == math.inf else max(0.05, wait))
        opened.clear()
        sequences = loop.time() >= next_sequences
        if sequences:
            next_sequences = loop.time() + period
        try:
            sweep = functools.partial(_sweep, idle_timeout_s, sequences)
            swept, stats = await scheduler.run("evict", sweep)
        except Exception:  # a failed sweep must not end eviction (or later the shutdown)
            log.exception("idle eviction failed; trying again in 1 s")
            next_space = loop.time() + 1.0
            continue
        next_space = math.inf if swept.due is None else swept.due
        if swept.evicted or swept.closed or swept.grants_ended:
            metrics.evicted.inc(swept.evicted)
            metrics.spaces_evicted.inc(swept.closed)
            metrics.grants_expired.inc(swept.grants_ended)
            metrics.observe_pool(stats)
            log.info(
                "released %d sequences idle > %.1f s, closed %d block spaces unused past their lease and ended %d"
                " grants past their ttl",
                swept.evicted,
                idle_timeout_s,
                swept.closed,
                swept.grants_ended,
            )


def _sweep(idle_timeout_s: float, sequences: bool, e: Engine) -> tuple[Swept, EngineStats]:
    """The evictor's engine job: what it released (sequences when ``sequences``), closed and ended, the next
    deadline, and the pool after."""
    return e.sweep(idle_timeout_s, sequences=sequences), e.stats()
