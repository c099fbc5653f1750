"""Every Prometheus metric the server exports, in one place (served on --metrics-port at /metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from chunkattn_server.engine import EngineStats


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The server's metrics, registered in their own registry (so tests and several servers never clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "chunkattn_requests_total", "Requests answered, by RPC and gRPC status code.", ["rpc", "code"], registry=r
        )
        self.queue_seconds = Histogram(
            "chunkattn_queue_seconds",
            "Time a request waited for the engine.",
            ["rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "chunkattn_compute_seconds",
            "Time the engine spent on a request.",
            ["rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("chunkattn_engine_jobs_in_flight", "Engine jobs queued or running now.", registry=r)
        self.tokens = Counter(
            "chunkattn_tokens_total",
            "Tokens attended, by kind: decode (a single-token entry) or prefill (longer entries).",
            ["kind"],
            registry=r,
        )
        self.bytes_received = Counter("chunkattn_received_bytes_total", "Tensor bytes received (q, k, v).", registry=r)
        self.bytes_sent = Counter("chunkattn_sent_bytes_total", "Tensor bytes sent (outputs).", registry=r)
        self.kv_blocks_total = Gauge("chunkattn_kv_blocks", "KV blocks in the pool.", registry=r)
        self.kv_blocks_used = Gauge("chunkattn_kv_blocks_used", "KV blocks held by sequences.", registry=r)
        self.active_sequences = Gauge("chunkattn_active_sequences", "Sequences holding KV.", registry=r)
        self.evicted = Counter(
            "chunkattn_sequences_evicted_total", "Sequences released because they were idle too long.", registry=r
        )
        self.released = Counter(
            "chunkattn_sequences_released_total", "Sequences released by Release or end_of_sequence.", registry=r
        )
        self.forked = Counter("chunkattn_sequences_forked_total", "Sequences created by Fork.", registry=r)
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

    def observe_pool(self, stats: EngineStats) -> None:
        """Set the KV-in-use and active-sequence gauges from the engine's stats."""
        self.kv_blocks_used.set(stats.used_blocks)
        self.active_sequences.set(stats.num_sequences)
