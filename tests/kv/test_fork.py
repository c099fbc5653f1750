"""Fork: a sequence that shares its parent's blocks copy-on-write; the pool counts each block once."""

from __future__ import annotations

import pytest
import torch

from chunkattn_client import BatchEntry
from chunkattn_server.errors import InvalidBatch, OutOfBlocks, SequenceExists, UnknownSequence
from tests.helpers.harness import MODELS, Exploding, Harness, snapshot
from tests.helpers.invariants import owners_are_exact


@pytest.mark.parametrize("model", ["gqa", "sharing"])
@pytest.mark.parametrize("fork_at", [6, 8, 9])  # mid-block, on a block and chunk boundary, just after it
def test_forks_decode_apart_and_match_the_reference(model: str, fork_at: int) -> None:
    h = Harness.build(MODELS[model])
    h.step([BatchEntry("p", 0, fork_at)])
    shared = h.engine.kv.fork("p", "c", tenant="")
    h.reference.fork("p", "c")
    assert shared == len(h.engine.kv.sequence("p", tenant="").tables[0]) + sum(
        len(t) for t in h.engine.kv.sequence("p", tenant="").tables[1:]
    )
    owners_are_exact(h.engine)
    for i in range(12):  # different tokens for each: they diverge, across the next chunk boundaries
        h.step([BatchEntry("p", fork_at + i, 1), BatchEntry("c", fork_at + i, 1)])
        owners_are_exact(h.engine)
    h.step([BatchEntry("c", fork_at + 12, 7)])
    owners_are_exact(h.engine)
    h.release("p")
    owners_are_exact(h.engine)
    h.release("c")
    assert h.engine.pool.num_free == h.engine.pool.num_blocks


def test_a_fork_costs_no_block_until_someone_writes_into_a_shared_one() -> None:
    h = Harness.build(MODELS["mqa"])  # C = 4 and a global layer; blocks of 4
    h.step([BatchEntry("p", 0, 6)])  # chunked group: [4, 8) (chunk [0, 4) is gone); global: [0, 4), [4, 8)
    used = h.engine.pool.num_used
    h.engine.kv.fork("p", "c", tenant="")
    h.reference.fork("p", "c")
    assert h.engine.pool.num_used == used
    h.call(0, [BatchEntry("c", 6, 1)])  # writes into the shared block [4, 8) of the chunked group: one copy
    assert h.engine.pool.num_used == used + 1
    h.call(0, [BatchEntry("p", 6, 1)])  # the parent now owns its block alone: no copy
    assert h.engine.pool.num_used == used + 1
    owners_are_exact(h.engine)


def test_fork_errors_change_nothing() -> None:
    h = Harness.build(MODELS["gqa"])
    h.step([BatchEntry("p", 0, 5)])
    h.step([BatchEntry("q", 0, 3)])
    before = snapshot(h.engine)
    with pytest.raises(UnknownSequence, match="'nope'"):
        h.engine.kv.fork("nope", "c", tenant="")
    with pytest.raises(SequenceExists, match="'q'"):
        h.engine.kv.fork("p", "q", tenant="")
    with pytest.raises(InvalidBatch, match="non-empty string"):
        h.engine.kv.fork("p", "", tenant="")
    assert snapshot(h.engine) == before


def test_copy_on_write_refused_for_want_of_blocks_changes_nothing() -> None:
    h = Harness.build(MODELS["mqa"], num_blocks=5)
    h.step([BatchEntry("p", 0, 6)])  # 3 blocks: [4, 8) of the chunked group, [0, 4) and [4, 8) of the global
    h.engine.kv.fork("p", "c", tenant="")
    h.step([BatchEntry("x", 0, 3)])  # 2 more: the pool is full
    assert h.engine.pool.num_free == 0
    before = snapshot(h.engine)
    with pytest.raises(OutOfBlocks):
        h.engine.attend(
            0, [BatchEntry("c", 6, 1)], torch.randn(1, 4, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8), tenant=""
        )
    assert snapshot(h.engine) == before
    owners_are_exact(h.engine)


def _failing_call_changes_nothing(entries: list[BatchEntry]) -> Harness:
    """A forked "p"/"c" pair (6 tokens each, MQA model); a call on ``entries`` whose attention fails after
    the copy-on-write must leave everything as it was. Returns the harness, backend restored."""
    h = Harness.build(MODELS["mqa"])
    h.step([BatchEntry("p", 0, 6)])
    h.engine.kv.fork("p", "c", tenant="")
    h.reference.fork("p", "c")
    before = snapshot(h.engine)
    backend = h.engine.backend
    h.engine.backend = Exploding(torch.device("cpu"))
    n = len(entries)
    with pytest.raises(RuntimeError, match="fell over"):
        h.engine.attend(0, entries, torch.randn(n, 4, 8), torch.randn(n, 1, 8), torch.randn(n, 1, 8), tenant="")
    assert snapshot(h.engine) == before
    owners_are_exact(h.engine)
    h.engine.backend = backend
    return h


def test_a_failure_after_the_copy_rolls_it_back() -> None:
    h = _failing_call_changes_nothing([BatchEntry("c", 6, 1)])
    h.step([BatchEntry("c", 6, 1), BatchEntry("p", 6, 1)])  # and both still match the reference


def test_parent_and_child_decoding_in_one_batch_copy_once_and_roll_back_cleanly() -> None:
    """The beam-search pattern: both write into their shared last block in the same call."""
    h = _failing_call_changes_nothing([BatchEntry("p", 6, 1), BatchEntry("c", 6, 1)])
    used = h.engine.pool.num_used
    h.call(0, [BatchEntry("p", 6, 1), BatchEntry("c", 6, 1)])  # one copy: the second writer owns the original
    assert h.engine.pool.num_used == used + 1
    owners_are_exact(h.engine)
    h.call(1, [BatchEntry("p", 6, 1), BatchEntry("c", 6, 1)])  # the global layer catches up
    for i in range(7, 14):  # then both decode apart, across the chunk boundary at 8 and 12
        h.step([BatchEntry("p", i, 1), BatchEntry("c", i, 1)])
    owners_are_exact(h.engine)
