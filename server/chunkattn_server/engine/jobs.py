"""What one engine step is and does: the jobs the scheduler queues, a step served on the engine (a control
job alone, or Attend calls of one layer merged into one ``Engine.attend_step``), its metrics, and the
hand-over of its results to the callers' event loops. Where and when a step runs is the scheduler's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from chunkattn_client import codec, wire
from chunkattn_client.batch import BatchEntry
from chunkattn_server.config import ModelShape
from chunkattn_server.engine.core import AttendCall, Engine, EngineStats, Retry
from chunkattn_server.metrics import Metrics


class Entry(Protocol):
    """One sequence of an Attend call (chunkattn.v1.AttendEntry fits)."""

    @property
    def seq_id(self) -> str: ...
    @property
    def position(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def end_of_sequence(self) -> bool: ...


@dataclass(frozen=True)
class AttendOutput:
    """What an Attend call gets back: its output in host memory."""

    output: wire.RawTensor


@dataclass(eq=False)
class Job:
    """A queued piece of engine work and the future its caller awaits."""

    rpc: str  # the RPC the client called, for the metrics
    future: asyncio.Future[Any]
    submitted: float = field(default_factory=time.perf_counter)

    def touches(self) -> frozenset[tuple[str, str]] | None:
        """The sequences (tenant, seq_id) the job reads or changes; None: possibly any (a barrier)."""
        return None


@dataclass(eq=False)
class Control(Job):
    """fn(engine), in a step of its own (a barrier: see Job.touches)."""

    fn: Callable[[Engine], Any] = field(default=lambda e: None)


@dataclass(eq=False)
class Attend(Job):
    """One Attend call: its layer, entries and tensors (see Engine.attend); tokens: q's rows."""

    layer: int = 0
    entries: Sequence[Entry] = ()
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    tokens: int = 0
    tenant: str = ""
    _ids: frozenset[tuple[str, str]] | None = None
    _malformed: bool = False

    def touches(self) -> frozenset[tuple[str, str]] | None:
        """Its sequences; None (a barrier: it runs alone, where its checks say what is wrong) when they cannot
        even be read (an in-process caller's unhashable id)."""
        if self._ids is None and not self._malformed:  # once, when a step is chosen: thousands cost milliseconds
            try:
                self._ids = frozenset((self.tenant, e.seq_id) for e in self.entries)
            except TypeError:
                self._malformed = True
        return self._ids


Result = tuple[Job, bool, Any]  # a job, whether it succeeded, and its result or exception


def work(model: ModelShape, step: Sequence[Job]) -> float:
    """The step's attention work: query-key pairs (at most, per entry) x heads x head size; a control job
    counts as large (exports and imports copy whole blocks)."""
    first = step[0]
    if not isinstance(first, Attend):
        return float("inf")
    if not (isinstance(first.layer, int) and 0 <= first.layer < model.num_layers):
        return 0.0  # every call fails its checks
    c = model.layers[first.layer].chunk_size
    pairs = 0
    for job in step:
        for e in job.entries:  # type: ignore[attr-defined]
            try:
                p, n = e.position, e.num_tokens
                pairs += n * (p + n - (p - p % c if c else 0))
            except TypeError:
                continue  # a malformed entry (an in-process caller's): its call fails its checks
    return float(pairs * model.num_heads * model.head_size)


def serve(
    engine: Engine, step: list[Job], metrics: Metrics | None, runner: str
) -> tuple[list[Result], list[Job], EngineStats]:
    """Run one step on the engine (on the thread that may: see the scheduler). Returns the answers, (job, ok,
    result or exception), the calls to run again, first, in a step of their own (engine.Retry), and the
    engine's stats after it. The metrics are observed before the answers go: a client that reads them after
    its call sees it counted."""
    started = time.perf_counter()
    results: list[Result] = []
    retry: list[Job] = []
    first = step[0]
    if isinstance(first, Control):
        try:
            results.append((first, True, first.fn(engine)))
        except Exception as e:
            results.append((first, False, e))
    else:
        _serve_attend(engine, step, results, retry, metrics)  # type: ignore[arg-type]
    stats = engine.stats()
    if metrics is not None:
        _observe(metrics, stats, step, results, retry, started, time.perf_counter(), runner)
    return results, retry, stats


def _serve_attend(
    engine: Engine, step: list[Attend], results: list[Result], retry: list[Job], metrics: Metrics | None
) -> None:
    calls = [
        AttendCall(
            [BatchEntry(e.seq_id, e.position, e.num_tokens) for e in job.entries],
            job.q,  # type: ignore[arg-type]
            job.k,
            job.v,
            job.tenant,
        )
        for job in step
    ]
    try:
        outs = engine.attend_step(step[0].layer, calls)
    except Exception as e:  # not one call's own error: every call of the step fails with it
        results.extend((job, False, e) for job in step)
        return
    released = 0
    for job, out in zip(step, outs, strict=True):
        if isinstance(out, Retry):
            retry.append(job)
            continue
        if isinstance(out, BaseException):
            results.append((job, False, out))
            continue
        try:
            ending = [e.seq_id for e in job.entries if e.end_of_sequence]
            if ending:
                released += engine.release(ending, tenant=job.tenant)
            results.append((job, True, AttendOutput(codec.to_raw(out))))  # to host memory, here
        except Exception as e:
            results.append((job, False, e))
    if released and metrics is not None:
        metrics.released.inc(released)


def _observe(
    m: Metrics,
    stats: EngineStats,
    step: list[Job],
    results: list[Result],
    retry: list[Job],
    started: float,
    finished: float,
    runner: str,
) -> None:
    """Metrics, once per step where they can be: per call only what is labelled by its RPC."""
    m.jobs_running.set(0)
    m.of(m.steps, runner).inc()
    m.observe_pool(stats)
    compute_s = finished - started
    for job, _, _ in results:
        m.of(m.queue_seconds, job.rpc).observe(started - job.submitted)
        m.of(m.compute_seconds, job.rpc).observe(compute_s)
    if not isinstance(step[0], Attend):
        return
    served = [job for job, ok, _ in results if ok]
    m.step_calls.observe(len(step) - len(retry))
    m.step_tokens.observe(sum(job.tokens for job in step if job not in retry))  # type: ignore[attr-defined]
    decode = prefill = received = sent = 0
    for job, ok, value in results:
        if not ok:
            continue
        assert isinstance(job, Attend)
        for e in job.entries:
            if e.num_tokens == 1:
                decode += 1
            else:
                prefill += e.num_tokens
        received += sum(t.nbytes for t in (job.q, job.k, job.v) if t is not None)
        sent += len(value.output.data)
    if served:
        m.of(m.tokens, "decode").inc(decode)
        m.of(m.tokens, "prefill").inc(prefill)
        m.bytes_received.inc(received)
        m.bytes_sent.inc(sent)


def hand_back(done: list[Result]) -> None:
    """From any thread: have each job's event loop deliver its result (a closed loop: nobody waits)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Result]] = {}
    for result in done:
        by_loop.setdefault(result[0].future.get_loop(), []).append(result)
    for loop, results in by_loop.items():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, results)


def deliver(done: list[Result]) -> None:
    """On an event loop: hand each job of a step its result (unless its caller has gone); jobs of other
    loops get theirs through those loops (hand_back)."""
    loop = asyncio.get_running_loop()
    hand_back([r for r in done if r[0].future.get_loop() is not loop])
    for job, ok, value in done:
        if job.future.get_loop() is not loop or job.future.done():
            continue
        if ok:
            job.future.set_result(value)
        else:
            job.future.set_exception(value)
