"""The step queue: the jobs waiting for the engine, and the rules that make the next step of them. Pure:
no threads, no event loops, no locks (the scheduler holds its own around every call).

A step is

- a control job (release, fork, export, import, info ...) alone, in its place in the queue; or
- the first queued job, an Attend call, and (batching on) the later queued calls of its kind (sequence- or
  block-addressed) and layer that may join it: one layer per step, up to ``max_batch_tokens`` tokens.

Rules that keep every call's result what it would be alone:

- the first queued job always goes next (nothing overtakes the oldest job), so nothing starves;
- calls that touch the same sequence (or block space) keep their arrival order and never share a step; a
  control job keeps its order against the calls of the sequences it touches (one that does not say which it
  touches, as every control job today, is a barrier: nothing behind it overtakes it);
- a call that found the pool short while earlier calls of its step held blocks (``requeue``) runs again
  first, ahead of every queued job, in a step of its own, where it sees the pool as it would have alone
  (core.Retry);
- a job whose caller went away before it ran (cancelled, or its event loop closed) is dropped unrun.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from itertools import islice

from chunkattn_server.config import DEFAULT_MAX_BATCH_TOKENS
from chunkattn_server.engine.jobs import Job, LayerCall

SCAN_LIMIT = 1024  # queued jobs one step looks through for calls to merge


class StepQueue:
    """Queued jobs in arrival order; ``take`` removes the next step. ``batching`` False: every job is a
    step of its own."""

    def __init__(
        self, *, batching: bool = True, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, scan_limit: int = SCAN_LIMIT
    ) -> None:
        self.batching = batching
        self.max_batch_tokens = max_batch_tokens
        self.scan_limit = scan_limit
        self._jobs: collections.deque[Job] = collections.deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def push(self, job: Job) -> None:
        """Queue ``job`` last."""
        self._jobs.append(job)

    def requeue(self, jobs: Sequence[Job]) -> None:
        """Put ``jobs`` (calls of a step to run again) first in line, in their order, each to run in a step of
        its own."""
        for job in jobs:
            job.alone = True
        self._jobs.extendleft(reversed(jobs))

    def pending(self) -> bool:
        """Whether a job waits; drops the first ones whose caller went away (as if they had never come)."""
        while self._jobs and self._jobs[0].gone():
            self._jobs.popleft()
        return bool(self._jobs)

    def first(self) -> Job:
        """The first queued job (with one pending)."""
        return self._jobs[0]

    def head(self) -> Iterator[Job]:
        """The jobs a step may be made of: the first ``scan_limit`` queued."""
        return islice(self._jobs, self.scan_limit)

    def queued_tokens(self, layer: int) -> int:
        """The tokens of the queued calls of ``layer``."""
        return sum(j.tokens for j in self._jobs if isinstance(j, LayerCall) and j.layer == layer)

    def peek(self) -> list[Job]:
        """The next step (with a job pending), left in the queue: the first queued job, and when it is an
        Attend call (batching on) every later call of its kind and layer that may join it: within the token budget,
        touching no sequence that a job it would overtake touches, and none that an earlier call of the step
        touches; the scan ends at a barrier or after ``scan_limit`` jobs. A requeued call is a step alone."""
        first = self._jobs[0]
        if not (self.batching and isinstance(first, LayerCall)) or first.alone:
            return [first]
        step: list[Job] = [first]
        tokens = first.tokens
        blocked = set(first.touches())
        for job in islice(self._jobs, 1, self.scan_limit):
            touched = job.touches()
            if touched is None:
                break  # a barrier: nothing behind it may overtake it
            if (
                type(job) is type(first)
                and isinstance(job, LayerCall)
                and job.layer == first.layer
                and tokens + job.tokens <= self.max_batch_tokens
                and blocked.isdisjoint(touched)
                and not job.gone()
            ):
                step.append(job)
                tokens += job.tokens
            blocked |= touched
        return step

    def take(self, step: list[Job] | None = None) -> list[Job]:
        """The next step (``peek``'s; or ``step``, peeked already and the queue unchanged since), out of the
        queue (with a job pending)."""
        step = step or self.peek()
        if len(step) == 1:
            self._jobs.popleft()
            step[0].alone = False  # once: a call requeued later is alone again only if it is requeued again
        else:
            taken = set(map(id, step))
            self._jobs = collections.deque(j for j in self._jobs if id(j) not in taken)
        return step
