"""The chunk split: pieces tile the batch, never cross a chunk, and read each key from the right place."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from chunkattn_server.attention.plan import split


def _logical(entry: int, first: int, last: int) -> tuple[int, ...]:
    return tuple(1000 * entry + b for b in range(first, last))  # a fake table: (entry, logical block) stay visible


def test_worked_example_from_the_architecture() -> None:
    """C = 4, block 2: A has 5 tokens + 6 new, B 7 + 1, C 0 + 3 (docs/architecture.md)."""
    pieces = split([(5, 6), (7, 1), (0, 3)], chunk_size=4, block_size=2, blocks_of=_logical)
    assert [(p.num_queries, p.num_keys, p.key_start) for p in pieces] == [(3, 4, 4), (3, 3, 8), (1, 4, 4), (3, 3, 0)]
    a1, a2, b, c = pieces
    assert (a1.row, a1.position, a1.cache_end, a1.blocks) == (0, 5, 5, (2,))  # key 4 is context from the cache
    assert (a2.row, a2.position, a2.cache_end, a2.blocks) == (3, 8, 8, ())  # starts a chunk: no context
    assert (b.row, b.position, b.cache_end, b.blocks) == (6, 7, 8, (1002, 1003))  # a decode reads keys 4..7
    assert (c.row, c.position, c.cache_end, c.blocks) == (7, 0, 0, ())


def test_global_layer_is_one_piece_per_sequence() -> None:
    pieces = split([(100, 7), (3, 1)], chunk_size=0, block_size=16, blocks_of=_logical)
    assert [(p.num_queries, p.key_start, p.cache_end) for p in pieces] == [(7, 0, 100), (1, 0, 4)]
    assert pieces[0].blocks == tuple(range(7))


@given(
    spans=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 100)), min_size=1, max_size=5),
    chunk_blocks=st.integers(0, 6),
    block_size=st.sampled_from([1, 2, 4, 16]),
)
def test_pieces_tile_the_batch_inside_chunks(spans: list[tuple[int, int]], chunk_blocks: int, block_size: int) -> None:
    chunk = chunk_blocks * block_size
    pieces = split(spans, chunk_size=chunk, block_size=block_size, blocks_of=_logical)
    rows = [r for p in pieces for r in range(p.row, p.row + p.num_queries)]
    assert rows == list(range(sum(n for _, n in spans)))  # every row once, in order
    for p in pieces:
        first, last = p.position, p.position + p.num_queries - 1
        assert p.key_start == (first // chunk * chunk if chunk else 0)
        if chunk:
            assert last // chunk == first // chunk  # never crosses a chunk boundary
        position, num_tokens = spans[p.entry]
        decode = num_tokens == 1
        assert p.cache_end == (first + 1 if decode else max(p.key_start, min(first, position)))
        assert p.blocks == tuple(
            1000 * p.entry + b for b in range(p.key_start // block_size, -(-p.cache_end // block_size))
        )
