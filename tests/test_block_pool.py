"""The allocator on its own: a hypothesis state machine against a plain model of who owns what."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chunkattn_server.errors import OutOfBlocks
from chunkattn_server.kv.block_pool import BlockPool

SIZE = 24


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(SIZE)
        self.owners: list[list[int]] = []  # blocks held by each client, in allocation order

    @rule(n=st.integers(0, SIZE + 2), continue_run=st.booleans())
    def allocate(self, n: int, continue_run: bool) -> None:
        after = self.owners[-1][-1] if continue_run and self.owners and self.owners[-1] else None
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(OutOfBlocks, match=f"{free_before} free blocks of {SIZE}; {n} are needed"):
                self.pool.allocate(n, after=after)
            assert self.pool.num_free == free_before
            return
        expected_first = after + 1 if after is not None and n and self.pool.is_free(after + 1) else None
        lowest = min((b for b in range(SIZE) if self.pool.is_free(b)), default=None)
        blocks = self.pool.allocate(n, after=after)
        assert len(blocks) == n
        if expected_first is not None:
            assert blocks[0] == expected_first
        elif n:
            assert blocks[0] == lowest
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.owners) - 1))
        blocks = self.owners.pop(i)
        self.pool.free(blocks)

    @precondition(lambda self: self.owners and self.owners[0])
    @rule()
    def double_free_is_refused(self) -> None:
        before = self.pool.num_free
        with pytest.raises(ValueError, match="not in use"):
            self.pool.free([*self.owners[0], self.owners[0][0]])
        with pytest.raises(ValueError, match="not in use"):
            self.pool.free([SIZE])
        assert self.pool.num_free == before

    @invariant()
    def accounting_is_exact(self) -> None:
        owned = [b for blocks in self.owners for b in blocks]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert self.pool.num_free + self.pool.num_used == SIZE
        assert self.pool.num_used == len(owned)
        assert all(not self.pool.is_free(b) for b in owned)
        assert sum(self.pool.is_free(b) for b in range(SIZE)) == self.pool.num_free


TestPool = PoolMachine.TestCase
TestPool.settings = TestPool.settings.__class__(TestPool.settings, max_examples=150, stateful_step_count=40)


def test_a_new_run_starts_at_the_lowest_free_block_and_continues_in_place() -> None:
    pool = BlockPool(10)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([1])
    assert pool.allocate(2, after=4) == [5, 6]  # continues its run
    assert pool.allocate(2, after=6) == [7, 8]
    assert pool.allocate(2, after=8) == [9, 1]  # end of the pool: then the lowest free id
