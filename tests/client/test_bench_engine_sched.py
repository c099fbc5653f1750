"""The engine workload's scheduler and KV cache manager (bench/scheduler.py, bench/kvblocks.py), without a server:
vLLM's KV cache groups, the rows of a step (virtual batches) on the architecture's worked example, and, over
random workloads, that the engine plays by vLLM's rules and that every row reads exactly its own request's keys of
its chunk (a fake cache that records, per slot, which request's which position was written there)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkattn_client.batch import BatchEntry, BlockRows
from chunkattn_client.bench.kvblocks import NULL_BLOCK, Group, KVBlocks, kv_groups
from chunkattn_client.bench.scheduler import Request, Scheduled, Scheduler
from chunkattn_client.client import LayerInfo, ServerInfo
from chunkattn_client.reference import BlockReference, ReferenceModel


def test_kv_cache_groups_are_vllms() -> None:
    # Llama 4 Scout: 36 chunked layers (3 of every 4) and 12 global: 4 groups of 12, a group taking every 3rd.
    chunks = [0 if (i + 1) % 4 == 0 else 8192 for i in range(48)]
    groups = kv_groups(chunks, [None] * 48)
    chunked = [i for i in range(48) if chunks[i]]
    assert groups == [Group(8192, tuple(chunked[i::3])) for i in range(3)] + [Group(0, tuple(range(3, 48, 4)))]
    # 3 chunked + 1 global (the vLLM tests' model): 4 groups of one layer.
    assert kv_groups([64, 64, 64, 0], [None] * 4) == [Group(64, (0,)), Group(64, (1,)), Group(64, (2,)), Group(0, (3,))]
    # One kind of layer: one group; a KV-sharing layer is in none.
    assert kv_groups([0, 0, 0], [None, None, 0]) == [Group(0, (0, 1))]
    # 12 windowed + 13 global (gpt-oss-20b + eagle, vLLM's own example): groups of 13, no splitting.
    assert [len(g.layers) for g in kv_groups([16] * 12 + [0] * 13, [None] * 25)] == [12, 13]


def test_planes_are_a_layers_place_in_its_group() -> None:
    blocks = KVBlocks([16, 16, 16, 0, 16, 16, 16, 0, 0], [None] * 8 + [7], 64, 4)
    # groups: (0, 4), (1, 5), (2, 6) chunked, (3, 7) global; layer 8 shares layer 7's KV.
    assert [g.layers for g in blocks.groups] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert blocks.planes == [0, 0, 0, 0, 1, 1, 1, 1, 0]
    assert blocks.group_of == [0, 1, 2, 3, 0, 1, 2, 3, 3]


def test_the_architectures_worked_example() -> None:
    """docs/architecture.md's chunk split, C = 4, block size 2: A has 5 tokens and brings 6, B has 7 and brings 1,
    C brings 3: pieces (queries, keys) A (3, 4) and (3, 3), B (1, 4), C (3, 3); each table from its chunk."""
    blocks = KVBlocks([4], [None], 32, 2)
    a, b, c = Request(1, 11, 1), Request(2, 8, 1), Request(3, 3, 1)
    for request, have, new in ((a, 5, 6), (b, 7, 1), (c, 0, 3)):
        assert blocks.allocate(request, 0, have + new)
    rows = blocks.rows(0, [(a, 5, 6), (b, 7, 1), (c, 0, 3)])
    assert rows.starts.tolist() == [0, 3, 6, 7, 10]
    assert rows.seq_lens.tolist() == [4, 3, 4, 3]
    tables = blocks._tables  # the tables the rows must start from
    assert rows.tables.shape == (4, 2)
    assert rows.tables[0].tolist() == tables[a][0][2:4]  # A's chunk at 4: blocks 2, 3
    assert rows.tables[1].tolist() == tables[a][0][4:6]  # A's chunk at 8
    assert rows.tables[2].tolist() == tables[b][0][2:4]
    assert rows.tables[3].tolist() == tables[c][0][0:2]
    expected = [tables[a][0][p // 2] * 2 + p % 2 for p in range(5, 11)] + [tables[b][0][3] * 2 + 1]
    expected += [tables[c][0][p // 2] * 2 + p % 2 for p in range(3)]
    assert rows.slots.tolist() == expected


workloads = st.fixed_dictionaries(
    {
        "lengths": st.lists(st.tuples(st.integers(1, 70), st.integers(1, 12)), min_size=1, max_size=14),
        "chunks": st.sampled_from([[8, 8, 8, 0], [0, 0], [12, 0, 12], [16]]),
        "block_size": st.sampled_from([2, 4]),
        "budget": st.integers(1, 48),
        "max_seqs": st.integers(1, 6),
        "spare": st.integers(0, 60),
        "arrive_every": st.integers(0, 3),
    }
)


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_every_row_reads_its_own_requests_chunk_and_the_engine_plays_by_vllms_rules(w: dict) -> None:  # type: ignore[type-arg]
    chunks, bs = w["chunks"], w["block_size"]
    probe = KVBlocks(chunks, [None] * len(chunks), 2, bs)
    longest = max(p + o for p, o in w["lengths"])
    num_blocks = probe.blocks_for(longest, w["budget"]) + 1 + w["spare"]
    blocks = KVBlocks(chunks, [None] * len(chunks), num_blocks, bs)
    sched = Scheduler(blocks, w["budget"], w["max_seqs"])
    requests = [Request(i, p, o) for i, (p, o) in enumerate(w["lengths"])]
    pending = list(requests)
    written: list[dict[int, tuple[int, int]]] = [{} for _ in blocks.groups]  # group -> slot -> (request, position)
    forward = {r.id: 0 for r in requests}
    finished: list[Request] = []
    steps = 0
    while pending or not sched.idle:
        for _ in range(1 if w["arrive_every"] else len(pending)):  # some arrive as the engine runs
            if pending and (not w["arrive_every"] or steps % w["arrive_every"] == 0):
                sched.add(pending.pop(0))
        step = sched.schedule()
        steps += 1
        assert steps < 10_000
        if not step:
            assert sched.idle, "a request that fits alone must be scheduled"
            assert pending
            continue
        _a_good_step(sched, step, w, forward)
        _step_reads_its_chunks(blocks, step, written)
        finished += sched.finish(step)
    assert sorted(r.id for r in finished) == [r.id for r in requests]
    for r in requests:
        assert r.generated == r.output_len
        # P + O - 1 tokens of forward passes, and a preempted request's recomputation on top
        assert forward[r.id] >= r.prompt_len + r.output_len - 1
        assert r.preemptions or forward[r.id] == r.prompt_len + r.output_len - 1
    assert blocks.free_blocks == num_blocks - 1  # every block back; block 0 never handed out


def _a_good_step(sched: Scheduler, step: list[Scheduled], w: dict[str, Any], forward: dict[int, int]) -> None:
    """Within the budget and the seats, each request once, each part within the tokens it has; ``forward``
    counts each request's tokens of forward passes."""
    assert sum(s.num_tokens for s in step) <= w["budget"]
    assert len(sched.running) <= w["max_seqs"]
    assert len({s.request.id for s in step}) == len(step)
    for s in step:
        assert s.num_tokens >= 1
        assert s.position + s.num_tokens <= s.request.tokens
        forward[s.request.id] += s.num_tokens


def _step_reads_its_chunks(blocks: KVBlocks, step: list[Scheduled], written: list[dict[int, tuple[int, int]]]) -> None:
    """No block held twice; each group's rows of ``step`` write their tokens' slots into the fake cache
    ``written`` (group -> slot -> (request, position)) and read exactly their request's chunk from it."""
    _no_block_held_twice(blocks)
    entries = [(s.request, s.position, s.num_tokens) for s in step]
    for g, group in enumerate(blocks.groups):
        rows = blocks.rows(g, entries)
        assert rows.num_tokens == len(rows.slots) == sum(s.num_tokens for s in step)
        t = 0
        for s in step:  # the new tokens' K/V go to the request's slots
            for p in range(s.position, s.position + s.num_tokens):
                written[g][int(rows.slots[t])] = (s.request.id, p)
                t += 1
        _rows_read_their_chunk(rows, step, group.chunk_size, blocks.block_size, written[g])


def _no_block_held_twice(blocks: KVBlocks) -> None:
    held = [b for tables in blocks._tables.values() for table in tables for b in table if b != NULL_BLOCK]
    assert len(held) == len(set(held))
    assert NULL_BLOCK not in blocks._free
    assert not set(held) & set(blocks._free)


def _rows_read_their_chunk(rows, step, chunk: int, bs: int, written: dict[int, tuple[int, int]]) -> None:
    """Each row's keys, through its table, are its request's positions from its chunk's start (0 for a global
    layer) to its last new token, as the fake cache recorded them."""
    r = 0
    for s in step:
        start, end = s.position, s.position + s.num_tokens
        while start < end:
            first_key = start // chunk * chunk if chunk else 0
            stop = min(end, first_key + chunk) if chunk else end
            assert int(rows.starts[r + 1] - rows.starts[r]) == stop - start
            assert int(rows.seq_lens[r]) == stop - first_key
            for j in range(stop - first_key):
                slot = int(rows.tables[r, j // bs]) * bs + j % bs
                assert rows.tables[r, j // bs] != NULL_BLOCK
                assert written[slot] == (s.request.id, first_key + j), (r, j)
            r += 1
            start = stop
    assert r == len(rows.seq_lens)
    assert rows.tables.shape[1] == -(-int(rows.seq_lens.max()) // bs)


def test_preemption_frees_the_last_admitted_and_recomputes_it() -> None:
    """Two requests that cannot both grow in a small space: the one admitted last is preempted (its blocks back,
    to the queue's front) and later recomputed from its first token, the tokens it generated included."""
    blocks = KVBlocks([0], [None], 1 + 6, 4)  # 6 usable blocks: 24 tokens
    sched = Scheduler(blocks, 64, 8)
    a, b = Request(1, 8, 9), Request(2, 8, 9)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [(s.request.id, s.position, s.num_tokens) for s in step] == [(1, 0, 8), (2, 0, 8)]
    sched.finish(step)
    preempted_at = None
    for n in range(40):
        step = sched.schedule()
        if sched.preempted:
            preempted_at = n
            assert sched.preempted == [b]
            assert b.computed == 0
            assert sched.waiting[0] is b
            assert [s.request.id for s in step] == [1]
            break
        sched.finish(step)
    assert preempted_at is not None
    tokens_b_had = b.tokens
    while not sched.idle:
        step = sched.schedule()
        for s in step:
            if s.request is b and s.position == 0:
                assert s.num_tokens == tokens_b_had  # its prompt and what it had generated, recomputed
        sched.finish(step)
    assert a.done
    assert b.done
    assert b.preemptions == 1


def test_the_block_reference_over_an_engines_rows_equals_the_sequence_reference() -> None:
    """Requests run by the scheduler through KVBlocks' rows (chunked layers as virtual batches) into
    ``BlockReference`` give, call for call, what ``ReferenceModel`` gives for the same tokens as sequences: the
    rows carry the chunked-local predicate exactly, and the block reference reads back what was stored."""
    chunks = [8, 0, 8]
    info = ServerInfo(
        version="", backend="", device="", num_heads=4, num_kv_heads=2, head_size=8,
        layers=tuple(
            LayerInfo(index=i, chunk_size=c, kv_group=0, kv_source=None, scale=0.3, alibi=i == 2,
                      alibi_slopes=(0.5, 0.25, 0.1, 0.05) if i == 2 else ())
            for i, c in enumerate(chunks)
        ),
        block_size=2, num_blocks=0, free_blocks=0, bytes_per_block=0, cache_dtype="float32", dtypes=("float32",),
        active_sequences=0, max_message_bytes=1 << 20,
    )  # fmt: skip
    blocks = KVBlocks(chunks, [None] * 3, 200, 2)
    sched = Scheduler(blocks, 13, 3)
    for i, (p, o) in enumerate([(21, 3), (5, 6), (17, 1), (30, 2)]):
        sched.add(Request(i, p, o))
    by_slots, by_sequences = BlockReference(info), ReferenceModel.for_server(info)
    rng = np.random.default_rng(0)
    while not sched.idle:
        step = sched.schedule()
        entries = [(s.request, s.position, s.num_tokens) for s in step]
        n = sum(s.num_tokens for s in step)
        for layer in range(3):
            rows = blocks.rows(blocks.group_of[layer], entries)
            q, k, v = rng.standard_normal((n, 4, 8)), rng.standard_normal((n, 2, 8)), rng.standard_normal((n, 2, 8))
            got = by_slots.attend(layer, BlockRows("s", rows.slots, rows.starts, rows.seq_lens, rows.tables), q, k, v)
            batch = [BatchEntry(str(s.request.id), s.position, s.num_tokens) for s in step]
            np.testing.assert_allclose(got, by_sequences.attend(layer, batch, q, k, v), rtol=1e-12, atol=1e-12)
        for request in sched.finish(step):
            by_sequences.release(str(request.id))
