"""The scheduler: the queue of engine jobs, which of them make the next step, and who runs it.

Each *step* is

- a control job (release, fork, export, import, info ...) alone, in its place in the queue; or
- the queued Attend calls of the first queued call's layer, up to ``max_batch_tokens`` tokens, merged into
  one ``Engine.attend_step``: one compute, the output split back to each call (jobs.py serves a step).

Rules that keep every call's result what it would be alone:
- calls that touch the same sequence keep their arrival order and never share a step; a control job keeps
  its order against the calls of the sequences it touches (a job that does not say which it touches is a
  barrier: nothing behind it overtakes it);
- a call that fails its own checks fails alone, with its own status and message, and changes nothing;
- a call that finds the pool short while earlier calls of its step hold blocks runs again in the next
  step, first in line, where it sees the pool as it would have alone;
- ``end_of_sequence`` releases after its call.

The first queued job always runs next (no job overtakes the oldest one), so nothing starves. One step runs
at a time, on the engine thread (which owns the device) or, for a small step on the CPU, on the event
loop's thread itself (see Scheduler). Results go back to the event loop once per step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from chunkattn_server.engine import jobs
from chunkattn_server.engine.core import Engine, EngineStats
from chunkattn_server.engine.jobs import Attend, AttendOutput, Control, Entry, Job, Result
from chunkattn_server.metrics import Metrics

T = TypeVar("T")
log = logging.getLogger(__name__)

SCAN_LIMIT = 1024  # queued jobs one step looks through for calls to merge

# A step whose attention work (query-key pairs x heads x head size) is below this runs on one CPU thread.
# Torch's CPU thread pool (OpenMP) wakes its threads for some ops of even a decode step, and they then
# spin waiting for more: for decode-sized steps one thread serves more calls per second with half the
# CPU. From about this much work on (a 64-token prefill, or one decode over 1,000 keys, is a tie) the
# pool's threads win (docs/results.md, "Other measurements behind design choices").
SERIAL_WORK = 1 << 20

# A step at most this large (attention work as above, and tokens) may run on the event loop's thread (see
# Scheduler): a few milliseconds of work at most, as long as a large request's parse, so the loop stays
# responsive; larger steps, prefills mostly, go to the engine thread.
INLINE_WORK = 1 << 23
INLINE_TOKENS = 256
# How many turns of the event loop a step on it may wait behind other ready callbacks (see _drain).
MAX_DEFERRALS = 32


class Scheduler:
    """Runs jobs one step at a time, merging queued Attend calls of one layer into one engine step.

    Two places run steps, never two steps at once (``_busy``, under ``_cond``):

    - the engine thread, which owns the device: it builds the engine, runs every control job and every
      step too large for the event loop, and on CUDA every step;
    - on the CPU, the event loop's own thread runs a *small* step (attention work under INLINE_WORK, as a
      batch of decodes) when the engine thread is idle. Handing such a step to another thread and back
      cost more than the step: two wake-ups, and the two threads taking the GIL from each other around
      every torch op (each releases it), which nearly doubled the server's CPU per decode call on two
      cores. Small steps run on one torch thread there (no OpenMP team on the loop's thread).

    The engine is built on the engine thread, so exactly one thread ever runs torch's parallel CPU
    kernels: when the main thread had built it (and so started an OpenMP team of its own), each call on
    the worker thread ran about twice as slow, the two teams competing for the cores.

    ``batching`` False runs every job in a step of its own; ``max_batch_delay_us`` > 0 lets a step whose
    first job is an Attend call wait that long after that call arrived for more calls to join it (every
    step then runs on the engine thread); ``inline`` False keeps every step off the event loop.
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
        inline: bool = True,
    ) -> None:
        self._metrics = metrics
        self._batching = batching
        self._max_tokens = max_batch_tokens
        self._delay_s = max_batch_delay_us / 1e6
        self._threads = 1  # torch's CPU threads for the current step (set on the scheduler's thread)
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False  # a step is running, or handed to the engine thread
        self._handoff: list[Job] | None = None  # a step the event loop gave the engine thread
        self._drain_loops: set[asyncio.AbstractEventLoop] = set()  # where a _drain is pending
        self._inline = False  # set once the engine is built (it depends on its device)
        built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(build, built), name="chunkattn-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()
        with self._cond:
            self._inline = inline and not self._delay_s and self.engine.device.type == "cpu"
        # The pool and sequences after the last step, for readers that must not queue behind the jobs (Info):
        # replaced whole after each step, so a reader sees one step's state or the next one's.
        self.stats: EngineStats = self.engine.stats()

    # -- the event loop's side ------------------------------------------------------------------------

    async def run(self, rpc: str, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the scheduler's thread, in a step of its own, and return (or raise) what it
        does. A barrier: it runs after every job queued before it and before every one queued after."""
        result: T = await self._submit(Control(rpc, asyncio.get_running_loop().create_future(), fn=fn))
        return result

    async def attend(
        self,
        rpc: str,
        layer: int,
        entries: Sequence[Entry],
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        tenant: str = "",
    ) -> AttendOutput:
        """One Attend call of ``tenant`` (see Engine.attend), merged with other queued calls of its layer
        where the rules allow; its sequences with ``end_of_sequence`` are released after it. Raises the
        EngineError it would raise alone."""
        tokens = int(q.shape[0]) if q.dim() else 0  # the call's tokens, when it is well formed (else it fails alone)
        future = asyncio.get_running_loop().create_future()
        job = Attend(rpc, future, layer=layer, entries=entries, q=q, k=k, v=v, tokens=tokens, tenant=tenant)
        result: AttendOutput = await self._submit(job)
        return result

    async def _submit(self, job: Job) -> Any:
        loop = job.future.get_loop()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler has stopped")
            self._queue.append(job)
            if self._metrics is not None:
                self._metrics.jobs_queued.set(len(self._queue))
            if not self._inline:
                self._cond.notify()  # the engine thread takes every step
            elif not self._busy:
                self._schedule_drain(loop)
        return await job.future

    def _schedule_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have ``loop`` look at the queue soon, once (under _cond). Soon, not now: the calls that arrive in
        this turn of the loop join the step. Each loop gets its own drain, so that a loop that is not running
        holds up nobody else's calls."""
        if loop in self._drain_loops:
            return
        try:
            if asyncio.get_running_loop() is loop:
                loop.call_soon(self._drain)
                self._drain_loops.add(loop)
                return
        except RuntimeError:  # no loop runs on this thread (the engine thread's case)
            pass
        with contextlib.suppress(RuntimeError):  # a closed loop: its jobs count as cancelled (_pending)
            loop.call_soon_threadsafe(self._drain)
            self._drain_loops.add(loop)

    def _drain(self, deferred: int = 0) -> None:
        """On an event loop: the next step, run here when it is small, else handed to the engine thread."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if not self._runnable(loop):
                return
        # Batch what the loop already holds: while other callbacks are ready (other calls' handlers among
        # them, on their way to queue their calls), go behind them, a bounded number of times. Without
        # this a step on the loop would hold one call, since each call reaches the queue in a turn of its
        # own. asyncio has no public "when idle"; its default loop keeps the ready callbacks in _ready
        # (other loops: no deferral).
        if getattr(loop, "_ready", None) and deferred < MAX_DEFERRALS:
            loop.call_soon(self._drain, deferred + 1)
            return
        with self._cond:
            if not self._runnable(loop):
                return
            self._drain_loops.discard(loop)
            step = self._take()
            if not self._small(step):
                self._handoff = step
                self._busy = True
                self._cond.notify()
                return
            self._busy = True
        threads = torch.get_num_threads()  # this thread's only, put back after: no OpenMP team on the loop's
        if threads != 1:
            torch.set_num_threads(1)
        try:
            results = self._step(self.engine, step, "event_loop")
        finally:
            if threads != 1:
                torch.set_num_threads(threads)
            with self._cond:
                self._busy = False
                if self._stopping:
                    self._cond.notify()  # stop() from another thread: the engine thread takes the rest
                elif self._pending():
                    self._schedule_drain(loop)
        jobs.deliver(results)

    def _runnable(self, loop: asyncio.AbstractEventLoop) -> bool:
        """(Under _cond.) Whether ``loop``'s pending drain may take a step now; if not, the drain is over (the
        engine thread gives the turn back when it is done, and stop() leaves the rest to it)."""
        if not (self._busy or self._stopping) and self._pending():
            return True
        self._drain_loops.discard(loop)
        return False

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
        torch.set_grad_enabled(False)  # this thread's mode: the engine never takes part in autograd
        pool = self._threads = torch.get_num_threads()
        while (step := self._next_step()) is not None:
            if engine.device.type == "cpu" and pool > 1:
                self._use_threads(1 if jobs.work(engine.config.model, step) < SERIAL_WORK else pool)
            results = self._step(engine, step, "engine_thread")
            with self._cond:
                self._busy = False
                # Go on with a large next step; a small one is the event loop's, which gets the turn with
                # these results (the same loop's callbacks run in order).
                if self._inline and not self._stopping and self._pending():
                    nxt = self._peek()
                    if self._small(nxt):
                        self._schedule_drain_after(results)
                        continue
                    self._handoff = self._take(nxt)
                    self._busy = True
            jobs.hand_back(results)

    def _schedule_drain_after(self, results: list[Result]) -> None:
        """(Engine thread, under _cond.) Hand these results back, then the turn to the queued jobs' loops."""
        jobs.hand_back(results)
        for loop in {job.future.get_loop() for job in itertools.islice(self._queue, SCAN_LIMIT)}:
            self._schedule_drain(loop)

    def _use_threads(self, n: int) -> None:
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    def _small(self, step: list[Job]) -> bool:
        """Whether the event loop may run the step itself (see the class docstring)."""
        return sum(j.tokens for j in step if isinstance(j, Attend)) <= INLINE_TOKENS and (
            jobs.work(self.engine.config.model, step) < INLINE_WORK
        )

    def _next_step(self) -> list[Job] | None:
        """The engine thread's next step (None: stopped and nothing left): one the event loop handed over,
        or, when the engine thread takes every step (no inline steps, or stopping), the next in the queue."""
        with self._cond:
            while True:
                if self._handoff is not None:
                    step, self._handoff = self._handoff, None
                    return step
                if (not self._inline or self._stopping) and not self._busy:
                    if self._pending():
                        break
                    if self._stopping:
                        return None
                self._cond.wait()
            first = self._queue[0]
            if self._delay_s and self._batching and isinstance(first, Attend):
                deadline = first.submitted + self._delay_s
                while (left := deadline - time.perf_counter()) > 0 and self._queued_tokens(
                    first.layer
                ) < self._max_tokens:
                    self._cond.wait(left)
            self._busy = True
            return self._take()

    def _pending(self) -> bool:
        """Whether a job waits (under _cond); drops those whose caller went away before they ran (cancelled,
        or its event loop closed)."""
        while self._queue and _gone(self._queue[0]):
            self._queue.popleft()  # as if it had never come
        return bool(self._queue)

    def _queued_tokens(self, layer: int) -> int:
        return sum(j.tokens for j in self._queue if isinstance(j, Attend) and j.layer == layer)

    def _peek(self) -> list[Job]:
        """The next step (under _cond, with a job pending): the first queued job, and (when it is an Attend
        call and batching is on) every later call of its layer that may join it: within the token budget,
        touching no sequence that a job it would overtake touches, and none that an earlier call of the
        step touches."""
        first = self._queue[0]
        ids = first.touches()
        if not (self._batching and isinstance(first, Attend)) or ids is None:
            return [first]
        step: list[Job] = [first]
        tokens = first.tokens
        blocked = set(ids)
        for i, job in enumerate(self._queue):
            if i == 0:
                continue
            if i >= SCAN_LIMIT:
                break
            touched = job.touches()
            if touched is None:
                break  # a barrier: nothing behind it may overtake it
            if (
                isinstance(job, Attend)
                and job.layer == first.layer
                and tokens + job.tokens <= self._max_tokens
                and blocked.isdisjoint(touched)
                and not _gone(job)
            ):
                step.append(job)
                tokens += job.tokens
            blocked |= touched
        return step

    def _take(self, step: list[Job] | None = None) -> list[Job]:
        """The next step (see _peek; or ``step``, peeked already), taken out of the queue (under _cond, with a
        job pending)."""
        step = step or self._peek()
        if len(step) == 1:
            self._queue.popleft()
        else:
            taken = set(map(id, step))
            self._queue = collections.deque(j for j in self._queue if id(j) not in taken)
        if self._metrics is not None:
            self._metrics.jobs_queued.set(len(self._queue))
            self._metrics.jobs_running.set(len(step))
        return step

    def _step(self, engine: Engine, step: list[Job], runner: str) -> list[Result]:
        """Serve one step (jobs.serve); a call to run again goes first in the queue. An error outside any
        call's own (a bug) fails every job of the step rather than leaving them unanswered."""
        try:
            results, retry, self.stats = jobs.serve(engine, step, self._metrics, runner)
        except Exception as e:
            log.exception("an engine step failed")
            results, retry = [(job, False, e) for job in step], []
        if retry:
            with self._cond:
                self._queue.extendleft(reversed(retry))
        return results


def _gone(job: Job) -> bool:
    """Whether nobody waits for the job any more: its caller was cancelled, or its event loop is closed."""
    return job.future.cancelled() or job.future.get_loop().is_closed()
