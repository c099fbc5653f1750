"""The inline runner: on the CPU, the event loop's own thread runs a *small* step (attention work under
INLINE_WORK, as a batch of decodes) when the engine thread is idle, and hands a larger one to the engine
thread. Handing a small step to another thread and back cost more than the step: two wake-ups, and the two
threads taking the GIL from each other around every torch op (each releases it), which nearly doubled the
server's CPU per decode call on two cores. Small steps run on one torch thread there (no OpenMP team on
the loop's thread) and with autograd off.

A step waits behind the loop's other ready callbacks (``_drain``), so that calls on their way join it; a call
submitted while nothing else is ready on its loop runs its step at once instead (``run_here``), and its answer is
there when it awaits it: two turns of the loop fewer at one request, where nothing could have joined."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import torch

from chunkattn_server.config import ModelShape
from chunkattn_server.engine import jobs
from chunkattn_server.engine.jobs import Job, LayerCall
from chunkattn_server.engine.serve import Steps
from chunkattn_server.engine.turn import Turn

# How many turns of the event loop a step on it may wait behind other ready callbacks (see _drain).
MAX_DEFERRALS = 32

# A step at most this large (attention work, query-key pairs x heads x head size, and tokens) may run on the
# event loop's thread: a few milliseconds of work at most, as long as a large request's parse, so the loop
# stays responsive; larger steps, prefills mostly, go to the engine thread.
INLINE_WORK = 1 << 23
INLINE_TOKENS = 256


def is_small(model: ModelShape, step: list[Job]) -> bool:
    """Whether an event loop may run ``step`` itself (see INLINE_WORK)."""
    return sum(j.tokens for j in step if isinstance(j, LayerCall)) <= INLINE_TOKENS and (
        jobs.work(model, step) < INLINE_WORK
    )


class InlineRunner:
    """Runs small steps (the turn's ``take_on_loop``) on the event loops whose calls are queued, through
    ``steps``; shares the turn with the engine thread."""

    def __init__(self, turn: Turn, steps: Steps) -> None:
        self._turn = turn
        self._steps = steps
        self._loops: set[asyncio.AbstractEventLoop] = set()  # where a drain is pending (under turn.cond)

    def wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """(Under turn.cond.) Have ``loop`` look at the queue soon, once. Soon, not now: the calls that arrive
        in this turn of the loop join the step. Each loop gets its own drain, so that a loop that is not
        running holds up nobody else's calls."""
        if loop in self._loops:
            return
        try:
            if asyncio.get_running_loop() is loop:
                loop.call_soon(self._drain)
                self._loops.add(loop)
                return
        except RuntimeError:  # no loop runs on this thread (the engine thread's case)
            pass
        with contextlib.suppress(RuntimeError):  # a closed loop: its jobs count as gone (Job.gone)
            loop.call_soon_threadsafe(self._drain)
            self._loops.add(loop)

    def wake_all(self, queued: Iterable[Job]) -> None:
        """(Under turn.cond.) The turn goes to the loops of these queued jobs."""
        for loop in {job.future.get_loop() for job in queued}:
            self.wake(loop)

    def may_run_here(self, loop: asyncio.AbstractEventLoop) -> bool:
        """(Under turn.cond, right after a submission that found the turn FREE.) Whether the submitting call may run
        the step at once on ``loop`` (``run_here``) instead of waking it: ``loop`` is the running loop, no drain is
        pending on it, and it has no other callback ready (so no other call is on its way to join the step; a
        loop whose ready callbacks cannot be read is woken instead). Saves the two turns of the loop (the drain's,
        and the caller's wake-up) that a decode-sized call at one request otherwise waits for."""
        if loop in self._loops or getattr(loop, "_ready", True):
            return False
        try:
            return asyncio.get_running_loop() is loop
        except RuntimeError:
            return False

    def run_here(self) -> None:
        """On the running loop, after ``may_run_here``: the next step now, as a drain would run it (not deferred:
        nothing else was ready)."""
        self._drain(MAX_DEFERRALS)

    def _drain(self, deferred: int = 0) -> None:
        """On an event loop: the next step, run here when it is small, else handed to the engine thread."""
        loop = asyncio.get_running_loop()
        turn = self._turn
        with turn.cond:
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
        with turn.cond:
            if not self._runnable(loop):
                return
            self._loops.discard(loop)
            step = turn.take_on_loop()
            if step is None:  # too large: the engine thread's now
                return
        threads = torch.get_num_threads()  # this thread's only, put back after: no OpenMP team on the loop's
        if threads != 1:
            torch.set_num_threads(1)
        grad = torch.is_grad_enabled()  # off for the step (as on the engine thread), put back after
        if grad:
            torch.set_grad_enabled(False)
        retry: list[Job] = []
        try:
            results, retry = self._steps.run(step, "event_loop")
        finally:
            if grad:
                torch.set_grad_enabled(True)
            if threads != 1:
                torch.set_num_threads(threads)
            with turn.cond:
                if turn.loop_done(retry):
                    self.wake(loop)
        jobs.deliver(results)

    def _runnable(self, loop: asyncio.AbstractEventLoop) -> bool:
        """(Under turn.cond.) Whether ``loop``'s pending drain may take a step now; if not, the drain is over
        (the engine thread gives the turn back when it is done, and stop() leaves the rest to it)."""
        if self._turn.loop_may_take():
            return True
        self._loops.discard(loop)
        return False
