"""The scheduler: jobs in, answers out, one engine step at a time.

What makes a step, and in which order jobs run, is the step queue's (step_queue.py: per-sequence order,
control jobs as barriers, one layer and at most ``max_batch_tokens`` tokens per step, a retried call first);
serving a step and its metrics, serve.py's. This module owns submission (typed, checked calls: the queue
never sees a malformed entry), the engine thread, which builds the engine and owns the device, and the
choice of runner for each step: the engine thread, or on the CPU the event loop itself for a small step
(inline.py). They share the turn (turn.py): one step runs at a time. Results go back to the callers' event
loops once per step (jobs.hand_back).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import quote
from chunkattn_server.engine import jobs
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.entries import checked
from chunkattn_server.engine.inline import InlineRunner
from chunkattn_server.engine.jobs import Attend, AttendBlocks, Control, Job, LayerCall, Result
from chunkattn_server.engine.serve import serve
from chunkattn_server.engine.step_queue import StepQueue
from chunkattn_server.engine.turn import Turn
from chunkattn_server.engine.types import BlockCall, EngineStats
from chunkattn_server.errors import InvalidBatch
from chunkattn_server.metrics import Metrics

T = TypeVar("T")
log = logging.getLogger(__name__)

# A step whose attention work (query-key pairs x heads x head size) is below this runs on one CPU thread.
# Torch's CPU thread pool (OpenMP) wakes its threads for some ops of even a decode step, and they then
# spin waiting for more: for decode-sized steps one thread serves more calls per second with half the
# CPU. From about this much work on (a 64-token prefill, or one decode over 1,000 keys, is a tie) the
# pool's threads win (docs/results.md, "Other measurements behind design choices").
SERIAL_WORK = 1 << 20

# A step at most this large (attention work as above, and tokens) may run on the event loop's thread
# (inline.py): a few milliseconds of work at most, as long as a large request's parse, so the loop stays
# responsive; larger steps, prefills mostly, go to the engine thread.
INLINE_WORK = 1 << 23
INLINE_TOKENS = 256


class Scheduler:
    """Runs jobs one step at a time, merging queued Attend calls of one layer into one engine step.

    Two places run steps, never two at once (the turn):

    - the engine thread, which owns the device: it builds the engine, runs every control job and every
      step too large for the event loop, and on CUDA every step;
    - on the CPU, the event loop's own thread runs a small step when the engine thread is idle (inline.py).

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
        self._delay_s = max_batch_delay_us / 1e6
        self._threads = 1  # torch's CPU threads for the current step (set on the engine thread)
        self._turn = Turn(StepQueue(batching=batching, max_batch_tokens=max_batch_tokens), metrics)
        self._inline: InlineRunner | None = None  # set once the engine is built (it depends on its device)
        built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(build, built), name="chunkattn-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()
        with self._turn.cond:
            if inline and not self._delay_s and self.engine.device.type == "cpu":
                self._inline = InlineRunner(self._turn, self._small, lambda step, runner: self._step(step, runner))
        # The pool and sequences after the last step, for readers that must not queue behind the jobs (Info):
        # replaced whole after each step, so a reader sees one step's state or the next one's.
        self.stats: EngineStats = self.engine.stats()

    # -- the event loop's side ------------------------------------------------------------------------

    async def run(self, rpc: str, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread, in a step of its own, and return (or raise) what it does. A
        barrier: it runs after every job queued before it and before every one queued after."""
        result: T = await self._submit(Control(rpc, asyncio.get_running_loop().create_future(), fn=fn))
        return result

    async def attend(
        self,
        rpc: str,
        layer: int,
        entries: Sequence[BatchEntry],
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        *,
        tenant: str,
        ending: Iterable[str] = frozenset(),
    ) -> torch.Tensor:
        """One Attend call of ``tenant`` (see Engine.attend), merged with other queued calls of its layer
        where the rules allow; the sequences named in ``ending`` (its entries' end_of_sequence) are released
        after it. Returns its output, a contiguous tensor in host memory. Raises the EngineError it would
        raise alone; UnknownLayer or InvalidBatch before anything is queued when its layer does not exist,
        its entries are malformed (``Entries`` are checked already) or ``ending`` names a sequence the call
        has not."""
        self.engine.config.model.spec(layer)  # UnknownLayer first, as the engine would raise it
        entries = checked(entries)
        ending = ending if isinstance(ending, frozenset) else frozenset(ending)
        if ending and not ending <= {e.seq_id for e in entries}:
            stray = sorted(ending - {e.seq_id for e in entries})
            raise InvalidBatch(f"end_of_sequence names {quote(stray[0])}, which is not one of the call's sequences")
        tokens = int(q.shape[0]) if q.dim() else 0  # the call's tokens, when it is well formed (else it fails alone)
        future = asyncio.get_running_loop().create_future()
        job = Attend(
            rpc, future, layer=layer, entries=entries, q=q, k=k, v=v, tokens=tokens, tenant=tenant, ending=ending
        )
        result: torch.Tensor = await self._submit(job)
        return result

    async def attend_blocks(self, rpc: str, layer: int, call: BlockCall) -> torch.Tensor:
        """One block-addressed Attend call (see Engine.attend_blocks), merged with other queued ones of its
        layer where the rules allow. Returns its output, a contiguous tensor in host memory; raises the
        EngineError it would raise alone (UnknownLayer before anything is queued)."""
        self.engine.config.model.spec(layer)
        tokens = int(call.q.shape[0]) if call.q.dim() else 0
        future = asyncio.get_running_loop().create_future()
        job = AttendBlocks(rpc, future, layer=layer, call=call, tokens=tokens, tenant=call.tenant)
        result: torch.Tensor = await self._submit(job)
        return result

    async def _submit(self, job: Job) -> Any:
        turn = self._turn
        with turn.cond:
            if turn.stopping:
                raise RuntimeError("the scheduler has stopped")
            turn.push(job)
            if self._inline is None:
                turn.cond.notify()  # the engine thread takes every step
            elif not turn.busy:
                self._inline.wake(job.future.get_loop())
        return await job.future

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        with self._turn.cond:
            self._turn.stopping = True
            self._turn.cond.notify()
        self._thread.join()

    # -- the engine thread ----------------------------------------------------------------------------

    def _main(self, build: Callable[[], Engine], built: concurrent.futures.Future[Engine]) -> None:
        try:
            engine = build()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(engine)
        torch.set_grad_enabled(False)  # this thread's mode: the engine never takes part in autograd
        pool = self._threads = torch.get_num_threads()
        turn = self._turn
        while (step := self._next_step()) is not None:
            if engine.device.type == "cpu" and pool > 1:
                self._use_threads(1 if jobs.work(engine.config.model, step) < SERIAL_WORK else pool)
            results = self._step(step, "engine_thread")
            with turn.cond:
                turn.busy = False
                # Go on with a large next step; a small one is the event loop's, which gets the turn with
                # these results (the same loop's callbacks run in order).
                if self._inline is not None and not turn.stopping and turn.queue.pending():
                    nxt = turn.queue.peek()
                    if self._small(nxt):
                        jobs.hand_back(results)
                        self._inline.wake_all(turn.queue.head())
                        continue
                    turn.handoff = turn.take(nxt)
            jobs.hand_back(results)

    def _next_step(self) -> list[Job] | None:
        """The engine thread's next step (None: stopped and nothing left): one the event loop handed over,
        or, when the engine thread takes every step (no inline steps, or stopping), the next in the queue."""
        turn = self._turn
        with turn.cond:
            while True:
                if turn.handoff is not None:
                    step, turn.handoff = turn.handoff, None
                    return step
                if (self._inline is None or turn.stopping) and not turn.busy:
                    if turn.queue.pending():
                        break
                    if turn.stopping:
                        return None
                turn.cond.wait()
            first = turn.queue.first()
            if self._delay_s and turn.queue.batching and isinstance(first, LayerCall):
                deadline = first.submitted + self._delay_s
                while (left := deadline - time.perf_counter()) > 0 and turn.queue.queued_tokens(
                    first.layer
                ) < turn.queue.max_batch_tokens:
                    turn.cond.wait(left)
            return turn.take()

    def _use_threads(self, n: int) -> None:
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    # -- either runner --------------------------------------------------------------------------------

    def _small(self, step: list[Job]) -> bool:
        """Whether the event loop may run the step itself (see INLINE_WORK)."""
        return sum(j.tokens for j in step if isinstance(j, LayerCall)) <= INLINE_TOKENS and (
            jobs.work(self.engine.config.model, step) < INLINE_WORK
        )

    def _step(self, step: list[Job], runner: str) -> list[Result]:
        """Serve one step (serve.serve); a call to run again goes first in the queue. An error outside any
        call's own (a bug) fails every job of the step rather than leaving them unanswered."""
        try:
            results, retry, self.stats = serve(self.engine, step, self._metrics, runner)
        except Exception as e:
            log.exception("an engine step failed")
            results, retry = [(job, False, e) for job in step], []
        if retry:
            with self._turn.cond:
                self._turn.queue.requeue(retry)
        return results
