"""The allocator on its own: a hypothesis state machine against a plain model of who owns what (owners in
several accounts, blocks shared copy-on-write, frees of any order)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chunkattn_server.errors import OutOfBlocks
from chunkattn_server.kv.block_pool import BlockPool

SIZE = 24


def _largest_free_extent(pool: BlockPool) -> range:
    """The longest run of free ids (the lowest, on a tie), found the slow way."""
    best = range(0)
    start = None
    for b in range(pool.num_blocks + 1):
        if b < pool.num_blocks and pool.is_free(b):
            start = b if start is None else start
        elif start is not None:
            if b - start > len(best):
                best = range(start, b)
            start = None
    return best


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(SIZE)
        self.owners: list[list[int]] = []  # blocks held by each client, in allocation order
        self.accounts: list[str] = []  # the account each client's blocks are charged to

    @rule(n=st.integers(0, SIZE + 2), continue_run=st.booleans(), account=st.sampled_from(["", "a", "b"]))
    def allocate(self, n: int, continue_run: bool, account: str) -> None:
        after = self.owners[-1][-1] if continue_run and self.owners and self.owners[-1] else None
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(OutOfBlocks, match=f"{free_before} free blocks of {SIZE}; {n} are needed"):
                self.pool.allocate(n, after=after, account=account)
            assert self.pool.num_free == free_before
            return
        continues_at = after + 1 if after is not None and n > 0 and self.pool.is_free(after + 1) else None
        largest = _largest_free_extent(self.pool)
        blocks = self.pool.allocate(n, after=after, account=account)
        assert len(blocks) == n
        if continues_at is not None:
            assert blocks[0] == continues_at  # a growing sequence continues its run
        elif n:
            assert blocks[0] in largest  # a new run goes where it has the most room
        self.owners.append(blocks)
        self.accounts.append(account)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share_some(self, data: st.DataObject) -> None:
        """A fork: a new owner of some of a client's blocks, in the same account."""
        i = data.draw(st.integers(0, len(self.owners) - 1))
        blocks = data.draw(st.lists(st.sampled_from(self.owners[i]), unique=True)) if self.owners[i] else []
        self.pool.share(blocks)
        self.owners.append(blocks)
        self.accounts.append(self.accounts[i])

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.owners) - 1))
        blocks = self.owners.pop(i)
        self.accounts.pop(i)
        self.pool.free(data.draw(st.permutations(blocks)))

    @precondition(lambda self: self.owners and self.owners[0])
    @rule()
    def double_free_is_refused(self) -> None:
        before = self.pool.num_free
        with pytest.raises(ValueError, match="not in use"):
            self.pool.free([*self.owners[0], self.owners[0][0]])
        with pytest.raises(ValueError, match="not in use"):
            self.pool.free([SIZE])
        free_block = next((b for b in range(SIZE) if self.pool.is_free(b)), None)
        if free_block is not None:
            with pytest.raises(ValueError, match="not in use"):
                self.pool.free([free_block])
        assert self.pool.num_free == before

    @invariant()
    def accounting_is_exact(self) -> None:
        owners = collections.Counter(b for blocks in self.owners for b in blocks)
        assert self.pool.num_free + self.pool.num_used == SIZE
        assert self.pool.num_used == len(owners)
        assert all(self.pool.owners(b) == n for b, n in owners.items())
        assert sum(self.pool.is_free(b) for b in range(SIZE)) == self.pool.num_free
        charged = {
            a: len({b for blocks, x in zip(self.owners, self.accounts, strict=True) if x == a for b in blocks})
            for a in set(self.accounts)
        }
        assert self.pool.usage() == {a: n for a, n in charged.items() if n}

    @invariant()
    def extents_are_the_maximal_free_runs(self) -> None:
        runs: dict[int, int] = {}
        start = None
        for b in range(SIZE + 1):
            if b < SIZE and self.pool.is_free(b):
                start = b if start is None else start
            elif start is not None:
                runs[start] = b - start
                start = None
        assert self.pool._extent == runs
        assert self.pool._extent_at_end == {s + n: s for s, n in runs.items()}


TestPool = PoolMachine.TestCase
TestPool.settings = TestPool.settings.__class__(TestPool.settings, max_examples=150, stateful_step_count=40)


def test_runs_continue_in_place_and_new_runs_start_mid_extent() -> None:
    pool = BlockPool(100)
    first = pool.allocate(4, account="")
    assert first == [48, 49, 50, 51]  # the middle of the one free extent [0, 100)
    assert pool.allocate(2, after=51, account="") == [52, 53]  # continues its run
    second = pool.allocate(4, account="")  # a new run: the middle of the largest extent left, [0, 48)
    assert second == [22, 23, 24, 25]
    assert pool.allocate(3, after=53, account="") == [54, 55, 56]  # room to grow in place
    pool.free([*first, 52, 53, 54, 55, 56])
    assert pool.allocate(60, account="") == [*range(33, 93)]  # [26, 100) merged back into one extent; centred in it


def test_a_fragmented_pool_allocates_largest_extents_first_from_its_heap() -> None:
    """Thousands of one-block sequences leave thousands of free runs; one allocation of the rest (a whole-pool
    block space) takes them largest first, as a scan of every run would choose, each chosen from the heap
    (found by the review of issue 35: the scan per run taken made such an open take 13.7 s)."""
    pool = BlockPool(1 << 14)
    for _ in range(4096):
        pool.allocate(1, account="a")
    runs = sorted(pool._extent.items(), key=lambda e: (-e[1], e[0]))  # what a scan would take, in order
    assert len(runs) > 1000
    taken = pool.allocate(pool.num_free, account="b")
    want = [b for start, length in runs for b in range(start, start + length)]
    assert taken == want
    assert pool.num_free == 0
    assert len(pool._largest) <= 4 * len(pool._extent) + 64
