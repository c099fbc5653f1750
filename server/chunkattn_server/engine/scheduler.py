"""The scheduler: jobs in, answers out, one engine step at a time.

What makes a step, and in which order jobs run, is the step queue's (step_queue.py: per-sequence order,
control jobs as barriers, one layer and at most ``max_batch_tokens`` tokens per step, a retried call first);
serving a step and its metrics, serve.py's. This module owns submission (typed, checked calls: the queue
never sees a malformed entry), the engine thread, which builds the engine and owns the device, and the
runners: the engine thread, and on the CPU the event loop itself for a small step (inline.py). Who runs the
next step is the turn's (turn.py: one step at a time). Results go back to the callers' event loops once per
step (jobs.hand_back).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import quote
from chunkattn_server.config import DEFAULT_MAX_BATCH_TOKENS
from chunkattn_server.engine import jobs
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.entries import checked
from chunkattn_server.engine.inline import InlineRunner, is_small
from chunkattn_server.engine.jobs import Attend, AttendBlocks, Control, Job
from chunkattn_server.engine.serve import Scales, Steps
from chunkattn_server.engine.step_queue import StepQueue
from chunkattn_server.engine.turn import Turn
from chunkattn_server.engine.types import BlockCall, EngineStats
from chunkattn_server.errors import InvalidBatch
from chunkattn_server.metrics import Metrics

T = TypeVar("T")

# A step whose attention work (query-key pairs x heads x head size) is below this runs on one CPU thread.
# Torch's CPU thread pool (OpenMP) wakes its threads for some ops of even a decode step, and they then
# spin waiting for more: for decode-sized steps one thread serves more calls per second with half the
# CPU. From about this much work on (a 64-token prefill, or one decode over 1,000 keys, is a tie) the
# pool's threads win (docs/results.md, "Other measurements behind design choices").
SERIAL_WORK = 1 << 20


class Scheduler:
    """Runs jobs one step at a time, merging queued Attend calls of one layer into one engine step.

    Two places run steps, never two at once (the turn):

    - the engine thread, which owns the device: it builds the engine, runs every control job and every
      step too large for the event loop, and on CUDA every step;
    - on the CPU, the event loop's own thread runs a small step when the engine thread is idle (inline.py).

    The engine is built on the engine thread, so exactly one thread ever runs torch's parallel CPU
    kernels: when the main thread had built it (and so started an OpenMP team of its own), each call on
    the engine thread ran about twice as slow, the two teams competing for the cores.

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
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_batch_delay_us: int = 0,
        inline: bool = True,
    ) -> None:
        self._metrics = metrics
        self._delay_s = max_batch_delay_us / 1e6
        self._threads = 1  # torch's CPU threads for the current step (set on the engine thread)
        self._turn = Turn(StepQueue(batching=batching, max_batch_tokens=max_batch_tokens), metrics)
        self._inline: InlineRunner | None = None  # set once the engine is built (it depends on its device)
        built: concurrent.futures.Future[Steps] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(build, built), name="chunkattn-engine", daemon=True)
        self._thread.start()
        self._steps = built.result()
        self.engine = self._steps.engine
        with self._turn.cond:
            if inline and not self._delay_s and self.engine.device.type == "cpu":
                self._inline = InlineRunner(self._turn, self._steps)
                self._turn.allow_inline(functools.partial(is_small, self.engine.config.model))

    @property
    def stats(self) -> EngineStats:
        """The pool and sequences after the last step, for readers that must not queue behind the jobs (Info):
        one step's state or the next one's (Steps)."""
        return self._steps.stats

    @property
    def kv_scales(self) -> Scales:
        """Per layer, its KV scales after the last step (Engine.scales_now), taken on the thread that ran it:
        what Info reports, read without queueing behind the jobs."""
        return self._steps.kv_scales

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
        here = False
        with self._turn.cond:
            if self._turn.submit(job):
                assert self._inline is not None
                loop = job.future.get_loop()
                here = self._inline.may_run_here(loop)
                if not here:
                    self._inline.wake(loop)
        if here:  # nothing else was ready on this loop: the step runs now, and the answer is there to take
            assert self._inline is not None
            self._inline.run_here()
        return await job.future

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        with self._turn.cond:
            self._turn.stop()
        self._thread.join()

    # -- the engine thread ----------------------------------------------------------------------------

    def _main(self, build: Callable[[], Engine], built: concurrent.futures.Future[Steps]) -> None:
        try:
            steps = Steps(build(), self._metrics)  # its first snapshot taken here, on the engine thread
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(steps)
        torch.set_grad_enabled(False)  # this thread's mode: the engine never takes part in autograd
        engine = steps.engine
        pool = self._threads = torch.get_num_threads()
        turn = self._turn
        while True:
            with turn.cond:
                step = turn.engine_next(self._delay_s)
            if step is None:
                return
            if engine.device.type == "cpu" and pool > 1:
                self._use_threads(1 if jobs.work(engine.config.model, step) < SERIAL_WORK else pool)
            results, retry = steps.run(step, "engine_thread")
            with turn.cond:
                # A small next step is the event loop's, which gets the turn with these results (the same
                # loop's callbacks run in order); a large one is this thread's next.
                if turn.engine_done(retry):
                    assert self._inline is not None
                    jobs.hand_back(results)
                    self._inline.wake_all(turn.queue.head())
                    continue
            jobs.hand_back(results)

    def _use_threads(self, n: int) -> None:
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n
