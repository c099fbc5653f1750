"""The scheduler: the one thread that owns the engine and its device, and the queue of jobs it serves.

The asyncio event loop never runs tensor math: it queues typed jobs here and awaits their futures. Each
*step* the thread takes

- a control job (release, fork, export, import, info ...) alone, in its place in the queue; or
- the queued Attend calls of the first queued call's layer, up to ``max_batch_tokens`` tokens, merged into
  one ``Engine.attend_step``: one compute, the output split back to each call.

Rules that keep every call's result what it would be alone:
- calls that touch the same sequence keep their arrival order and never share a step; a control job keeps
  its order against the calls of the sequences it touches (a job that does not say which it touches is a
  barrier: nothing behind it overtakes it);
- a call that fails its own checks fails alone, with its own status and message, and changes nothing;
- a call that finds the pool short while earlier calls of its step hold blocks runs again in the next
  step, first in line, where it sees the pool as it would have alone;
- ``end_of_sequence`` releases after its call.

The first queued job always runs next (no job overtakes the oldest one), so nothing starves. Results go
back to the event loop in one hand-off per step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from chunkattn_client import codec, wire
from chunkattn_client.batch import BatchEntry
from chunkattn_server.engine import AttendCall, Engine, EngineStats, Retry
from chunkattn_server.metrics import Metrics

T = TypeVar("T")

SCAN_LIMIT = 1024  # queued jobs one step looks through for calls to merge

# A step whose attention work (query-key pairs x heads x head size) is below this runs on one CPU thread.
# Torch's CPU thread pool (OpenMP) wakes its threads for some ops of even a decode step, and they then
# spin waiting for more: through the service on the 2-core dev VM, one client's decode calls ran at 687
# calls/s with the pool and 809 with one thread, the server burning 4.9 s and 2.4 s of CPU for the same
# 3 s of calls. Two threads win from here on (demo model, through the service, 2026-12-04): a 128-token
# prefill took 1.82 ms on two threads and 2.10 on one, 8 decodes over 1,000 keys 2.15 and 2.87 ms; a
# 64-token prefill (~1M) or one decode over 1,000 keys (0.5M) is a tie.
SERIAL_WORK = 1 << 20


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
class _Job:
    rpc: str  # the RPC the client called, for the metrics
    future: asyncio.Future[Any]
    submitted: float = field(default_factory=time.perf_counter)

    def touches(self) -> frozenset[str] | None:
        """The sequences the job reads or changes; None: possibly any (a barrier)."""
        return None


@dataclass(eq=False)
class _Control(_Job):
    fn: Callable[[Engine], Any] = field(default=lambda e: None)


@dataclass(eq=False)
class _Attend(_Job):
    layer: int = 0
    entries: Sequence[Entry] = ()
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    tokens: int = 0
    _ids: frozenset[str] | None = None

    def touches(self) -> frozenset[str]:
        if self._ids is None:  # on the scheduler's thread, once: a batch of thousands costs milliseconds
            self._ids = frozenset(e.seq_id for e in self.entries)
        return self._ids


class Scheduler:
    """Runs jobs on one thread, merging queued Attend calls of one layer into one engine step.

    The engine is built on that thread too, so exactly one thread ever runs torch's parallel CPU kernels:
    when the main thread had built it (and so started an OpenMP team of its own), each call on the
    worker thread ran about 2x slower on the 2-core dev machines.

    ``batching`` False runs every job in a step of its own; ``max_batch_delay_us`` > 0 lets a step whose
    first job is an Attend call wait that long after that call arrived for more calls to join it.
    ``stop()`` lets queued jobs finish first.
    """

    def __init__(
        self,
        build: Callable[[], Engine],
        metrics: Metrics | None = None,
        *,
        batching: bool = True,
        max_batch_tokens: int = 8192,
        max_batch_delay_us: int = 0,
    ) -> None:
        self._metrics = metrics
        self._batching = batching
        self._max_tokens = max_batch_tokens
        self._delay_s = max_batch_delay_us / 1e6
        self._threads = 1  # torch's CPU threads for the current step (set on the scheduler's thread)
        self._queue: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(build, built), name="chunkattn-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()
        # The pool and sequences after the last step, for readers that must not queue behind the jobs (Info):
        # replaced whole by the scheduler's thread, so a reader sees one step's state or the next one's.
        self.stats: EngineStats = self.engine.stats()

    # -- the event loop's side ------------------------------------------------------------------------

    async def run(self, rpc: str, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the scheduler's thread, in a step of its own, and return (or raise) what it
        does. A barrier: it runs after every job queued before it and before every one queued after."""
        result: T = await self._submit(_Control(rpc, asyncio.get_running_loop().create_future(), fn=fn))
        return result

    async def attend(
        self,
        rpc: str,
        layer: int,
        entries: Sequence[Entry],
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> AttendOutput:
        """One Attend call (see Engine.attend), merged with other queued calls of its layer where the
        rules allow; its sequences with ``end_of_sequence`` are released after it. Raises the EngineError
        it would raise alone."""
        tokens = int(q.shape[0]) if q.dim() else 0  # the call's tokens, when it is well formed (else it fails alone)
        job = _Attend(
            rpc, asyncio.get_running_loop().create_future(), layer=layer, entries=entries, q=q, k=k, v=v, tokens=tokens
        )
        result: AttendOutput = await self._submit(job)
        return result

    async def _submit(self, job: _Job) -> Any:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler has stopped")
            self._queue.append(job)
            self._cond.notify()
            if self._metrics is not None:
                self._metrics.jobs_queued.set(len(self._queue))
        return await job.future

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # -- the scheduler's thread -----------------------------------------------------------------------

    def _main(self, build: Callable[[], Engine], built: concurrent.futures.Future[Engine]) -> None:
        try:
            engine = build()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(engine)
        pool = self._threads = torch.get_num_threads()
        while (step := self._next_step()) is not None:
            if engine.device.type == "cpu" and pool > 1:
                self._use_threads(1 if self._work(engine, step) < SERIAL_WORK else pool)
            self._serve(engine, step)

    def _use_threads(self, n: int) -> None:
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    @staticmethod
    def _work(engine: Engine, step: list[_Job]) -> float:
        """The step's attention work: query-key pairs (at most, per entry) x heads x head size; a control job
        counts as large (exports and imports copy whole blocks)."""
        if not isinstance(step[0], _Attend):
            return float("inf")
        model = engine.config.model
        if not 0 <= step[0].layer < model.num_layers:
            return 0.0  # every call fails its checks
        c = model.layers[step[0].layer].chunk_size
        pairs = 0
        for job in step:
            for e in job.entries:  # type: ignore[attr-defined]
                n, end = e.num_tokens, e.position + e.num_tokens
                pairs += n * (end - (e.position - e.position % c if c else 0))
        return float(pairs * model.num_heads * model.head_size)

    def _next_step(self) -> list[_Job] | None:
        """The jobs of the next step, taken from the queue (None: stopped and nothing left)."""
        with self._cond:
            while True:
                while self._queue and self._queue[0].future.cancelled():
                    self._queue.popleft()  # its caller is gone before it ran: as if it had never come
                if self._queue:
                    break
                if self._stopping:
                    return None
                self._cond.wait()
            first = self._queue[0]
            if self._delay_s and self._batching and isinstance(first, _Attend):
                deadline = first.submitted + self._delay_s
                while (left := deadline - time.perf_counter()) > 0 and self._queued_tokens(
                    first.layer
                ) < self._max_tokens:
                    self._cond.wait(left)
            step = self._take()
            if self._metrics is not None:
                self._metrics.jobs_queued.set(len(self._queue))
                self._metrics.jobs_running.set(len(step))
            return step

    def _queued_tokens(self, layer: int) -> int:
        return sum(j.tokens for j in self._queue if isinstance(j, _Attend) and j.layer == layer)

    def _take(self) -> list[_Job]:
        """The first queued job, and (when it is an Attend call and batching is on) every later call of its
        layer that may join it: within the token budget, touching no sequence that a job it would
        overtake touches, and none that an earlier call of the step touches."""
        first = self._queue[0]
        if not (self._batching and isinstance(first, _Attend)):
            return [self._queue.popleft()]
        step: list[_Job] = [first]
        tokens = first.tokens
        blocked = set(first.touches())
        for i, job in enumerate(self._queue):
            if i == 0:
                continue
            if i >= SCAN_LIMIT:
                break
            touched = job.touches()
            if touched is None:
                break  # a barrier: nothing behind it may overtake it
            if (
                isinstance(job, _Attend)
                and job.layer == first.layer
                and tokens + job.tokens <= self._max_tokens
                and blocked.isdisjoint(touched)
                and not job.future.cancelled()
            ):
                step.append(job)
                tokens += job.tokens
            blocked |= touched
        if len(step) == 1:
            self._queue.popleft()
        else:
            taken = set(map(id, step))
            self._queue = collections.deque(j for j in self._queue if id(j) not in taken)
        return step

    def _serve(self, engine: Engine, step: list[_Job]) -> None:
        started = time.perf_counter()
        results: list[tuple[_Job, bool, Any]] = []  # (job, ok, result or exception)
        retry: list[_Job] = []
        if isinstance(step[0], _Control):
            try:
                results.append((step[0], True, step[0].fn(engine)))
            except Exception as e:
                results.append((step[0], False, e))
        else:
            self._serve_attend(engine, step, results, retry)  # type: ignore[arg-type]
        self.stats = engine.stats()
        if retry:
            with self._cond:
                self._queue.extendleft(reversed(retry))
        # Observed before the answers go: a client that reads the metrics after its call sees it counted.
        self._observe(step, results, retry, started, time.perf_counter())
        if results:
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody waits for these any more
                results[0][0].future.get_loop().call_soon_threadsafe(_resolve, results)

    def _serve_attend(
        self, engine: Engine, step: list[_Attend], results: list[tuple[_Job, bool, Any]], retry: list[_Job]
    ) -> None:
        calls = [
            AttendCall([BatchEntry(e.seq_id, e.position, e.num_tokens) for e in job.entries], job.q, job.k, job.v)  # type: ignore[arg-type]
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
                    released += engine.release(ending)
                results.append((job, True, AttendOutput(codec.to_raw(out))))  # to host memory, here
            except Exception as e:
                results.append((job, False, e))
        if released and self._metrics is not None:
            self._metrics.released.inc(released)

    def _observe(
        self,
        step: list[_Job],
        results: list[tuple[_Job, bool, Any]],
        retry: list[_Job],
        started: float,
        finished: float,
    ) -> None:
        """Metrics, once per step where they can be: per call only what is labelled by its RPC."""
        m = self._metrics
        if m is None:
            return
        m.jobs_running.set(0)
        m.observe_pool(self.stats)
        compute_s = finished - started
        for job, _, _ in results:
            m.queue_seconds.labels(job.rpc).observe(started - job.submitted)
            m.compute_seconds.labels(job.rpc).observe(compute_s)
        if not isinstance(step[0], _Attend):
            return
        served = [job for job, ok, _ in results if ok]
        m.step_calls.observe(len(step) - len(retry))
        m.step_tokens.observe(sum(job.tokens for job in step if job not in retry))  # type: ignore[attr-defined]
        decode = prefill = received = sent = 0
        for job, ok, value in results:
            if not ok:
                continue
            assert isinstance(job, _Attend)
            for e in job.entries:
                if e.num_tokens == 1:
                    decode += 1
                else:
                    prefill += e.num_tokens
            received += sum(t.numel() * t.element_size() for t in (job.q, job.k, job.v) if t is not None)
            sent += len(value.output.data)
        if served:
            m.tokens.labels("decode").inc(decode)
            m.tokens.labels("prefill").inc(prefill)
            m.bytes_received.inc(received)
            m.bytes_sent.inc(sent)


def _resolve(done: list[tuple[_Job, bool, Any]]) -> None:
    """On the event loop: hand each job of a step its result (unless its caller has gone)."""
    for job, ok, value in done:
        if job.future.done():
            continue
        if ok:
            job.future.set_result(value)
        else:
            job.future.set_exception(value)
