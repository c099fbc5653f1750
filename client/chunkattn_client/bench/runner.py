"""Drives a server as a model runner would, and records every call.

Closed loop (``concurrency`` N): N workers, each running one sequence after another. Open loop (``rate``
R): sequences arrive as a Poisson process of R per second, at most ``max_concurrency`` in flight. Each
sequence is its own server sequence id; its last call carries end_of_sequence, so a finished sequence
holds no KV. A sequence whose call fails is released (best effort) and recorded; the run goes on, and
stops early once ``max_errors`` calls have failed.

A duration-bounded run starts no sequence after the deadline and cuts the ones in flight before their
next call (they are released and counted as cut). Its window runs to the later of the deadline and the
last answer, so it overshoots the duration by at most one call per sequence, and those calls are
counted. A run of a given number of sequences runs them all to the end. Latencies leave out --verify's
reference computation; in the open loop a sequence's latency counts from its arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpc
import numpy.typing as npt

from chunkattn_client import codec
from chunkattn_client.aio import AsyncAttendStream, AsyncChunkAttnClient
from chunkattn_client.batch import BatchEntry
from chunkattn_client.bench import promtext
from chunkattn_client.bench.stats import percentile
from chunkattn_client.bench.workload import (
    Lengths,
    LengthSource,
    RandomTensors,
    SequenceSpec,
    Speculation,
    Step,
    WorkloadError,
    call_bytes,
    choose_layers,
    steps,
)
from chunkattn_client.client import ChunkAttnError, ServerInfo
from chunkattn_client.limits import route_problem
from chunkattn_client.reference import ReferenceModel, as_cached, within_tolerance

TRANSPORTS = ("unary", "stream")


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines a run (the report prints it as the run's parameters)."""

    target: str
    concurrency: int = 1
    rate: float | None = None  # sequences per second (open loop); None: closed loop
    max_concurrency: int = 256  # open loop: sequences in flight at most
    prompt: Lengths = field(default_factory=lambda: Lengths(128, 128))
    output: Lengths = field(default_factory=lambda: Lengths(32, 32))
    trace: tuple[SequenceSpec, ...] | None = None
    trace_path: str | None = None
    layers: str = "all"
    prefill_chunk: int = 0  # tokens per prefill piece; 0: the whole prompt in one call per layer
    transport: str = "unary"
    dtype: str = "float32"
    warmup_s: float = 0.0
    duration_s: float | None = None
    sequences: int | None = None
    seed: int = 0
    verify: int = 0
    timeout_s: float = 60.0
    max_errors: int = 100
    metrics_url: str | None = None
    route: str | None = None  # every sequence's x-chunkattn-route; None: each sequence's id
    spec_tokens: int = 0  # speculative decoding: drafts per verify call (0: plain one-token decode steps)
    accept_rate: float = 0.7  # the probability that each draft is accepted (while every earlier one was)

    def check(self) -> None:
        """Raise WorkloadError naming the first option that cannot work."""
        if self.duration_s is None and self.sequences is None and self.trace is None:
            raise WorkloadError("say how long to run: --duration SECONDS or --sequences N (or a --trace)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise WorkloadError(f"--duration must be > 0, got {self.duration_s}")
        if self.sequences is not None and self.sequences < 1:
            raise WorkloadError(f"--sequences must be >= 1, got {self.sequences}")
        if self.concurrency < 1 or self.max_concurrency < 1:
            raise WorkloadError("--concurrency and --max-concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise WorkloadError(f"--rate must be > 0 sequences per second, got {self.rate}")
        if self.prefill_chunk < 0:
            raise WorkloadError(f"--prefill-chunk must be >= 0 (0: whole prompt), got {self.prefill_chunk}")
        if self.route is not None and (problem := route_problem(self.route)):
            raise WorkloadError(f"--route: {problem}")
        if self.transport not in TRANSPORTS:
            raise WorkloadError(f"--transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.spec_tokens < 0 or not 0 <= self.accept_rate <= 1:
            raise WorkloadError(
                f"--spec-tokens must be >= 0 and --accept-rate in [0, 1], got {self.spec_tokens} and {self.accept_rate}"
            )
        if self.warmup_s < 0 or self.verify < 0 or self.timeout_s <= 0 or self.max_errors < 1:
            raise WorkloadError("--warmup and --verify must be >= 0, --timeout > 0 and --max-errors >= 1")

    def max_sequences(self) -> int | None:
        """The measured phase's sequence count: --sequences, else one pass over a trace without --duration."""
        if self.sequences is not None:
            return self.sequences
        if self.trace is not None and self.duration_s is None:
            return len(self.trace)
        return None

    def params(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "mode": f"open loop, {self.rate}/s" if self.rate else f"closed loop, concurrency {self.concurrency}",
            "concurrency": None if self.rate else self.concurrency,
            "rate": self.rate,
            "max_concurrency": self.max_concurrency if self.rate else None,
            "prompt_len": f"trace {self.trace_path}" if self.trace else str(self.prompt),
            "output_len": f"trace {self.trace_path}" if self.trace else str(self.output),
            "layers": self.layers,
            "prefill_chunk": self.prefill_chunk,
            "transport": self.transport,
            "dtype": self.dtype,
            "warmup_s": self.warmup_s,
            "duration_s": self.duration_s,
            "sequences": self.max_sequences(),
            "seed": self.seed,
            "verify": self.verify,
            "timeout_s": self.timeout_s,
            "spec_tokens": self.spec_tokens,
            "accept_rate": self.accept_rate if self.spec_tokens else None,
        }


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
        """p50 of the decode steps (else prefill pieces) that ended in the last ``window_s`` seconds."""
        since = self.now() - window_s
        recent: dict[str, list[float]] = {"decode": [], "prefill": []}
        for t, kind, _, s in reversed(self.steps):  # appended as they end: the newest are last
            if t < since:
                break
            recent[kind].append(s)
        for kind in ("decode", "prefill"):
            if recent[kind]:
                return 1000 * percentile(sorted(recent[kind]), 50)
        return None


class Verifier:
    """Recomputes sampled calls with the float64 reference and compares (``--verify N``).

    From the start of the run, each new sequence is sampled with probability 1/2 (seeded) until N
    calls are reserved; a sampled sequence has its first calls checked, keeping their K/V in its own
    ReferenceModel. A sampled sequence that is cut or fails hands its unchecked calls back.
    """

    def __init__(
        self,
        info: ServerInfo,
        dtype: str,
        budget: int,
        seed: int,
        refresh: Callable[[], Awaitable[ServerInfo]] | None = None,
    ) -> None:
        self.info, self.dtype = info, dtype
        self._refresh = refresh
        self.requested = budget
        self._unreserved = budget
        self._rng = random.Random(seed)
        self.checked = 0
        self.max_error = 0.0
        self.mismatches: list[dict[str, Any]] = []

    async def scales(self, layer: int) -> tuple[float, float]:
        """The layer's float8 cache scales (k, v); a server that calibrates them reports 0 until the layer's
        first write, so Info is read again then (``refresh``)."""
        x = self.info.layers[layer]
        if x.k_scale == 0 and self._refresh is not None:
            self.info = await self._refresh()
            x = self.info.layers[layer]
        return x.k_scale, x.v_scale

    def sample(self, num_calls: int) -> SequenceCheck | None:
        if self._unreserved <= 0 or self._rng.random() >= 0.5:
            return None
        n = min(num_calls, self._unreserved)
        self._unreserved -= n
        return SequenceCheck(self, n)

    def refund(self, calls: int) -> None:
        self._unreserved += calls

    def result(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "checked": self.checked,
            "complete": self.checked >= self.requested,
            "mismatches": len(self.mismatches),
            "max_error": self.max_error,
            "first_mismatches": self.mismatches[:5],
        }


class SequenceCheck:
    """The reference of one sampled sequence, for its first ``calls`` calls."""

    def __init__(self, verifier: Verifier, calls: int) -> None:
        self._v = verifier
        self._left = calls
        self._ref = ReferenceModel.for_server(verifier.info)

    async def check(self, layer: int, entry: BatchEntry, q: Any, k: Any, v: Any, out: Any) -> None:
        if self._left <= 0:
            return
        self._left -= 1
        dtype = self._v.dtype
        q64, k64, v64 = (None if x is None else codec.to_float64(x, dtype) for x in (q, k, v))
        assert q64 is not None
        if k64 is not None and v64 is not None:  # what the server's cache gives back (float8: quantized)
            k_scale, v_scale = await self._v.scales(layer)
            k64 = as_cached(k64, self._v.info.cache_dtype, k_scale)
            v64 = as_cached(v64, self._v.info.cache_dtype, v_scale)
        want = await asyncio.to_thread(self._ref.attend, layer, [entry], q64, k64, v64)
        ok, err = within_tolerance(codec.to_float64(out, dtype), want, dtype)
        self._v.checked += 1
        self._v.max_error = max(self._v.max_error, err)
        if not ok:
            self._v.mismatches.append(
                {"seq_id": entry.seq_id, "layer": layer, "position": entry.position, "tokens": entry.num_tokens}
                | {"error": err}
            )

    def truncate(self, seq_id: str, length: int) -> None:
        """The sequence was truncated on the server: the reference follows."""
        self._ref.truncate(seq_id, length)

    def finish(self) -> None:
        """The sequence ended: calls it reserved but did not check go back to the budget."""
        self._v.refund(self._left)
        self._left = 0


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
            n = d(f"{name}_count", rpc="Attend")
            return 1000 * d(f"{name}_sum", rpc="Attend") / n if n else None

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


Progress = Callable[[Recorder, bool], None]  # (the phase's recorder, whether this is the final call)


class Bench:
    """One run against one server: an optional warm-up phase, then the measured phase."""

    def __init__(self, config: BenchConfig, client: AsyncChunkAttnClient, info: ServerInfo) -> None:
        config.check()
        self.config, self.client, self.info = config, client, info
        self.layers = choose_layers(info, config.layers)
        self._lengths = LengthSource(config.prompt, config.output, config.trace, config.seed)
        if config.dtype not in info.dtypes:
            raise WorkloadError(f"--dtype {config.dtype}: the server takes {', '.join(info.dtypes)}")
        biggest = min(config.prefill_chunk or self._lengths.max_prompt, self._lengths.max_prompt)
        biggest = max(biggest, config.spec_tokens + 1)  # a verify call's tokens
        self._speculation = Speculation(config.spec_tokens, config.accept_rate) if config.spec_tokens else None
        self._drafts = random.Random(config.seed + 2)
        chunked = [i for i in self.layers if info.layers[i].chunk_size]
        if config.spec_tokens > info.spec_window and chunked:
            raise WorkloadError(
                f"--spec-tokens {config.spec_tokens}: a verify call may roll back {config.spec_tokens} tokens, and the"
                f" server keeps {info.spec_window} before a chunked layer's current chunk, so a verify call across"
                f" a chunk boundary could not be truncated: start it with --spec-window {config.spec_tokens} or more"
            )
        sent, _ = call_bytes(info, config.dtype, biggest, writes_kv=True)
        limit = min(info.max_message_bytes, client.max_message_bytes)
        if sent + (1 << 16) > limit:
            raise WorkloadError(
                f"a {biggest}-token call carries {sent} bytes of tensors, over the message limit of {limit}"
                f" (server {info.max_message_bytes}, client {client.max_message_bytes}); pass a smaller"
                " --prefill-chunk"
            )
        self._data = RandomTensors(info, config.dtype, biggest, config.seed)
        self._verifier = (
            Verifier(info, config.dtype, config.verify, config.seed, client.info) if config.verify else None
        )
        self._run_id = uuid.uuid4().hex[:8]
        self._arrivals = random.Random(config.seed + 1)
        self._seq_no = 0
        self._stop_at: float | None = None
        self._max_sequences: int | None = None
        self._started = 0
        self._aborted: str | None = None
        self.interrupted = False
        self._rec = Recorder()
        self._checking: Verifier | None = None

    async def run(self, progress: Progress | None = None, progress_interval_s: float = 1.0) -> RunResult:
        cfg = self.config
        watch = MetricsWatch(cfg.metrics_url) if cfg.metrics_url else None
        if watch:
            await watch.scrape()  # a wrong URL fails here (MetricsError), before any load
        if cfg.warmup_s:
            await self._phase(Recorder(), cfg.warmup_s, None, None)
        if watch:
            watch.before = await watch.scrape()
        rec = Recorder()
        tasks = [asyncio.create_task(watch.watch(rec))] if watch else []
        if progress:
            tasks.append(asyncio.create_task(_every(progress_interval_s, lambda: progress(rec, False))))
        try:
            await self._phase(rec, cfg.duration_s, cfg.max_sequences(), self._verifier)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # The window: to the last answer (clean-up of cut sequences is not load), and at least to the deadline
        # of a timed run that was not stopped early.
        window = min(rec.now(), cfg.duration_s) if cfg.duration_s else 0.0
        rec.end = max(rec.last_answer, window, 1e-9)
        server = None
        if watch:
            try:
                watch.after = await watch.scrape()
                server = watch.summary()
            except promtext.MetricsError as e:
                server = {"error": str(e)}
        if progress:
            progress(rec, True)
        return RunResult(
            cfg,
            self.info,
            self.layers,
            rec,
            self._verifier.result() if self._verifier else None,
            server,
            watch.series if watch else [],
            self._aborted,
        )

    def stop(self, reason: str) -> None:
        """End the run early (e.g. on Ctrl-C): no new sequences; those in flight are cut before their next call."""
        self.interrupted = True
        self._aborted = self._aborted or reason

    # -- one phase ---------------------------------------------------------------------------------

    async def _phase(
        self,
        rec: Recorder,
        duration_s: float | None,
        max_sequences: int | None,
        verifier: Verifier | None,
    ) -> None:
        self._rec = rec
        self._stop_at = None if duration_s is None else time.perf_counter() + duration_s
        self._max_sequences, self._started = max_sequences, 0
        self._checking = verifier  # none in the warm-up
        async with asyncio.TaskGroup() as tasks:
            if self.config.rate is None:
                for _ in range(self.config.concurrency):
                    tasks.create_task(self._worker())
            else:
                await self._arrive(self.config.rate, tasks)

    def _may_start(self) -> bool:
        if self._cut():
            return False
        return self._max_sequences is None or self._started < self._max_sequences

    def _cut(self) -> bool:
        return bool(self._aborted) or (self._stop_at is not None and time.perf_counter() >= self._stop_at)

    async def _worker(self) -> None:
        while self._may_start():
            self._started += 1
            await self._sequence(self._lengths.next(), time.perf_counter())

    async def _arrive(self, rate: float, tasks: asyncio.TaskGroup) -> None:
        """Poisson arrivals; a sequence that finds no free slot waits, and its latency counts from arrival."""
        slots = asyncio.Semaphore(self.config.max_concurrency)
        due = time.perf_counter()

        async def one(spec: SequenceSpec, arrived: float) -> None:
            await slots.acquire()
            try:
                self._rec.arrival_wait.append(time.perf_counter() - arrived)
                if self._cut():  # the run ended while it waited: it never reached the server
                    self._rec.sequences_cut += 1
                    return
                await self._sequence(spec, arrived)
            finally:
                slots.release()

        while True:
            due += self._arrivals.expovariate(rate)
            while (wait := due - time.perf_counter()) > 0 and self._may_start():
                await asyncio.sleep(min(wait, 0.05))  # wake at the deadline, not at an arrival past it
            if not self._may_start():
                break
            self._started += 1
            tasks.create_task(one(self._lengths.next(), due))

    # -- one sequence ------------------------------------------------------------------------------

    async def _sequence(self, spec: SequenceSpec, arrived: float) -> None:
        rec = self._rec
        self._seq_no += 1
        seq_id = f"bench-{self._run_id}-{self._seq_no}"
        # Behind Envoy, each sequence's calls reach the replica that holds its KV; sequences spread.
        client = self.client.with_route(seq_id if self.config.route is None else self.config.route)
        plan = steps(spec, self.config.prefill_chunk, self._speculation, self._drafts)
        check = self._checking.sample(len(plan) * len(self.layers)) if self._checking else None
        stream = client.stream() if self.config.transport == "stream" else None
        verifying = 0.0  # seconds spent on the reference, left out of every latency
        finished = False  # the last call (end_of_sequence) was answered: nothing is left on the server
        failed = False
        rec.in_flight += 1
        rec.max_in_flight = max(rec.max_in_flight, rec.in_flight)
        try:
            for i, step in enumerate(plan):
                t = time.perf_counter()
                answered = []
                for j, layer in enumerate(self.layers):
                    if self._cut():
                        rec.sequences_cut += 1
                        return
                    last = i == len(plan) - 1 and j == len(self.layers) - 1
                    answered.append(await self._call(client, stream, layer, seq_id, step, last))
                truncated = step.keep is not None and i < len(plan) - 1  # the last step ends the sequence
                if truncated:
                    await self._truncate(client, seq_id, step)
                rec.steps.append((rec.now(), step.kind, step.tokens, time.perf_counter() - t))
                rec.tokens[step.kind] += step.tokens
                if step.keep is not None:
                    rec.drafts += step.num_tokens - 1
                    rec.accepted += step.keep - 1
                if check is not None:
                    t = time.perf_counter()
                    for call in answered:
                        await check.check(*call)
                    if truncated:
                        check.truncate(seq_id, step.position + step.tokens)
                    verifying += time.perf_counter() - t
            finished = True
            rec.sequences += 1
            rec.sequence_latency.append(time.perf_counter() - arrived - verifying)
        except ChunkAttnError as e:
            failed = True
            rec.sequences_failed += 1
            rec.error(e.code.name, e.message)
            if sum(rec.errors.values()) >= self.config.max_errors and not self._aborted:
                self._aborted = f"stopped after {self.config.max_errors} failed calls (--max-errors)"
        finally:
            rec.in_flight -= 1
            if check is not None:
                check.finish()
            if stream is not None:
                await _close(stream, failed)
            if not finished:
                await self._release(client, seq_id)

    async def _call(
        self,
        client: AsyncChunkAttnClient,
        stream: AsyncAttendStream | None,
        layer: int,
        seq_id: str,
        step: Step,
        last: bool,
    ) -> tuple[int, BatchEntry, Any, Any, Any, Any]:
        """One layer's call for one step; returns what --verify needs: (layer, entry, q, k, v, output)."""
        writes = self.info.layers[layer].kv_source is None
        n = step.num_tokens
        q = self._data.take(n, self.info.num_heads)
        k = self._data.take(n, self.info.num_kv_heads) if writes else None
        v = self._data.take(n, self.info.num_kv_heads) if writes else None
        entry = BatchEntry(seq_id, step.position, n)
        kw: dict[str, Any] = {"end_of_sequence": [seq_id] if last else (), "dtype": self.config.dtype}
        call: Awaitable[npt.NDArray[Any]]
        if stream is None:
            call = client.attend(layer, [entry], q, k, v, **kw)  # the client's deadline: --timeout
        else:
            call = asyncio.wait_for(stream.attend(layer, [entry], q, k, v, **kw), self.config.timeout_s)
        try:
            out = await call
        except TimeoutError:
            raise ChunkAttnError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on the stream within {self.config.timeout_s} s"
            ) from None
        rec = self._rec
        rec.last_answer = rec.now()
        rec.calls += 1
        rec.layer_tokens["decode" if n == 1 else "prefill"] += n
        sent, received = call_bytes(self.info, self.config.dtype, n, writes)
        rec.bytes_sent += sent
        rec.bytes_received += received
        return layer, entry, q, k, v, out

    async def _truncate(self, client: AsyncChunkAttnClient, seq_id: str, step: Step) -> None:
        """Drop a verify step's rejected drafts (Truncate: part of the step's latency)."""
        await client.truncate(seq_id, step.position + step.tokens)
        rec = self._rec
        rec.last_answer = rec.now()
        rec.truncations += 1

    async def _release(self, client: AsyncChunkAttnClient, seq_id: str) -> None:
        """Free a sequence that did not finish (best effort, short deadline); a failure is counted apart."""
        try:
            await asyncio.wait_for(client.release([seq_id], missing_ok=True), min(self.config.timeout_s, 5.0))
        except ChunkAttnError as e:
            self._rec.release_errors[e.code.name] += 1
        except TimeoutError:
            self._rec.release_errors[grpc.StatusCode.DEADLINE_EXCEEDED.name] += 1


async def _close(stream: AsyncAttendStream, failed: bool) -> None:
    """End a sequence's stream: cancelled after a failure (it may be stuck), else closed, or cancelled
    when that takes over 5 s."""
    if failed:
        stream.cancel()
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stream.close(), 5.0)
        return
    stream.cancel()


async def _every(interval_s: float, fn: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        fn()
