"""The turn: who runs the next step. The scheduler's two runners, the engine thread and (on the CPU) the event
loops (inline.py), share the step queue; exactly one step runs at a time. Every change of the turn's state is
one of the methods below, each called under ``cond``; the runners act on what they return (wake a loop, run a
step), nothing else writes here.

States and transitions::

    FREE    --take_on_loop (a small step)---------------------->  LOOP    --loop_done-->  FREE
    FREE    --take_on_loop (a large step)---------------------->  HANDED  --engine_next-->  ENGINE
    FREE    --engine_next (no inline steps, or stopping)------->  ENGINE
    ENGINE  --engine_done (inline steps, the next step large)-->  HANDED
    ENGINE  --engine_done (otherwise)-------------------------->  FREE  (a small next step: the loops are woken)

- FREE: no step runs (``busy`` False). A submitted job wakes an event loop (inline steps) or the engine
  thread (none: it takes every step).
- LOOP: an event loop runs a small step (``busy``).
- HANDED: an event loop took a step too large for it and handed it to the engine thread (``handoff``).
- ENGINE: the engine thread runs a step (``busy``). When it is done it goes on with the next step while that
  is large (HANDED again, to itself), and gives the turn back to the loops when it is small.

``stopping`` (``stop``) is set once and never cleared: no job is submitted after it, and the engine thread
takes every step left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from chunkattn_server.engine.jobs import Job, LayerCall
from chunkattn_server.engine.step_queue import StepQueue
from chunkattn_server.metrics import Metrics

Small = Callable[[list[Job]], bool]


class Turn:
    """The step queue and who has the turn (see the module docstring). Until ``allow_inline`` the engine thread
    runs every step."""

    def __init__(self, queue: StepQueue, metrics: Metrics | None) -> None:
        self.queue = queue
        self.cond = threading.Condition()
        self._small: Small | None = None
        self._stopping = False
        self._busy = False
        self._handoff: list[Job] | None = None
        self.running = 0  # jobs in the step that runs now (0: none runs)
        if metrics is not None:  # read at scrape time: nothing to set per call
            metrics.watch_jobs(lambda: len(self.queue), lambda: self.running)

    def allow_inline(self, small: Small) -> None:
        """From now on the event loops run the steps ``small(step)`` accepts (set once, before any job is
        submitted)."""
        self._small = small

    # -- the event loops' side ----------------------------------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Queue ``job``; True when the caller's event loop should look at the queue (inline steps, and the turn
        is FREE). With no inline steps the engine thread is woken. RuntimeError once stopping."""
        if self._stopping:
            raise RuntimeError("the scheduler has stopped")
        self.queue.push(job)
        if self._small is None:
            self.cond.notify()
            return False
        return not self._busy

    def loop_may_take(self) -> bool:
        """Whether an event loop may take the next step now: the turn is FREE, not stopping, a job waits."""
        return not (self._busy or self._stopping) and self.queue.pending()

    def take_on_loop(self) -> list[Job] | None:
        """FREE -> LOOP: the next step, for the event loop to run; or FREE -> HANDED: None, the step being too
        large for the loop (handed to the engine thread). With ``loop_may_take()``."""
        assert self._small is not None
        step = self._take()
        if self._small(step):
            return step
        self._handoff = step
        self.cond.notify()
        return None

    def loop_done(self, retry: Sequence[Job]) -> bool:
        """LOOP -> FREE, ``retry`` (the step's calls to run again) first in the queue. True when the loop
        should look at the queue again (a job waits and not stopping); when stopping, the engine thread is
        told to take the rest."""
        self._requeue(retry)
        self._busy = False
        self.running = 0
        if self._stopping:
            self.cond.notify()
            return False
        return self.queue.pending()

    # -- the engine thread's side -------------------------------------------------------------------------

    def engine_next(self, delay_s: float) -> list[Job] | None:
        """HANDED -> ENGINE, or (no inline steps, or stopping) FREE -> ENGINE: the engine thread's next step,
        waited for; None once stopping and nothing is left. A step taken from the queue whose first job is an
        Attend call waits up to ``delay_s`` after that call arrived for more calls of its layer (until they
        fill a step)."""
        while True:
            if self._handoff is not None:
                step, self._handoff = self._handoff, None
                return step
            if (self._small is None or self._stopping) and not self._busy:
                if self.queue.pending():
                    break
                if self._stopping:
                    return None
            self.cond.wait()
        first = self.queue.first()
        if delay_s and self.queue.batching and isinstance(first, LayerCall):
            deadline = first.submitted + delay_s
            while (left := deadline - time.perf_counter()) > 0 and self.queue.queued_tokens(
                first.layer
            ) < self.queue.max_batch_tokens:
                self.cond.wait(left)
        return self._take()

    def engine_done(self, retry: Sequence[Job]) -> bool:
        """ENGINE -> FREE or HANDED, ``retry`` first in the queue. With inline steps, not stopping and a job
        waiting: a large next step is taken for the engine thread itself (HANDED: engine_next returns it); a
        small one is the event loops': True, the caller wakes them (FREE)."""
        self._requeue(retry)
        self._busy = False
        self.running = 0
        if self._small is None or self._stopping or not self.queue.pending():
            return False
        step = self.queue.peek()
        if self._small(step):
            return True
        self._handoff = self._take(step)
        return False

    def stop(self) -> None:
        """Stopping from now on: no more jobs; the engine thread takes every step left, then ends."""
        self._stopping = True
        self.cond.notify()

    # -- helpers --------------------------------------------------------------------------------------------

    def _take(self, step: list[Job] | None = None) -> list[Job]:
        """The next step (StepQueue.take), out of the queue; the turn is now its runner's (busy)."""
        step = self.queue.take(step)
        self._busy = True
        self.running = len(step)
        return step

    def _requeue(self, retry: Sequence[Job]) -> None:
        if retry:
            self.queue.requeue(retry)
