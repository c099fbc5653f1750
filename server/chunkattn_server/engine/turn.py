"""The turn: what the scheduler's two runners (the engine thread, and on the CPU the event loop: inline.py)
share, so that exactly one step runs at a time. Everything here is read and changed under ``cond``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from chunkattn_server.engine.jobs import Job
from chunkattn_server.engine.step_queue import StepQueue
from chunkattn_server.metrics import Metrics


@dataclass(eq=False)
class Turn:
    """The queue, and who has the turn: ``busy`` while a step runs or is handed to the engine thread
    (``handoff``); ``stopping`` once stop() was called (the engine thread then takes every step)."""

    queue: StepQueue
    metrics: Metrics | None
    cond: threading.Condition = field(default_factory=threading.Condition)
    stopping: bool = False
    busy: bool = False
    handoff: list[Job] | None = None

    def push(self, job: Job) -> None:
        self.queue.push(job)
        if self.metrics is not None:
            self.metrics.jobs_queued.set(len(self.queue))

    def take(self, step: list[Job] | None = None) -> list[Job]:
        """The next step (see StepQueue.take), out of the queue; the turn is now its runner's (busy)."""
        step = self.queue.take(step)
        self.busy = True
        if self.metrics is not None:
            self.metrics.jobs_queued.set(len(self.queue))
            self.metrics.jobs_running.set(len(step))
        return step

    def hand_over(self, step: list[Job]) -> None:
        """Give the engine thread ``step`` (taken already) to run."""
        self.handoff = step
        self.busy = True
        self.cond.notify()
