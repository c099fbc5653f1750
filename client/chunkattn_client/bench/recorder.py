"""What a bench run records and returns: Recorder (every answered call, step and sequence of a phase) and
RunResult (the measured phase's record with the run's config, server info, --verify and server results)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from chunkattn_client.bench.config import BenchConfig
from chunkattn_client.bench.stats import percentile
from chunkattn_client.client import ServerInfo


@dataclass
class Recorder:
    """Every answered call, step and sequence of one phase, timed from the phase's start."""

    t0: float = field(default_factory=time.perf_counter)
    started_utc: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    calls: int = 0
    sequences: int = 0
    sequences_cut: int = 0
    sequences_failed: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    tokens: Counter[str] = field(default_factory=Counter)  # model tokens of completed steps, by kind
    layer_tokens: Counter[str] = field(default_factory=Counter)  # tokens x answered calls (the server's count)
    bytes_sent: int = 0
    bytes_received: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # failed Attend calls, by status code
    error_examples: dict[str, str] = field(default_factory=dict)
    release_errors: Counter[str] = field(default_factory=Counter)  # failed clean-ups of unfinished sequences
    drafts: int = 0  # speculative decoding: drafts sent in verify calls, drafts accepted, Truncate calls made
    accepted: int = 0
    truncations: int = 0
    steps: list[tuple[float, str, int, float]] = field(default_factory=list)  # (end time, kind, tokens, s)
    sequence_latency: list[float] = field(default_factory=list)
    arrival_wait: list[float] = field(default_factory=list)  # open loop: arrival to start (no free slot)
    # The engine workload: per engine step (end time, engine, tokens, rows of its first layer, decodes, its layer
    # calls' seconds summed, the step's seconds), every layer call's seconds, and what the engine's users saw
    # (time to first token, time per output token after it, per finished request), and preemptions.
    engine_steps: list[tuple[float, int, int, int, int, float, float]] = field(default_factory=list)
    layer_latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    preemptions: int = 0
    last_answer: float = 0.0  # when the last call was answered
    end: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def error(self, code: str, message: str) -> None:
        self.errors[code] += 1
        self.error_examples.setdefault(code, message)

    @property
    def duration_s(self) -> float:
        return self.end if self.end is not None else self.now()

    def latencies(self, kind: str) -> list[float]:
        """Seconds per prefill piece ("prefill"), decode step ("decode") or whole sequence ("sequence")."""
        if kind == "sequence":
            return self.sequence_latency
        return [s for _, k, _, s in self.steps if k == kind]

    def recent_p50_ms(self, window_s: float = 5.0) -> float | None:
        """p50 of the decode steps (else prefill pieces; engine steps in the engine workload) that ended in the
        last ``window_s`` seconds."""
        since = self.now() - window_s
        if self.engine_steps:
            recent_steps = [x[6] for x in reversed(self.engine_steps) if x[0] >= since]
            return 1000 * percentile(sorted(recent_steps), 50) if recent_steps else None
        recent: dict[str, list[float]] = {"decode": [], "prefill": []}
        for t, kind, _, s in reversed(self.steps):  # appended as they end: the newest are last
            if t < since:
                break
            recent[kind].append(s)
        for kind in ("decode", "prefill"):
            if recent[kind]:
                return 1000 * percentile(sorted(recent[kind]), 50)
        return None


@dataclass
class RunResult:
    config: BenchConfig
    info: ServerInfo
    layers: tuple[int, ...]
    recorder: Recorder
    verify: dict[str, Any] | None
    server: dict[str, Any] | None
    server_series: list[tuple[float, float, float]]
    aborted: str | None
    engine: dict[str, Any] | None = None  # the engine workload: what its engines were (``EngineBench.layout``)


Progress = Callable[[Recorder, bool], None]  # (the phase's recorder, whether this is the final call)
