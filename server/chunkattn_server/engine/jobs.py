"""What the scheduler queues: a job (a control job, or one Attend call of checked entries), the future its
caller awaits, and how a step's answers get back to the callers' event loops (from whichever thread ran
it). Which jobs make a step is step_queue.py's; serving one is serve.py's; where it runs, scheduler.py's."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from chunkattn_client import work as work_of

if TYPE_CHECKING:  # the step queue reads jobs without loading torch or the engine (tests/server/test_layers.py)
    import torch

    from chunkattn_server.config import ModelShape
    from chunkattn_server.engine.core import Engine
    from chunkattn_server.engine.entries import Entries
    from chunkattn_server.engine.types import BlockCall


@dataclass(eq=False)
class Job:
    """A queued piece of engine work and the future its caller awaits."""

    rpc: str  # the RPC the client called, for the metrics
    future: asyncio.Future[Any]
    submitted: float = field(default_factory=time.perf_counter)
    alone: bool = False  # requeued (the step queue's requeue): runs again in a step of its own

    def touches(self) -> frozenset[tuple[str, str]] | None:
        """The sequences (tenant, seq_id) the job reads or changes; None: possibly any (a barrier)."""
        return None

    def gone(self) -> bool:
        """Whether nobody waits for the job any more: its caller was cancelled, or its event loop closed."""
        return self.future.cancelled() or self.future.get_loop().is_closed()


@dataclass(eq=False, kw_only=True)
class Control(Job):
    """fn(engine), in a step of its own (a barrier: see Job.touches)."""

    fn: Callable[[Engine], Any]


@dataclass(eq=False, kw_only=True)
class LayerCall(Job):
    """An Attend call of one layer, of either kind; tokens: q's rows. Calls of one kind and layer may share
    a step (step_queue.py)."""

    layer: int
    tokens: int
    tenant: str

    def touches(self) -> frozenset[tuple[str, str]]:
        """What the call reads or changes (never None: a call is no barrier)."""
        raise NotImplementedError


@dataclass(eq=False, kw_only=True)
class Attend(LayerCall):
    """A sequence-addressed Attend call: its entries and tensors (see Engine.attend); ending: the ids of its
    sequences to release after it (their entries' ``end_of_sequence``)."""

    entries: Entries
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    ending: frozenset[str] = frozenset()

    @functools.cached_property
    def _ids(self) -> frozenset[tuple[str, str]]:
        return frozenset((self.tenant, e.seq_id) for e in self.entries)

    def touches(self) -> frozenset[tuple[str, str]]:
        """Its sequences (computed once, when a step is chosen: thousands cost milliseconds)."""
        return self._ids


@dataclass(eq=False, kw_only=True)
class AttendBlocks(LayerCall):
    """A block-addressed Attend call (see Engine.attend_blocks)."""

    call: BlockCall

    def touches(self) -> frozenset[tuple[str, str]]:
        """Its space, as a key no sequence has (a tenant name has no NUL): calls to one space keep their
        order and never share a step."""
        return frozenset({("\0space", f"{self.tenant}/{self.call.space_id}")})


Result = tuple[Job, bool, Any]  # a job, whether it succeeded, and its result or exception


def work(model: ModelShape, step: list[Job]) -> float:
    """The step's attention work: query-key pairs (exactly, per entry; at most, per block row) x heads x head
    size; a control job counts as large (exports and imports copy whole blocks)."""
    first = step[0]
    if not isinstance(first, LayerCall):
        return float("inf")
    c = model.layers[first.layer].chunk_size
    pairs = 0.0
    for job in step:
        if isinstance(job, AttendBlocks):  # each row: its queries over its keys (unchecked yet: in floats)
            starts, seq_lens = job.call.starts, job.call.seq_lens
            if len(starts) != len(seq_lens) + 1:
                return float("inf")  # malformed: it fails alone, but never makes its step look small
            q_lens = np.maximum(np.diff(starts), 0).astype(np.float64)
            pairs += float(np.dot(q_lens, np.maximum(seq_lens, 0).astype(np.float64)))
            continue
        assert isinstance(job, Attend)  # a step of calls holds nothing else (step_queue.py)
        pairs += sum(work_of.scores(e.position, e.num_tokens, c) for e in job.entries)
    return float(pairs * model.num_heads * model.head_size)


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
