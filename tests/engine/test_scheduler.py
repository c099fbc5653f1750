"""The scheduler's rules, in-process: steps are made deterministic by holding the scheduler's thread in a
control job while the calls under test queue behind it, so they all meet in the next step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_server import CacheConfig, Engine, EngineConfig
from chunkattn_server.engine.scheduler import Scheduler
from chunkattn_server.errors import (
    InvalidBatch,
    InvalidTensor,
    OutOfBlocks,
    PositionMismatch,
    UnknownLayer,
    UnknownSequence,
)
from chunkattn_server.metrics import Metrics
from tests.helpers.harness import MODELS, Harness, snapshot

MODEL = MODELS["gqa"]


@dataclass
class E:
    """A call's entry as a test writes it: its BatchEntry, and whether it ends its sequence."""

    seq_id: str
    position: int
    num_tokens: int
    end_of_sequence: bool = False

    @property
    def entry(self) -> BatchEntry:
        return BatchEntry(self.seq_id, self.position, self.num_tokens)


def make(num_blocks: int = 256, **kw: Any) -> tuple[Scheduler, Metrics]:
    metrics = Metrics()
    config = EngineConfig(MODEL, CacheConfig(block_size=4, num_blocks=num_blocks), device="cpu")
    return Scheduler(lambda: Engine(config), metrics, **kw), metrics


def tensors(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = MODEL
    return (
        torch.randn(tokens, m.num_heads, m.head_size, generator=g),
        torch.randn(tokens, m.num_kv_heads, m.head_size, generator=g),
        torch.randn(tokens, m.num_kv_heads, m.head_size, generator=g),
    )


def steps(metrics: Metrics) -> list[tuple[float, float]]:
    """(calls per step histogram sum, count)."""
    samples = {
        s.name: s.value for fam in metrics.registry.collect() if fam.name == "chunkattn_step_calls" for s in fam.samples
    }
    return [(samples["chunkattn_step_calls_sum"], samples["chunkattn_step_calls_count"])]


async def held(s: Scheduler, work: Callable[[], list[Awaitable[Any]]]) -> list[Any]:
    """Start ``work``'s calls while the scheduler's thread is held, so they queue; then let it go. Returns
    each call's result or exception, in order."""
    gate = threading.Event()
    blocker = asyncio.ensure_future(s.run("hold", lambda e: gate.wait(10)))
    await asyncio.sleep(0.05)  # the hold job is running
    tasks = [asyncio.ensure_future(a) for a in work()]
    await asyncio.sleep(0.05)  # every call is queued
    gate.set()
    await blocker
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def attend(s: Scheduler, layer: int, entries: list[E], seed: int, **bad: Any) -> Coroutine[Any, Any, Any]:
    q, k, v = tensors(seed, sum(e.num_tokens for e in entries))
    ending = frozenset(e.seq_id for e in entries if e.end_of_sequence)
    return s.attend("Attend", layer, [e.entry for e in entries], bad.get("q", q), k, v, ending=ending, tenant="")


def assert_as_alone(layer: int, calls: list[tuple[str, int, int]], outs: list[Any]) -> None:
    """Each output equals that of the same call, (sequence, position, tokens) with tensors(i, tokens), run
    alone on an engine of its own in the same order."""
    h = Harness.build(MODEL)
    for i, ((seq, pos, n), out) in enumerate(zip(calls, outs, strict=True)):
        q, k, v = tensors(i, n)
        expected = h.engine.attend(layer, [BatchEntry(seq, pos, n)], q, k, v, tenant="")
        assert out.is_cpu  # the output in host memory, as the wire takes it
        assert out.is_contiguous()
        torch.testing.assert_close(out, expected)


def test_queued_calls_of_one_layer_share_a_step_and_match_the_reference() -> None:
    s, metrics = make()

    async def main() -> list[Any]:
        return await held(s, lambda: [attend(s, 0, [E(f"s{i}", 0, 3 + i)], seed=i) for i in range(6)])

    try:
        outs = asyncio.run(main())
        assert steps(metrics) == [(6.0, 1.0)]  # one step of six calls
        assert_as_alone(0, [(f"s{i}", 0, 3 + i) for i in range(6)], outs)
    finally:
        s.stop()


def test_no_batching_runs_one_call_per_step() -> None:
    s, metrics = make(batching=False)
    try:
        asyncio.run(held(s, lambda: [attend(s, 0, [E(f"s{i}", 0, 2)], seed=i) for i in range(4)]))
        assert steps(metrics) == [(4.0, 4.0)]
    finally:
        s.stop()


def test_calls_of_one_sequence_keep_their_order_and_never_share_a_step() -> None:
    s, metrics = make()
    try:
        # s0's second call (position 4) must run after its first (position 0), in a later step.
        outs = asyncio.run(
            held(
                s,
                lambda: [
                    attend(s, 0, [E("s0", 0, 4)], seed=1),
                    attend(s, 0, [E("s0", 4, 1)], seed=2),
                    attend(s, 0, [E("s1", 0, 2)], seed=3),
                ],
            )
        )
        assert not any(isinstance(o, BaseException) for o in outs), outs
        assert s.engine.kv.sequence("s0", tenant="").lengths[0] == 5
        assert steps(metrics) == [(3.0, 2.0)]  # (s0@0, s1) then (s0@4)
    finally:
        s.stop()


def test_another_layer_does_not_join_and_is_not_overtaken_by_its_sequence() -> None:
    s, metrics = make()
    try:
        outs = asyncio.run(
            held(
                s,
                lambda: [
                    attend(s, 0, [E("a", 0, 2)], seed=1),
                    attend(s, 1, [E("b", 0, 2)], seed=2),
                    attend(s, 1, [E("a", 0, 2)], seed=3),  # layer 1 of a: after layer 0 of a
                    attend(s, 0, [E("b", 0, 2)], seed=4),  # blocked by b's layer-1 call queued before it
                ],
            )
        )
        assert not any(isinstance(o, BaseException) for o in outs), outs
        assert steps(metrics) == [(4.0, 3.0)]  # (a@0), (b@1, a@1), (b@0)
    finally:
        s.stop()


def test_a_control_job_keeps_its_place() -> None:
    s, _ = make()

    async def main() -> list[Any]:
        def work() -> list[Awaitable[Any]]:
            return [
                attend(s, 0, [E("a", 0, 2)], seed=1),
                s.run("Release", lambda e: e.kv.release(["a"], tenant="")),
                attend(s, 0, [E("a", 2, 1)], seed=2),  # a is gone by then
            ]

        return await held(s, work)

    try:
        first, released, third = asyncio.run(main())
        assert not isinstance(first, BaseException)
        assert released == 1
        assert isinstance(third, UnknownSequence)
    finally:
        s.stop()


def test_a_bad_call_fails_alone_and_changes_nothing() -> None:
    """Each bad call merged with good ones gets the error it gets alone; the good ones' outputs, the state
    after the step and later outputs are bit-identical to a run without the bad calls."""

    def run(with_bad: bool) -> tuple[list[Any], Any, bytes]:
        s, _metrics = make()

        def work() -> list[Awaitable[Any]]:
            calls: list[Awaitable[Any]] = [attend(s, 0, [E(f"g{i}", 0, 3)], seed=i) for i in range(3)]
            if with_bad:
                q, k, v = tensors(9, 2)
                calls.insert(
                    1, s.attend("Attend", 0, [BatchEntry("bad", 0, 2)], q[:, :1], k, v, tenant="")
                )  # wrong q shape
                calls.insert(3, attend(s, 0, [E("late", 5, 2)], seed=10))  # unknown sequence not at 0
                calls.append(attend(s, 0, [E("g9", 0, 1), E("g9", 1, 1)], seed=11))  # repeated sequence
            return calls

        try:
            outs = asyncio.run(held(s, work))
            state = snapshot(s.engine)
            later = asyncio.run(s_attend_after(s))
            return outs, state, later
        finally:
            s.stop()

    async def s_attend_after(s: Scheduler) -> bytes:
        out = await attend(s, 0, [E("g0", 3, 1), E("g1", 3, 1)], seed=20)
        return bytes(out.numpy().tobytes())

    clean, clean_state, clean_later = run(False)
    mixed, mixed_state, mixed_later = run(True)
    bad = [mixed.pop(1), mixed.pop(2), mixed.pop(-1)]
    assert isinstance(bad[0], InvalidTensor)
    assert "q has shape" in str(bad[0])
    assert isinstance(bad[1], UnknownSequence)
    assert "'late'" in str(bad[1])
    assert "appears twice" in str(bad[2])
    assert [o.numpy().tobytes() for o in mixed] == [o.numpy().tobytes() for o in clean]
    assert mixed_state == clean_state
    assert mixed_later == clean_later


def test_a_call_short_of_blocks_runs_again_alone_and_gets_what_it_would_alone() -> None:
    # A 4-token call of layer 0 takes one block: a pool of 3 holds three. The fourth, short of blocks while
    # the others hold theirs, runs again in a step of its own and fails as it would have alone.
    s, metrics = make(num_blocks=3)
    try:
        outs = asyncio.run(held(s, lambda: [attend(s, 0, [E(f"s{i}", 0, 4)], seed=i) for i in range(4)]))
        assert [type(o).__name__ for o in outs[:3]] == ["Tensor"] * 3
        assert isinstance(outs[3], OutOfBlocks)
        assert "the pool has 0 free of 3" in str(outs[3])
        assert s.engine.stats().free_blocks == 0
        assert s.engine.kv.sequence_ids(tenant="") == ["s0", "s1", "s2"]
        assert steps(metrics) == [(4.0, 2.0)]  # three served together, then the fourth alone
    finally:
        s.stop()


def test_end_of_sequence_releases_after_its_call() -> None:
    s, _metrics = make()
    try:
        outs = asyncio.run(
            held(s, lambda: [attend(s, 0, [E("a", 0, 2, True)], seed=1), attend(s, 0, [E("b", 0, 2)], seed=2)])
        )
        assert not any(isinstance(o, BaseException) for o in outs)
        assert s.engine.kv.sequence_ids(tenant="") == ["b"]
    finally:
        s.stop()


def test_a_position_error_is_the_same_merged_or_alone() -> None:
    s, _ = make()
    try:
        asyncio.run(attend(s, 0, [E("a", 0, 2)], seed=1))
        outs = asyncio.run(
            held(s, lambda: [attend(s, 0, [E("a", 3, 1)], seed=2), attend(s, 0, [E("b", 0, 1)], seed=3)])
        )
        alone = asyncio.run(_raises(attend(s, 0, [E("a", 3, 1)], seed=2)))
        assert isinstance(outs[0], PositionMismatch)
        assert str(outs[0]) == str(alone)
    finally:
        s.stop()


async def _raises(call: Coroutine[Any, Any, Any]) -> BaseException:
    with pytest.raises(PositionMismatch) as info:
        await call
    return info.value


def test_max_batch_tokens_bounds_a_step() -> None:
    s, metrics = make(max_batch_tokens=8)
    try:
        asyncio.run(held(s, lambda: [attend(s, 0, [E(f"s{i}", 0, 4)], seed=i) for i in range(5)]))
        assert steps(metrics) == [(5.0, 3.0)]  # 4+4, 4+4, 4
    finally:
        s.stop()


def test_a_cancelled_call_that_has_not_run_changes_nothing() -> None:
    s, _ = make()

    async def main() -> None:
        gate = threading.Event()
        blocker = asyncio.ensure_future(s.run("hold", lambda e: gate.wait(10)))
        await asyncio.sleep(0.05)
        call = asyncio.ensure_future(attend(s, 0, [E("gone", 0, 2)], seed=1))
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.sleep(0)
        gate.set()
        await blocker
        await s.run("sync", lambda e: None)

    try:
        asyncio.run(main())
        assert s.engine.kv.sequence_ids(tenant="") == []
    finally:
        s.stop()


def runners(metrics: Metrics) -> dict[str, float]:
    """Steps run so far, by where (chunkattn_engine_steps_total)."""
    return {
        s.labels["runner"]: s.value
        for fam in metrics.registry.collect()
        if fam.name == "chunkattn_engine_steps"
        for s in fam.samples
        if s.name.endswith("_total")
    }


def test_small_steps_run_on_the_event_loop_and_large_ones_on_the_engine_thread() -> None:
    s, metrics = make()
    try:
        asyncio.run(attend(s, 2, [E("small", 0, 3)], seed=1))
        assert runners(metrics) == {"event_loop": 1.0}
        asyncio.run(attend(s, 2, [E("large", 0, 300)], seed=2))  # more tokens than a step on the loop takes
        asyncio.run(
            s.run("Release", lambda e: e.kv.release(["small"], tenant=""))
        )  # control jobs: always the engine thread
        assert runners(metrics) == {"event_loop": 1.0, "engine_thread": 2.0}
    finally:
        s.stop()
    s, metrics = make(inline=False)
    try:
        asyncio.run(attend(s, 2, [E("small", 0, 3)], seed=1))
        assert runners(metrics) == {"engine_thread": 1.0}
    finally:
        s.stop()


def test_the_event_loop_merges_the_calls_it_holds() -> None:
    """Calls queued in one turn of the loop, with the engine thread idle, share one step on the loop."""
    s, metrics = make()
    calls = [(f"s{i}", 0, 1 + i) for i in range(5)]

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(attend(s, 0, [E(*c)], seed=i) for i, c in enumerate(calls))))

    try:
        outs = asyncio.run(main())
        assert steps(metrics) == [(5.0, 1.0)]
        assert runners(metrics) == {"event_loop": 1.0}
        assert_as_alone(0, calls, outs)
    finally:
        s.stop()


def test_calls_behind_a_step_on_the_engine_thread_wait_for_it_and_keep_their_order() -> None:
    """A large call takes its step (and the small ones merged with it) to the engine thread; the same
    sequence's next call, queued behind, runs after it on the loop, and every output matches a run of the
    same calls one by one."""
    s, metrics = make()
    calls = [("a", 0, 2), ("big", 0, 300), ("a", 2, 1), ("b", 0, 1)]  # (sequence, position, tokens), layer 2

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(attend(s, 2, [E(*c)], seed=i) for i, c in enumerate(calls))))

    try:
        outs = asyncio.run(main())
        assert steps(metrics) == [(4.0, 2.0)]  # (a@0, big, b) on the engine thread, then (a@2) on the loop
        assert runners(metrics) == {"engine_thread": 1.0, "event_loop": 1.0}
        assert_as_alone(2, calls, outs)
    finally:
        s.stop()


def test_a_call_whose_event_loop_closed_holds_up_no_other_loop() -> None:
    """A call queued from a loop that then closed (its task left pending) is dropped unrun, and a call from
    another loop queued behind it is served."""
    s, _ = make()
    gate = threading.Event()
    loop_b = asyncio.new_event_loop()
    loop_a = asyncio.new_event_loop()
    try:
        blocker = loop_b.create_task(s.run("hold", lambda e: gate.wait(10)))
        loop_b.run_until_complete(asyncio.sleep(0.05))  # the hold job runs on the engine thread
        left = loop_a.create_task(attend(s, 0, [E("a", 0, 1)], seed=1))  # never awaited: its loop closes
        loop_a.run_until_complete(asyncio.sleep(0.01))  # a's call is queued behind it
        loop_a.close()

        async def b_side() -> Any:
            call = asyncio.ensure_future(attend(s, 0, [E("b", 0, 1)], seed=2))
            await asyncio.sleep(0.05)
            gate.set()
            await blocker
            return await asyncio.wait_for(call, 10)

        assert loop_b.run_until_complete(b_side()).numel()
        assert s.engine.kv.sequence_ids(tenant="") == ["b"]
        assert not left.done()
    finally:
        gate.set()
        loop_b.close()
        s.stop()


def test_a_malformed_entry_fails_its_call_alone_and_the_scheduler_goes_on() -> None:
    s, _ = make()
    try:
        bad = asyncio.run(_raising(attend(s, 0, [E("x", None, 1)], seed=1)))  # type: ignore[arg-type]
        assert isinstance(bad, InvalidBatch)
        assert "position must be an integer >= 0, got None" in str(bad)
        asyncio.run(attend(s, 0, [E("y", 0, 1)], seed=2))
        assert s.engine.kv.sequence_ids(tenant="") == ["y"]
    finally:
        s.stop()


async def _raising(call: Coroutine[Any, Any, Any]) -> BaseException:
    try:
        await call
    except Exception as e:
        return e
    raise AssertionError("the call succeeded")


def test_end_of_sequence_must_name_a_sequence_of_the_call() -> None:
    s, _ = make()
    try:
        q, k, v = tensors(1, 1)
        call = s.attend("Attend", 0, [BatchEntry("a", 0, 1)], q, k, v, ending=frozenset({"b"}), tenant="")
        bad = asyncio.run(_raising(call))
        assert isinstance(bad, InvalidBatch)
        assert "'b'" in str(bad)
        assert s.engine.kv.sequence_ids(tenant="") == []
    finally:
        s.stop()


def test_an_unknown_layer_fails_before_it_is_queued_and_the_scheduler_goes_on() -> None:
    s, metrics = make()
    try:
        bad = asyncio.run(_raising(attend(s, 99, [E("x", 0, 1)], seed=1)))
        assert isinstance(bad, UnknownLayer)
        assert steps(metrics) == [(0.0, 0.0)]  # no step ran
        asyncio.run(attend(s, 0, [E("y", 0, 1)], seed=2))
        assert s.engine.kv.sequence_ids(tenant="") == ["y"]
    finally:
        s.stop()
