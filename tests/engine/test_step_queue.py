"""The batching rules, on the pure step queue: no threads, no event loops, no engine."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import torch

from chunkattn_client import BatchEntry
from chunkattn_server.engine.entries import Entries
from chunkattn_server.engine.jobs import Attend, Control, Job
from chunkattn_server.engine.step_queue import StepQueue


class Waiting:
    """Stands in for a caller's future: ``cancelled`` says whether the caller went away."""

    def __init__(self, cancelled: bool = False) -> None:
        self._cancelled = cancelled

    def cancelled(self) -> bool:
        return self._cancelled

    def get_loop(self) -> Waiting:
        return self

    def is_closed(self) -> bool:
        return False


def future(cancelled: bool = False) -> asyncio.Future[Any]:
    return cast("asyncio.Future[Any]", Waiting(cancelled))


def call(layer: int, *seqs: tuple[str, int], tenant: str = "", cancelled: bool = False) -> Attend:
    """An Attend call of ``layer`` over (seq_id, tokens) entries (tensors are not the queue's business)."""
    entries = Entries(BatchEntry(seq, 0, n) for seq, n in seqs)
    tokens = sum(n for _, n in seqs)
    q = torch.empty(tokens, 1, 1)
    return Attend(
        "Attend", future(cancelled), layer=layer, entries=entries, q=q, k=None, v=None, tokens=tokens, tenant=tenant
    )


def control() -> Control:
    return Control("Release", future(), fn=lambda e: None)


def queue(*jobs: Job, **kw: Any) -> StepQueue:
    q = StepQueue(**kw)
    for job in jobs:
        q.push(job)
    return q


def steps(q: StepQueue) -> list[list[Job]]:
    """Every step the queue makes, in order, until it is empty."""
    out = []
    while q.pending():
        out.append(q.take())
    return out


def test_calls_of_one_layer_share_a_step_in_arrival_order() -> None:
    a, b, c = call(0, ("a", 1)), call(0, ("b", 1)), call(0, ("c", 2))
    assert steps(queue(a, b, c)) == [[a, b, c]]


def test_without_batching_every_job_is_a_step() -> None:
    a, b = call(0, ("a", 1)), call(0, ("b", 1))
    assert steps(queue(a, b, batching=False)) == [[a], [b]]


def test_calls_of_one_sequence_keep_their_order_and_never_share_a_step() -> None:
    a1, a2, b = call(0, ("a", 4)), call(0, ("a", 1)), call(0, ("b", 2))
    assert steps(queue(a1, a2, b)) == [[a1, b], [a2]]


def test_one_sequence_of_a_multi_sequence_call_blocks_it() -> None:
    ab, bc, d = call(0, ("a", 1), ("b", 1)), call(0, ("b", 1), ("c", 1)), call(0, ("d", 1))
    assert steps(queue(ab, bc, d)) == [[ab, d], [bc]]


def test_the_same_id_of_another_tenant_is_another_sequence() -> None:
    mine, theirs = call(0, ("a", 1), tenant="x"), call(0, ("a", 1), tenant="y")
    assert steps(queue(mine, theirs)) == [[mine, theirs]]


def test_calls_of_another_layer_wait_for_a_step_of_their_own() -> None:
    a0, b1, c0 = call(0, ("a", 1)), call(1, ("b", 1)), call(0, ("c", 1))
    assert steps(queue(a0, b1, c0)) == [[a0, c0], [b1]]


def test_a_call_is_not_overtaken_by_a_later_call_of_its_sequence_in_another_layer() -> None:
    # b's layer-0 call may not overtake b's layer-1 call, queued before it
    a0, b1, a1, b0 = call(0, ("a", 2)), call(1, ("b", 2)), call(1, ("a", 2)), call(0, ("b", 2))
    assert steps(queue(a0, b1, a1, b0)) == [[a0], [b1, a1], [b0]]


def test_a_control_job_is_a_barrier() -> None:
    a, ctl, b, c = call(0, ("a", 1)), control(), call(0, ("b", 1)), call(0, ("c", 1))
    assert steps(queue(a, ctl, b, c)) == [[a], [ctl], [b, c]]


def test_a_control_job_first_is_a_step_alone() -> None:
    ctl, a = control(), call(0, ("a", 1))
    assert steps(queue(ctl, a)) == [[ctl], [a]]


def test_max_batch_tokens_bounds_a_step() -> None:
    calls = [call(0, (f"s{i}", 4)) for i in range(5)]
    assert [len(step) for step in steps(queue(*calls, max_batch_tokens=8))] == [2, 2, 1]


def test_a_call_past_the_budget_does_not_stop_smaller_ones_joining() -> None:
    a, big, small = call(0, ("a", 4)), call(0, ("big", 8)), call(0, ("small", 4))
    assert steps(queue(a, big, small, max_batch_tokens=8)) == [[a, small], [big]]


def test_the_first_call_runs_even_past_the_budget() -> None:
    big, a = call(0, ("big", 20)), call(0, ("a", 1))
    assert steps(queue(big, a, max_batch_tokens=8)) == [[big], [a]]


def test_the_scan_stops_at_its_limit() -> None:
    calls = [call(0, (f"s{i}", 1)) for i in range(6)]
    assert [len(step) for step in steps(queue(*calls, scan_limit=4))] == [4, 2]


def test_requeued_calls_go_first_each_in_a_step_of_its_own() -> None:
    q = queue(call(0, ("a", 1)), call(0, ("b", 1)), call(0, ("c", 1)))
    _, b, c = q.take()
    ctl, d, e = control(), call(0, ("d", 1)), call(0, ("e", 1))
    q.push(d)
    q.push(ctl)
    q.push(e)
    q.requeue([b, c])  # short of blocks behind a: b and c run again, first, in their order, alone
    assert q.first() is b
    assert steps(q) == [[b], [c], [d], [ctl], [e]]


def test_a_requeued_call_runs_before_a_later_call_of_its_sequence() -> None:
    q = queue(call(0, ("a", 4)), call(0, ("b", 4)))
    _, b = q.take()
    b_next = call(0, ("b", 1))
    q.push(b_next)
    q.requeue([b])
    assert steps(q) == [[b], [b_next]]


def test_a_requeued_call_is_alone_once_then_joins_steps_again() -> None:
    q = queue(call(0, ("a", 4)), call(0, ("b", 4)))
    _, b = q.take()
    c = call(0, ("c", 4))
    q.push(c)
    q.requeue([b])
    assert q.take() == [b]
    q.requeue([b])  # short again: alone again
    assert steps(q) == [[b], [c]]
    q.push(b)  # queued anew (not requeued): it may be merged
    q.push(c)
    assert steps(q) == [[b, c]]


def test_a_job_whose_caller_went_away_is_dropped_unrun() -> None:
    gone_first, a, gone, b = (
        call(0, ("x", 1), cancelled=True),
        call(0, ("a", 1)),
        call(0, ("y", 1), cancelled=True),
        call(0, ("b", 1)),
    )
    q = queue(gone_first, a, gone, b)
    assert q.pending()
    assert q.first() is a
    assert steps(q) == [[a, b]]
    assert len(q) == 0


def test_a_gone_call_still_holds_its_sequence_order() -> None:
    # a cancelled call between two of one sequence's calls does not let the later one jump ahead
    a1, gone_a, a2 = call(0, ("a", 1)), call(1, ("a", 1), cancelled=True), call(0, ("a", 1))
    assert steps(queue(a1, gone_a, a2)) == [[a1], [a2]]


def test_queued_tokens_counts_one_layer() -> None:
    q = queue(call(0, ("a", 3)), call(1, ("b", 5)), control(), call(0, ("c", 2)))
    assert q.queued_tokens(0) == 5
    assert q.queued_tokens(1) == 5


def test_peek_leaves_the_queue_as_it_was() -> None:
    a, b = call(0, ("a", 1)), call(0, ("b", 1))
    q = queue(a, b)
    assert q.peek() == [a, b]
    assert len(q) == 2
    assert q.take(q.peek()) == [a, b]
    assert not q.pending()
