"""Concurrent clients through a real server with batching on: random interleavings of many clients'
prefills, decodes, forks and releases, every output against the float64 reference, and steps that really
merge calls."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkattn_client import BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel
from chunkattn_client.reference import within_tolerance
from tests.helpers.server_process import SMALL, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.server]

RUNS = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "4096", "--idle-timeout-s", "0") as s:
        yield s


# One client's work: ("prefill", tokens), ("decode", steps), ("fork",), ("release",), applied to its
# sequences in turn.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("prefill"), st.integers(1, 20)),
        st.tuples(st.just("decode"), st.integers(1, 6)),
        st.tuples(st.just("fork")),
        st.tuples(st.just("release")),
    ),
    min_size=1,
    max_size=6,
)


class Runner:
    """One client thread: its own sequences, its own reference; every output checked."""

    def __init__(self, target: str, name: str, seed: int) -> None:
        self.client = ChunkAttnClient(target, timeout_s=60)
        info = self.client.info()
        self.heads, self.kv_heads, self.head_size = info.num_heads, info.num_kv_heads, info.head_size
        self.layers = len(info.layers)
        self.reference = ReferenceModel.for_server(info)
        self.rng = np.random.default_rng(seed)
        self.name = name
        self.live: dict[str, int] = {}  # sequence -> length
        self.made = 0
        self.calls = 0
        self.failures: list[str] = []

    def new_id(self) -> str:
        self.made += 1
        return f"{self.name}-{self.made}"

    def step(self, entries: list[BatchEntry]) -> None:
        """The batch through every layer, as a model runner sends it."""
        t = sum(e.num_tokens for e in entries)
        for layer in range(self.layers):
            q = self.rng.standard_normal((t, self.heads, self.head_size)).astype(np.float32)
            k = self.rng.standard_normal((t, self.kv_heads, self.head_size)).astype(np.float32)
            v = self.rng.standard_normal((t, self.kv_heads, self.head_size)).astype(np.float32)
            out = self.client.attend(layer, entries, q, k, v)
            expected = self.reference.attend(layer, entries, q, k, v)
            ok, err = within_tolerance(out, expected, "float32")
            self.calls += 1
            if not ok:
                self.failures.append(f"layer {layer} {entries}: error {err:.3g}")
        for e in entries:
            self.live[e.seq_id] = e.position + e.num_tokens

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        try:
            for op in ops:
                if op[0] == "prefill":
                    self.step([BatchEntry(self.new_id(), 0, op[1])])
                elif op[0] == "decode" and self.live:
                    for _ in range(op[1]):
                        self.step([BatchEntry(s, n, 1) for s, n in self.live.items()])
                elif op[0] == "fork" and self.live:
                    parent, child = next(iter(self.live)), self.new_id()
                    self.client.fork(parent, child)
                    self.reference.fork(parent, child)
                    self.live[child] = self.live[parent]
                elif op[0] == "release" and self.live:
                    seq = next(iter(self.live))
                    self.client.release([seq])
                    self.reference.release(seq)
                    del self.live[seq]
            if self.live:
                self.client.release(list(self.live))
        except ChunkAttnError as e:
            self.failures.append(f"{e.code}: {e}")
        finally:
            self.client.close()


def run_clients(target: str, plans: list[list[tuple[Any, ...]]]) -> list[Runner]:
    run = next(RUNS)
    runners = [Runner(target, f"r{run}c{i}", seed=run * 100 + i) for i in range(len(plans))]
    start = threading.Barrier(len(runners))

    def go(r: Runner, ops: list[tuple[Any, ...]]) -> None:
        start.wait()
        r.run(ops)

    threads = [threading.Thread(target=go, args=(r, ops)) for r, ops in zip(runners, plans, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return runners


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=st.lists(OPS, min_size=2, max_size=6))
def test_concurrent_clients_match_the_reference(server: ServerProcess, plans: list[list[tuple[Any, ...]]]) -> None:
    runners = run_clients(server.target, plans)
    assert [f for r in runners for f in r.failures] == []
    with ChunkAttnClient(server.target) as c:
        assert c.info().active_sequences == 0  # every client released what it made


def test_steps_merge_calls_under_concurrent_load(server: ServerProcess) -> None:
    before = server.metrics()
    runners = run_clients(server.target, [[("prefill", 8), ("decode", 20)]] * 8)
    assert [f for r in runners for f in r.failures] == []
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    calls, steps = delta("chunkattn_step_calls_sum"), delta("chunkattn_step_calls_count")
    assert calls == sum(r.calls for r in runners)
    single = delta_bucket(before, after, "1.0")
    assert steps < calls, (calls, steps)  # some steps held more than one call
    assert single < steps, (single, steps)


def delta_bucket(before: dict[Any, float], after: dict[Any, float], le: str) -> float:
    key = ("chunkattn_step_calls_bucket", (("le", le),))
    return after.get(key, 0.0) - before.get(key, 0.0)
