"""A serving engine's scheduler, as vLLM's v1 ``Scheduler.schedule`` decides a step (no I/O, no clock):

- a step has a token budget (``max_num_batched_tokens``); the running requests go first, in the order they
  were admitted, each taking what it still has to compute (its prompt's rest, chunked to the budget left, or one
  token to decode); then waiting requests are admitted first come first served while the budget lasts and fewer
  than ``max_num_seqs`` hold a seat, each prefilling as much of its prompt as the budget leaves (chunked prefill);
- blocks are allocated as a request is scheduled (``KVBlocks.allocate``); when a running request finds too few,
  the request admitted last is preempted (its blocks freed, back to the front of the queue, to be recomputed
  from its first token, its prompt and the tokens it had generated) until it fits, and no waiting request is
  admitted that step; a waiting request is admitted only when the blocks of its whole sequence are free (vLLM's
  scheduler_reserve_full_isl, its default; a chunked group's capped at its chunk and the tokens in flight,
  ``KVBlocks.blocks_for``), else it waits;
- a request samples a token in each step that computes its last known token (the step that ends its prompt
  gives its first output token), and finishes when it has ``output_len`` of them (its blocks freed).

A request of P prompt tokens and O output tokens is P + O - 1 tokens of forward passes.

With ``async_scheduling`` (vLLM's default on GPUs: its ``AsyncScheduler`` and the engine core's batch queue of
two; vLLM's CPU platform turns it off), vLLM schedules step N + 1 before it has processed step N's sampled tokens,
and frees a finished request only when it processes them. So a request that finished in step N is skipped in
step N + 1 (vLLM knows it reached its max_tokens) but still holds its seat and its blocks while N + 1 is
scheduled, and leaves right after (``leaving``; ``finish`` returns it at step N's end all the same, when its last
token was made). Where they leave a step N + 1 with nothing to run, vLLM schedules that step empty and then
processes step N: ``schedule`` does the same in one call, trying again once they left (an empty step is never
returned while anything can run). Preemption takes the request admitted last among those holding a seat, as
vLLM's running list keeps them: a finished one just leaves early (its blocks freed; it is not re-queued, as vLLM
drops it from its queue when its last token is processed), and counts as a preemption for the step's admissions
(none that step) but is not in ``preempted``. When nothing else is left to run, ``finish`` frees the finished at
once (vLLM's next step would be empty). A caller that stops scheduling calls ``drain`` before freeing the rest.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from chunkattn_client.bench.kvblocks import KVBlocks


@dataclass(eq=False)
class Request:
    """One request: ``prompt_len`` tokens in, ``output_len`` >= 1 tokens out; the scheduler's state of it."""

    id: int
    prompt_len: int
    output_len: int
    arrived: float = 0.0
    computed: int = 0  # tokens whose K/V are in the cache
    generated: int = 0  # output tokens sampled
    preemptions: int = 0
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    admitted: int = 0  # the scheduler's count of admissions when it was last admitted: its place among the seated
    in_flight: int = 0  # async scheduling: its tokens of the step in flight (computed, not yet processed)

    @property
    def tokens(self) -> int:
        """The tokens it has: its prompt and what it generated."""
        return self.prompt_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len


@dataclass(frozen=True)
class Scheduled:
    """One request's part of a step: ``num_tokens`` new tokens from ``position``."""

    request: Request
    position: int
    num_tokens: int

    @property
    def decode(self) -> bool:
        """One token past the prompt: a decode; anything else (a prompt's chunk, a preempted request's
        recomputation) is a prefill."""
        return self.num_tokens == 1 and self.position >= self.request.prompt_len


class Scheduler:
    """vLLM's scheduling of one engine's requests over ``blocks`` (module doc), synchronous or asynchronous."""

    def __init__(
        self, blocks: KVBlocks, max_num_batched_tokens: int, max_num_seqs: int, async_scheduling: bool = False
    ) -> None:
        self.blocks = blocks
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.async_scheduling = async_scheduling
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, with tokens left to compute, in the order admitted
        self.leaving: list[Request] = []  # finished in the last step, seats and blocks held (async scheduling)
        self.preempted: list[Request] = []  # by the last step
        self.arriving: list[Request] = []  # added since the last step was scheduled (async scheduling)
        self._admissions = 0
        # vLLM's max_in_flight_tokens: its budget times the steps in flight (two with async scheduling).
        self.in_flight_tokens = max_num_batched_tokens * (2 if async_scheduling else 1)

    def add(self, request: Request) -> None:
        """A new request. With async scheduling it arrives while the next step is already scheduled (vLLM
        schedules step N + 1 before the output of step N, which a closed-loop user waits for, is out), so it
        waits from the step after."""
        (self.arriving if self.async_scheduling else self.waiting).append(request)

    @property
    def idle(self) -> bool:
        """Nothing to run: none waiting or arriving, none running (those ``leaving`` have nothing left to run)."""
        return not self.waiting and not self.running and not self.arriving

    @property
    def requests(self) -> int:
        """Requests in the engine that a user still waits for: waiting, arriving or running."""
        return len(self.waiting) + len(self.arriving) + len(self.running)

    def schedule(self) -> list[Scheduled]:
        """The next step: which requests compute which tokens (empty when nothing can run)."""
        self.preempted = []
        step = self._schedule()
        if self.leaving or self.arriving:  # async: the last step's output is processed now, and the new requests
            self.drain()
            self.waiting.extend(self.arriving)
            self.arriving.clear()
            if not step:  # vLLM's step was empty: the one after it
                step = self._schedule()
        return step

    def drain(self) -> None:
        """The requests ``leaving`` leave now, their blocks freed."""
        for request in self.leaving:
            self.blocks.free(request)
        self.leaving.clear()

    def _schedule(self) -> list[Scheduled]:
        budget = self.budget
        out: list[Scheduled] = []
        preempting = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.tokens - request.computed, budget)
            while not self.blocks.allocate(request, request.computed, n, request.computed - request.in_flight):
                preempting = True
                if self.leaving and self.leaving[-1].admitted > self.running[-1].admitted:
                    self.blocks.free(self.leaving.pop())  # finished: it leaves early
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                if victim is request:
                    break
            else:
                out.append(Scheduled(request, request.computed, n))
                budget -= n
                i += 1
        while (
            not preempting and self.waiting and budget > 0 and len(self.running) + len(self.leaving) < self.max_num_seqs
        ):
            request = self.waiting[0]
            n = min(request.tokens - request.computed, budget)
            if not self.blocks.admits(request.tokens, self.in_flight_tokens):
                break  # vLLM admits a request only when its whole sequence fits
            if not self.blocks.allocate(request, request.computed, n):
                break
            self.waiting.popleft()
            self._admissions += 1
            request.admitted = self._admissions
            self.running.append(request)
            out.append(Scheduled(request, request.computed, n))
            budget -= n
        for request in self.running:  # async: what this step computes is in flight while the next is scheduled
            request.in_flight = 0
        for s in out:
            s.request.computed += s.num_tokens
            s.request.in_flight = s.num_tokens if self.async_scheduling else 0
        return out

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request)
        request.computed = 0
        request.in_flight = 0
        request.preemptions += 1
        self.waiting.appendleft(request)
        self.preempted.append(request)

    def finish(self, step: list[Scheduled], now: float = 0.0) -> list[Request]:
        """The step ran (at ``now``): each request that computed its last known token samples one; those done
        leave (their blocks freed; with async scheduling, once the next step is scheduled). Returns the finished
        requests."""
        finished = []
        for s in step:
            request = s.request
            if request.computed < request.tokens:
                continue  # a prefill chunk that did not reach the prompt's end
            request.generated += 1
            request.token_times.append(now)
            if request.first_token_at is None:
                request.first_token_at = now
            if request.done:
                self.running.remove(request)
                self.leaving.append(request)
                finished.append(request)
        if not self.async_scheduling or self.idle:
            self.drain()
        return finished
