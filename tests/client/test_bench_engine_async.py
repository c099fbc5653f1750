"""The engine workload's scheduler under vLLM's async scheduling (``Scheduler(..., async_scheduling=True)``,
bench/scheduler.py's module doc), without a server: a request that finished in step N holds its seat and its
blocks while step N + 1 is scheduled. Worked by hand on small cases; over random workloads (small pools, so with
preemption), test_bench_engine_sched.py's invariants, and the same steps as a transcription of vLLM's own
structure (one running list that keeps its finished requests until their step's output is processed)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkattn_client.bench.kvblocks import KVBlocks
from chunkattn_client.bench.scheduler import Request, Scheduled, Scheduler
from tests.client.test_bench_engine_sched import _a_good_step, _step_reads_its_chunks, workloads

Step = list[tuple[int, int, int]]  # (request, position, tokens)


def _ids(step: list[Scheduled]) -> Step:
    return [(s.request.id, s.position, s.num_tokens) for s in step]


def _run(sched: Scheduler, requests: list[Request]) -> list[Step]:
    """Every request queued at once, the steps until none is left."""
    for r in requests:
        sched.add(r)
    steps = []
    while not sched.idle:
        step = sched.schedule()
        assert step
        steps.append(_ids(step))
        sched.finish(step)
    return steps


def test_a_finished_request_holds_its_seat_one_step() -> None:
    """max_num_seqs 2: A (2 tokens out) and B (4) run; A finishes in step 1, so C (1 out) waits. Synchronous, C
    starts in step 2; asynchronous, step 2 is scheduled before A's last token is processed: A holds its seat and
    its blocks through it, and C starts in step 3. finish() reports A at step 1's end all the same."""

    def requests() -> list[Request]:
        return [Request(0, 4, 2), Request(1, 4, 4), Request(2, 4, 1)]

    sync = _run(Scheduler(KVBlocks([0], [None], 64, 4), 64, 2), requests())
    assert sync == [[(0, 0, 4), (1, 0, 4)], [(0, 4, 1), (1, 4, 1)], [(1, 5, 1), (2, 0, 4)], [(1, 6, 1)]]

    blocks = KVBlocks([0], [None], 64, 4)
    sched = Scheduler(blocks, 64, 2, async_scheduling=True)
    a, b, c = requests()
    for r in (a, b, c):
        sched.add(r)
    sched.finish(sched.schedule(), now=1.0)
    step = sched.schedule()
    assert _ids(step) == [(0, 4, 1), (1, 4, 1)]
    assert sched.finish(step, now=2.0) == [a]
    assert a.token_times == [1.0, 2.0]
    assert (sched.idle, sched.leaving) == (False, [a])  # A still holds its seat and blocks
    assert a not in sched.running
    assert a in blocks._tables
    step = sched.schedule()
    assert _ids(step) == [(1, 5, 1)]  # A skipped, its seat held: C waits
    assert sched.leaving == []
    assert a not in blocks._tables
    sched.finish(step)
    step = sched.schedule()
    assert _ids(step) == [(1, 6, 1), (2, 0, 4)]
    assert sched.finish(step) == [b, c]
    assert sched.idle  # nothing else to run: the finished left at once
    assert not sched.leaving
    assert blocks.free_blocks == 63


def test_an_empty_step_is_scheduled_again_once_the_finished_left() -> None:
    """max_num_seqs 1: A finishes in step 0 and holds the only seat, so vLLM's step 1 is empty and B starts in
    the step after; ``schedule`` does both in one call, never returning an empty step while B can run."""
    blocks = KVBlocks([0], [None], 64, 4)
    sched = Scheduler(blocks, 64, 1, async_scheduling=True)
    a, b = Request(0, 4, 1), Request(1, 6, 1)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert sched.finish(step) == [a]
    assert sched.leaving == [a]
    assert _ids(sched.schedule()) == [(1, 0, 6)]
    assert sched.leaving == []
    assert not sched.preempted


def test_a_finished_request_admitted_last_is_the_preemption_victim_and_just_leaves() -> None:
    """A pool of 2 blocks of 4 tokens. B (admitted first, 3 tokens out) needs a second block in step 1 while A
    (admitted last, 1 out, finished in step 0) still holds its block: vLLM preempts the last of its running list,
    A, which frees its block and is dropped once its last token is processed; here A leaves early, is not
    re-queued and is not among ``preempted``."""
    blocks = KVBlocks([0], [None], 1 + 2, 4)
    sched = Scheduler(blocks, 64, 4, async_scheduling=True)
    b, a = Request(0, 4, 3), Request(1, 4, 1)
    sched.add(b)
    sched.add(a)
    assert sched.finish(sched.schedule()) == [a]
    step = sched.schedule()
    assert _ids(step) == [(0, 4, 1)]
    assert not sched.preempted
    assert not sched.waiting
    assert a not in blocks._tables
    sched.finish(step)
    assert _ids(sched.schedule()) == [(0, 5, 1)]
    assert b.preemptions == 0


def test_a_finished_request_admitted_first_makes_the_last_admitted_preempt_itself() -> None:
    """The same pool with A admitted first: B is the last of vLLM's running list, so B preempts itself (A's
    block still held), the step is empty, A leaves, and B is recomputed (its prompt and its first token) in the
    step after; synchronous, A would have left and B gone on."""

    def run(async_scheduling: bool) -> tuple[list[Step], int]:
        blocks = KVBlocks([0], [None], 1 + 2, 4)
        sched = Scheduler(blocks, 64, 4, async_scheduling=async_scheduling)
        a, b = Request(0, 4, 1), Request(1, 4, 3)
        sched.add(a)
        sched.add(b)
        steps, preempted = [], []
        while not sched.idle:
            step = sched.schedule()
            preempted += sched.preempted
            steps.append(_ids(step))
            sched.finish(step)
        assert preempted == [b] * b.preemptions
        assert blocks.free_blocks == 2
        return steps, b.preemptions

    assert run(False) == ([[(0, 0, 4), (1, 0, 4)], [(1, 4, 1)], [(1, 5, 1)]], 0)
    assert run(True) == ([[(0, 0, 4), (1, 0, 4)], [(1, 0, 5)], [(1, 5, 1)]], 1)


def _small_pool(w: dict[str, Any]) -> dict[str, Any]:
    return {**w, "spare": w["spare"] % 4}  # 0 to 3 blocks over what the longest request needs alone


small_pools = workloads.map(_small_pool)


@settings(max_examples=150, deadline=None)
@given(st.one_of(workloads, small_pools))
def test_async_scheduling_plays_by_vllms_rules(w: dict[str, Any]) -> None:
    """test_bench_engine_sched.py's invariants (budget, seats, positions, each row reading its own request's
    chunk, no block held twice, every request run to its end and every block back), with requests arriving as the
    engine runs; and a request that finished holds its blocks until the next step is scheduled, in which it is
    not, and ``schedule`` returns an empty step only when nothing is left to run."""
    chunks, bs = w["chunks"], w["block_size"]
    probe = KVBlocks(chunks, [None] * len(chunks), 2, bs)
    longest = max(p + o for p, o in w["lengths"])
    num_blocks = probe.blocks_for(longest, 2 * w["budget"]) + 1 + w["spare"]  # two steps in flight
    blocks = KVBlocks(chunks, [None] * len(chunks), num_blocks, bs)
    sched = Scheduler(blocks, w["budget"], w["max_seqs"], async_scheduling=True)
    requests = [Request(i, p, o) for i, (p, o) in enumerate(w["lengths"])]
    pending = list(requests)
    written: list[dict[int, tuple[int, int]]] = [{} for _ in blocks.groups]
    forward = {r.id: 0 for r in requests}
    finished: list[Request] = []
    steps = 0
    while pending or not sched.idle:
        for _ in range(1 if w["arrive_every"] else len(pending)):
            if pending and (not w["arrive_every"] or steps % w["arrive_every"] == 0):
                sched.add(pending.pop(0))
        leaving = list(sched.leaving)
        assert all(r in blocks._tables for r in leaving)  # their blocks held until now
        step = sched.schedule()
        steps += 1
        assert steps < 10_000
        assert not any(r.done for r in sched.preempted)  # a finished request leaves, it is not re-queued
        assert not sched.leaving
        assert not any(r in blocks._tables for r in leaving)
        if not step:
            assert sched.idle, "a request that fits alone must be scheduled"
            assert pending
            continue
        _a_good_step(sched, step, w, forward)
        for s in step:
            assert not s.request.done
            assert s.request not in leaving
        _step_reads_its_chunks(blocks, step, written)
        done = sched.finish(step)
        assert all(r.done for r in done)
        assert sched.leaving == ([] if sched.idle else done)
        assert len(sched.running) + len(sched.leaving) <= w["max_seqs"]
        finished += done
    assert sorted(r.id for r in finished) == [r.id for r in requests]
    for r in requests:
        assert r.generated == r.output_len == len(r.token_times)
        assert forward[r.id] >= r.prompt_len + r.output_len - 1
        assert r.preemptions or forward[r.id] == r.prompt_len + r.output_len - 1
    assert blocks.free_blocks == num_blocks - 1


@dataclass(eq=False)
class _Req:
    id: int
    prompt: int
    output: int
    computed: int = 0
    sampled: int = 0  # tokens sampled by the steps scheduled so far, those in flight included (placeholders)


class _VllmAsync:
    """vLLM's async scheduling as vLLM writes it (v1 AsyncScheduler.schedule and EngineCore.step_with_batch_queue,
    a batch queue of two), for the bench's offline case (every request queued at once, no prefix cache, FCFS):
    step k + 1 is scheduled before step k's output is processed; a request whose last token is in flight stays in
    the running list (it holds its seat and its blocks, and is skipped) until that output is processed; the victim
    of a preemption is the running list's last, a finished one included (freed, put back in the queue, and dropped
    from it when its output is processed); an empty step is scheduled like any other."""

    def __init__(self, blocks: KVBlocks, budget: int, max_seqs: int, requests: list[_Req]) -> None:
        self.blocks, self.budget, self.max_seqs = blocks, budget, max_seqs
        self.waiting: deque[_Req] = deque(requests)
        self.running: list[_Req] = []
        self.preemptions = 0  # of requests with tokens left (a finished victim is not recomputed)

    def run(self) -> list[Step]:
        steps: list[Step] = []
        in_flight: list[tuple[_Req, int, int]] = []
        while self.waiting or self.running:
            step = self._schedule(in_flight)
            self._process(in_flight)
            in_flight = step
            if step:
                steps.append([(r.id, position, n) for r, position, n in step])
        return steps

    def _schedule(self, in_flight: list[tuple[_Req, int, int]]) -> list[tuple[_Req, int, int]]:
        budget, preempted, i = self.budget, False, 0
        out: list[tuple[_Req, int, int]] = []
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r.sampled == r.output:  # its last token in flight
                i += 1
                continue
            n = min(r.prompt + r.sampled - r.computed, budget)
            # chunked-local blocks are freed on the processed tokens: not those of the step in flight
            flying = sum(m for x, _, m in in_flight if x is r)
            while not self.blocks.allocate(r, r.computed, n, r.computed - flying):
                preempted = True
                victim = self.running.pop()
                self.blocks.free(victim)
                victim.computed = 0
                self.waiting.appendleft(victim)
                self.preemptions += victim.sampled < victim.output
                if victim is r:
                    break
            else:
                out.append((r, r.computed, n))
                budget -= n
                i += 1
                continue
            break
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            # vLLM skips a request whose stale output is still in flight: it never is here (no admission in the
            # step that preempted it, and that output is processed before the next)
            assert r.sampled < r.output
            assert all(r is not x for x, _, _ in in_flight)
            n = min(r.prompt + r.sampled - r.computed, budget)
            # admitted only when its whole sequence fits (scheduler_reserve_full_isl), in-flight cap of two steps
            if not self.blocks.admits(r.prompt + r.sampled, 2 * self.budget):
                break
            if not self.blocks.allocate(r, r.computed, n):
                break
            self.running.append(self.waiting.popleft())
            out.append((r, r.computed, n))
            budget -= n
        for r, _, n in out:
            r.computed += n
            if r.computed == r.prompt + r.sampled:
                r.sampled += 1
        return out

    def _process(self, step: list[tuple[_Req, int, int]]) -> None:
        """Step's output: the requests whose last token it sampled leave, from the running list or (preempted
        meanwhile) the queue, their blocks freed."""
        for r, position, n in step:
            if position + n == r.prompt + r.output - 1:
                (self.running if r in self.running else self.waiting).remove(r)
                self.blocks.free(r)


@settings(max_examples=150, deadline=None)
@given(st.one_of(workloads, small_pools))
def test_async_scheduling_schedules_the_steps_vllms_own_structure_does(w: dict[str, Any]) -> None:
    """Every request queued at once (as vLLM's offline LLM queues them): the same steps as ``_VllmAsync``, the
    same preemptions, every block back; and where neither seats nor blocks are short, the synchronous steps."""
    chunks, bs = w["chunks"], w["block_size"]
    probe = KVBlocks(chunks, [None] * len(chunks), 2, bs)
    num_blocks = probe.blocks_for(max(p + o for p, o in w["lengths"]), 2 * w["budget"]) + 1 + w["spare"]

    def blocks() -> KVBlocks:
        return KVBlocks(chunks, [None] * len(chunks), num_blocks, bs)

    ours, theirs = blocks(), blocks()
    sched = Scheduler(ours, w["budget"], w["max_seqs"], async_scheduling=True)
    requests = [Request(i, p, o) for i, (p, o) in enumerate(w["lengths"])]
    vllm = _VllmAsync(theirs, w["budget"], w["max_seqs"], [_Req(i, p, o) for i, (p, o) in enumerate(w["lengths"])])
    assert _run(sched, requests) == vllm.run()
    assert sum(r.preemptions for r in requests) == vllm.preemptions
    assert ours.free_blocks == theirs.free_blocks == num_blocks - 1

    # Seats for all, blocks for all at once: nothing waits on a finished request.
    plenty = sum(probe.blocks_for(p + o, p + o) for p, o in w["lengths"]) + 1
    sync, async_ = (
        _run(
            Scheduler(KVBlocks(chunks, [None] * len(chunks), plenty, bs), w["budget"], len(w["lengths"]), a),
            [Request(i, p, o) for i, (p, o) in enumerate(w["lengths"])],
        )
        for a in (False, True)
    )
    assert sync == async_
