"""Every Prometheus metric the server exports, in one place (served on --metrics-port at /metrics)."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from chunkattn_server.engine.types import EngineStats


# Seconds: a decode call's queue wait and compute are tens of microseconds to a millisecond on a GPU.
_LATENCY_BUCKETS = (
    0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
)  # fmt: skip
_STEP_CALLS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_STEP_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


M = TypeVar("M", Counter, Gauge, Histogram)


class Metrics:
    """The server's metrics, registered in their own registry (so tests and several servers never clash).

    ``of(metric, *labels)`` is ``metric.labels(*labels)`` for the per-call paths: prometheus_client's
    ``labels`` takes a lock and validates its arguments each time (~3 us, as much as the update itself)."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        # The process's CPU, memory, file descriptors and start time (process_*), Python's (python_info,
        # python_gc_*), as the default registry has them.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.build_info = Gauge(
            "chunkattn_build_info",
            "Always 1; the labels say what serves: chunkattn's version, the attention backend, the device.",
            ["version", "backend", "device", "python"],
            registry=r,
        )
        self.requests = Counter(
            "chunkattn_requests_total",
            "Requests answered, by RPC, gRPC status code and transport: grpc, or zmq (the data plane, whose"
            " messages count as rpc Attend). Each AttendStream message and each data-plane message counts as one.",
            ["rpc", "code", "transport"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "chunkattn_rpc_duration_seconds",
            "Time from a request's arrival (whole) to its answer being handed to gRPC or ZeroMQ, by RPC and"
            " transport (grpc, zmq); for AttendStream and the data plane, per message.",
            ["rpc", "transport"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.data_plane_sessions = Gauge(
            "chunkattn_data_plane_sessions",
            "Data-plane sessions open (OpenDataPlane; neither expired nor revoked).",
            registry=r,
        )
        self.queue_seconds = Histogram(
            "chunkattn_queue_seconds",
            "Time a request waited for the engine, by the RPC the client called.",
            ["rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "chunkattn_compute_seconds",
            "Time of the engine step that served a request, by the RPC the client called (calls merged into"
            " one step each observe the step's time).",
            ["rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_calls = Histogram(
            "chunkattn_step_calls",
            "Attend calls merged into one engine step (1: a call that ran alone).",
            buckets=_STEP_CALLS_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "chunkattn_step_tokens",
            "Tokens of the Attend calls merged into one engine step.",
            buckets=_STEP_TOKENS_BUCKETS,
            registry=r,
        )
        self.steps = Counter(
            "chunkattn_engine_steps_total",
            "Engine steps run, by where: event_loop (a small step on the CPU, run by the event loop's thread"
            " while the engine thread was idle) or engine_thread.",
            ["runner"],
            registry=r,
        )
        self.in_flight = Gauge(
            "chunkattn_engine_jobs_in_flight", "Engine jobs queued or running now (queued + running).", registry=r
        )
        self.jobs_queued = Gauge("chunkattn_engine_jobs_queued", "Engine jobs waiting for a step now.", registry=r)
        self.jobs_running = Gauge(
            "chunkattn_engine_jobs_running",
            "Engine jobs in the step running now (merged calls each count).",
            registry=r,
        )
        self.tokens = Counter(
            "chunkattn_tokens_total",
            "Tokens attended, counted once per Attend call, by kind: decode (a single-token entry or block row)"
            " or prefill (longer ones). A call serves one layer, so a model token sent to L layers counts L times.",
            ["kind"],
            registry=r,
        )
        for kind in ("decode", "prefill"):  # both shown from the start (a step counts only the kinds it has)
            self.of(self.tokens, kind)
        # Per tenant, with authentication on (--auth-tokens): label values are the token file's tenant names.
        self.tenant_requests = Counter(
            "chunkattn_tenant_requests_total",
            "Requests answered, by the caller's tenant, RPC and gRPC status code (only with --auth-tokens; a call"
            " without valid credentials has no tenant and counts in chunkattn_requests_total alone).",
            ["tenant", "rpc", "code"],
            registry=r,
        )
        self.bytes_received = Counter("chunkattn_received_bytes_total", "Tensor bytes received (q, k, v).", registry=r)
        self.bytes_sent = Counter("chunkattn_sent_bytes_total", "Tensor bytes sent (outputs).", registry=r)
        self.kv_blocks_total = Gauge("chunkattn_kv_blocks", "KV blocks in the pool.", registry=r)
        self.kv_blocks_used = Gauge(
            "chunkattn_kv_blocks_used", "KV blocks held by sequences and block spaces.", registry=r
        )
        self.block_spaces = Gauge("chunkattn_block_spaces", "Block spaces open (the block API).", registry=r)
        self.spaces_opened = Counter(
            "chunkattn_block_spaces_opened_total", "Block spaces opened by OpenBlockSpace.", registry=r
        )
        self.spaces_evicted = Counter(
            "chunkattn_block_spaces_evicted_total",
            "Block spaces closed because they went unused past their lease (or --idle-timeout-s).",
            registry=r,
        )
        self.grants = Gauge(
            "chunkattn_grants", "Grants open (GrantBlocks: blocks handed over, waiting to be taken).", registry=r
        )
        self.parked_blocks = Gauge("chunkattn_grant_parked_blocks", "KV blocks the open grants hold.", registry=r)
        self.grants_expired = Counter(
            "chunkattn_grants_expired_total", "Grants ended untaken because their ttl passed.", registry=r
        )
        self.handoffs = Counter(
            "chunkattn_handoffs_total",
            "Block handoffs by operation (grant: GrantBlocks; take: CopyBlocks from a grant; copy: CopyBlocks"
            " between spaces) and gRPC status code.",
            ["op", "code"],
            registry=r,
        )
        self.handoff_blocks = Counter(
            "chunkattn_handoff_blocks_total", "Space blocks handed off, by operation.", ["op"], registry=r
        )
        self.handoff_bytes = Counter(
            "chunkattn_handoff_bytes_total",
            "K/V bytes handed off, by operation and where they went (local: copied inside this server).",
            ["op", "where"],
            registry=r,
        )
        self.calls = Counter(
            "chunkattn_attend_calls_total",
            "Attend calls served (unary or streamed), by how they address KV: sequence (entries) or blocks (a"
            " block space's BlockBatch).",
            ["mode"],
            registry=r,
        )
        self.active_sequences = Gauge("chunkattn_active_sequences", "Sequences holding KV.", registry=r)
        self.evicted = Counter(
            "chunkattn_sequences_evicted_total", "Sequences released because they were idle too long.", registry=r
        )
        self.released = Counter(
            "chunkattn_sequences_released_total", "Sequences released by Release or end_of_sequence.", registry=r
        )
        self.forked = Counter("chunkattn_sequences_forked_total", "Sequences created by Fork.", registry=r)
        self.truncated = Counter(
            "chunkattn_sequences_truncated_total",
            "Truncations done by Truncate (speculative decoding's rollbacks of rejected drafts; no-ops included).",
            registry=r,
        )
        self.truncated_tokens = Counter(
            "chunkattn_truncated_tokens_total",
            "Tokens dropped by Truncate, counted once per sequence (of its longest layer), not per layer.",
            registry=r,
        )
        self.kv_transfers = Counter(
            "chunkattn_kv_transfers_total",
            "KV transfers by direction (out: ExportKV and TransferKV; in: ImportKV) and gRPC status code.",
            ["direction", "code"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "chunkattn_kv_transfer_bytes_total", "K/V bytes of blocks sent or received.", ["direction"], registry=r
        )
        self.kv_transfer_blocks = Counter(
            "chunkattn_kv_transfer_blocks_total",
            "Blocks (one layer's K and V of one logical block) sent or received.",
            ["direction"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "chunkattn_kv_transfer_seconds",
            "Duration of KV transfers, by direction.",
            ["direction"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def of(self, metric: M, *labels: str) -> M:
        """The child of ``metric`` for these label values (made once; label values come from small fixed
        sets: RPC names, status codes, directions)."""
        key = (id(metric), labels)
        child: M | None = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def describe(self, backend: str, device: str) -> None:
        """Set chunkattn_build_info for the engine that serves."""
        from chunkattn_server import __version__

        self.build_info.labels(__version__, backend, device, platform.python_version()).set(1)

    def watch_tenants(self, source: Callable[[], tuple[Iterable[str], EngineStats]]) -> None:
        """Per-tenant gauges, read at each scrape from ``source()``: the configured tenants (the token file's:
        label values come from nowhere else) and the engine's latest stats. Read then, not set per step: the
        per-step path stays as it is whatever the number of tenants, and a tenant that leaves the file leaves
        the page."""
        self.registry.register(_TenantGauges(source))

    def watch_pool(self, source: Callable[[], EngineStats]) -> None:
        """The KV-in-use, active-sequence and block-space gauges, read at each scrape from ``source()`` (the stats
        the last engine step published): nothing to set per step. ``observe_pool`` has no effect after this."""
        self.kv_blocks_used.set_function(lambda: source().used_blocks)
        self.active_sequences.set_function(lambda: source().num_sequences)
        self.block_spaces.set_function(lambda: sum(source().spaces_by_tenant.values()))

    def watch_jobs(self, queued: Callable[[], int], running: Callable[[], int]) -> None:
        """chunkattn_engine_jobs_queued and _running, read at each scrape (the scheduler's queue and step)."""
        self.jobs_queued.set_function(queued)
        self.jobs_running.set_function(running)

    def observe_pool(self, stats: EngineStats) -> None:
        """Set the KV-in-use and active-sequence gauges from the engine's stats (until ``watch_pool``)."""
        self.kv_blocks_used.set(stats.used_blocks)
        self.active_sequences.set(stats.num_sequences)
        self.block_spaces.set(sum(stats.spaces_by_tenant.values()))
        self.grants.set(stats.grants)
        self.parked_blocks.set(stats.parked_blocks)


class _TenantGauges(Collector):
    """chunkattn_tenant_kv_blocks and chunkattn_tenant_sequences, per configured tenant, at scrape time."""

    def __init__(self, source: Callable[[], tuple[Iterable[str], EngineStats]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        names, stats = self._source()
        blocks = GaugeMetricFamily(
            "chunkattn_tenant_kv_blocks", "KV blocks held by each tenant's sequences.", labels=["tenant"]
        )
        sequences = GaugeMetricFamily("chunkattn_tenant_sequences", "Sequences each tenant holds.", labels=["tenant"])
        for name in names:
            blocks.add_metric([name], stats.blocks_by_tenant.get(name, 0))
            sequences.add_metric([name], stats.sequences_by_tenant.get(name, 0))
        yield blocks
        yield sequences
