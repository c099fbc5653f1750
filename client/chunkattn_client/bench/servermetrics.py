"""``--metrics-url``: the server's Prometheus page watched during a bench run (MetricsWatch): scraped before
and after the measured phase and every second between, and summarised as what the server counted."""

from __future__ import annotations

import asyncio
from typing import Any

from chunkattn_client.bench import promtext
from chunkattn_client.bench.recorder import Recorder


class MetricsWatch:
    """The server's Prometheus page: scraped before and after the measured phase, and every second between."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before: promtext.Samples = {}
        self.after: promtext.Samples = {}
        self.series: list[tuple[float, float, float]] = []  # (time, KV blocks used, engine jobs in flight)
        self.failed_scrapes = 0

    async def scrape(self) -> promtext.Samples:
        return await asyncio.to_thread(promtext.fetch, self.url)

    async def watch(self, recorder: Recorder, interval_s: float = 1.0) -> None:
        while True:
            try:
                s = await self.scrape()
            except promtext.MetricsError:
                self.failed_scrapes += 1
            else:
                self.series.append(
                    (
                        recorder.now(),
                        promtext.total(s, "chunkattn_kv_blocks_used"),
                        promtext.total(s, "chunkattn_engine_jobs_in_flight"),
                    )
                )
            await asyncio.sleep(interval_s)

    def summary(self) -> dict[str, Any]:
        """What the server counted during the measured phase."""
        a, b = self.after, self.before

        def d(name: str, **match: str) -> float:
            return promtext.delta(a, b, name, **match)

        def mean_ms(name: str) -> float | None:
            """Per Attend call, unary or on a stream (--transport stream's calls are AttendStream's)."""
            n = sum(d(f"{name}_count", rpc=rpc) for rpc in ("Attend", "AttendStream"))
            return 1000 * sum(d(f"{name}_sum", rpc=rpc) for rpc in ("Attend", "AttendStream")) / n if n else None

        used = [u for _, u, _ in self.series] + [promtext.total(x, "chunkattn_kv_blocks_used") for x in (a, b)]
        codes = sorted(promtext.label_values(a, "chunkattn_requests_total", "code"))
        requests = {}
        for rpc in ("Attend", "AttendStream", "Release"):
            counts = {code: int(d("chunkattn_requests_total", rpc=rpc, code=code)) for code in codes}
            requests[rpc] = {code: n for code, n in counts.items() if n}
        return {
            "requests": requests,
            # Counted once per Attend call, so once per layer called; report.summary adds model tokens.
            "layer_tokens": {kind: int(d("chunkattn_tokens_total", kind=kind)) for kind in ("prefill", "decode")},
            "received_bytes": int(d("chunkattn_received_bytes_total")),
            "sent_bytes": int(d("chunkattn_sent_bytes_total")),
            "queue_ms_mean": mean_ms("chunkattn_queue_seconds"),
            "compute_ms_mean": mean_ms("chunkattn_compute_seconds"),
            "kv_blocks": int(promtext.total(a, "chunkattn_kv_blocks")),
            "kv_blocks_used_peak": int(max(used)),
            "kv_blocks_used_after": int(promtext.total(a, "chunkattn_kv_blocks_used")),
            "failed_scrapes": self.failed_scrapes,
        }
