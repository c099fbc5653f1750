"""Truncate: a sequence goes back to its first L tokens in every layer (speculative decoding's rollback).

The spec, restated here from the docs rather than from the code: a chunked layer of chunk size C keeps, of a
sequence of n tokens, the positions from chunk_start(max(0, n - K)) on (K: --spec-window), and what it has
dropped never comes back. Truncating to L is allowed when every chunked layer that gets shorter either still
holds what it reads again, [chunk_start(L), L), or reads nothing (L a multiple of C); any other L (or one
past the sequence's length) is refused and changes nothing. So right after a call at position p, any
L >= max(p, n - K) is allowed: a verify call of up to K + 1 tokens can always drop its drafts. After a
truncation every output equals the float64 reference of the kept tokens plus the new ones, and the pool
counts exactly the blocks the sequences still hold.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from chunkattn_client import BatchEntry
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_server import Engine, LayerSpec, ModelShape
from chunkattn_server.errors import InvalidBatch, PositionMismatch, SequenceChanged, UnknownSequence
from chunkattn_server.kv.manifest import KVManifest, batches
from chunkattn_server.service import kvwire
from tests.helpers.harness import Harness, snapshot
from tests.helpers.invariants import assert_no_nan, owners_are_exact, poison

BS = 4
# A chunked layer (C = 8), a layer that reads its KV (KV sharing), a global layer, and a chunked layer of another
# chunk size (C = 16), so that a chunk boundary of one is not always one of the other.
MODEL = ModelShape(
    num_heads=4,
    num_kv_heads=2,
    head_size=8,
    layers=(LayerSpec(8), LayerSpec(8, kv_source=0), LayerSpec(0), LayerSpec(16)),
)
CHUNKED = {0: 8, 3: 16}  # the chunked layers with a cache of their own, and their chunk sizes
GLOBAL = 2
MAX_LEN = 64
IDS = ["a", "b", "c"]


def chunk_start(n: int, c: int) -> int:
    return n - n % c


def blocks(lo: int, hi: int) -> set[int]:
    """The logical blocks that hold positions [lo, hi)."""
    return set(range(lo // BS, -(-hi // BS))) if hi > lo else set()


@dataclass
class Spec:
    """One sequence as the spec sees it: its length (its layers in step) and, per chunked layer, the first
    position it still holds."""

    window: int
    length: int = 0
    held_from: dict[int, int] = field(default_factory=lambda: dict.fromkeys(CHUNKED, 0))
    last_call: int = 0  # the position of the last call (or of the last truncation)

    def grow(self, n: int) -> None:
        self.last_call = self.length
        self.length += n
        for layer, c in CHUNKED.items():
            self.held_from[layer] = max(self.held_from[layer], chunk_start(max(0, self.length - self.window), c))

    def allows(self, length: int) -> bool:
        if not 0 <= length <= self.length:
            return False
        return length == self.length or all(
            length % c == 0 or chunk_start(length, c) >= self.held_from[layer] for layer, c in CHUNKED.items()
        )

    def min_length(self) -> int:
        """The shortest m such that every length in [m, length] is allowed (by search, not by formula)."""
        m = self.length
        while m > 0 and self.allows(m - 1):
            m -= 1
        return m

    def truncate(self, length: int) -> None:
        self.length = self.last_call = length
        for layer in CHUNKED:
            self.held_from[layer] = min(self.held_from[layer], length)

    def expected_tables(self, engine: Engine) -> dict[int, set[int]]:
        """Per KV group index: the logical blocks it must hold."""
        group = {layer: engine.kv.group_of[layer].index for layer in range(MODEL.num_layers)}
        out = {group[GLOBAL]: blocks(0, self.length)}
        for layer in CHUNKED:
            out[group[layer]] = blocks(self.held_from[layer], self.length)
        return out


def build(window: int, num_blocks: int = 128, impl: str = "auto") -> Harness:
    return Harness.build(MODEL, num_blocks=num_blocks, block_size=BS, spec_window=window, impl=impl)


def held_blocks(engine: Engine, seq_id: str) -> int:
    return engine.kv.sequence(seq_id, tenant="").num_blocks


class TruncateMachine(RuleBasedStateMachine):
    """Random prefills, decodes, verify calls (K + 1 tokens, then the rejected drafts truncated), truncations,
    forks, releases and export/import round trips, every output checked against the reference."""

    window = 0

    def __init__(self) -> None:
        super().__init__()
        self.h = build(self.window)
        self.seqs: dict[str, Spec] = {}
        dst = Engine(self.h.engine.config, backend=self.h.engine.backend)  # imports land here
        self.dst = Harness(dst, self.h.reference, self.h.dtype, self.h.cache_dtype)
        self.imported = 0
        poison(self.h.engine)
        poison(dst)

    def _step(self, seq: str, n: int) -> None:
        spec = self.seqs.setdefault(seq, Spec(self.window))
        self.h.step([BatchEntry(seq, spec.length, n)])  # every layer, each output against the reference
        spec.grow(n)
        poison(self.h.engine)

    def _truncate(self, seq: str, length: int) -> None:
        spec = self.seqs[seq]
        allowed = spec.allows(length)
        if max(spec.last_call, spec.length - self.window) <= length <= spec.length:
            assert allowed, "the window's promise: right after a call, any length from max(its position, len - K) on"
        before, held = snapshot(self.h.engine), held_blocks(self.h.engine, seq)
        if not allowed:  # refused, naming how far back it may go, and nothing changed
            with pytest.raises(PositionMismatch) as refusal:
                self.h.engine.kv.truncate(seq, length, tenant="")
            event("truncation refused")
            assert snapshot(self.h.engine) == before, "a refused truncation changed something"
            if length <= spec.length:
                assert f"min_length={spec.min_length()} " in str(refusal.value)
            return
        done = self.h.truncate(seq, length)  # an allowed one that is refused raises here
        event("truncation done" if length < spec.length else "truncation to the same length")
        dropped = spec.length - length
        spec.truncate(length)
        assert done.min_length == spec.min_length()
        assert done.dropped_tokens == dropped
        assert done.released_blocks == held - held_blocks(self.h.engine, seq)
        poison(self.h.engine)

    @initialize(seq=st.sampled_from(IDS), n=st.integers(1, 20))
    def first_prefill(self, seq: str, n: int) -> None:
        self._step(seq, n)

    @rule(seq=st.sampled_from(IDS), n=st.integers(1, 20))
    def prefill(self, seq: str, n: int) -> None:
        if self.seqs.get(seq, Spec(self.window)).length + n <= MAX_LEN:
            self._step(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        if self.seqs[seq].length < MAX_LEN:
            self._step(seq, 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), drafts=st.integers(1, 6))
    def verify(self, data: st.DataObject, drafts: int) -> None:
        """Speculative decoding: the last accepted token and ``drafts`` drafts in one call, then the rejected
        drafts dropped (a verify of more drafts than the window may be refused: then nothing changes)."""
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        position = self.seqs[seq].length
        if position + drafts + 1 > MAX_LEN:
            return
        accepted = data.draw(st.integers(0, drafts))
        self._step(seq, drafts + 1)
        self._truncate(seq, position + 1 + accepted)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        self._truncate(seq, data.draw(st.integers(0, self.seqs[seq].length + 2)))

    @precondition(lambda self: self.seqs and len(self.seqs) < len(IDS))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child = data.draw(st.sampled_from([s for s in IDS if s not in self.seqs]))
        self.h.engine.kv.fork(parent, child, tenant="")
        self.h.reference.fork(parent, child)
        self.seqs[child] = dataclasses.replace(self.seqs[parent], held_from=dict(self.seqs[parent].held_from))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        self.h.release(seq)
        del self.seqs[seq]
        poison(self.h.engine)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def export_import_decode_truncate(self, data: st.DataObject) -> None:
        """Export (records carry exactly the positions held, never a NaN), import into a second engine, decode
        there, and truncate there exactly as the spec allows."""
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        spec = self.seqs[seq]
        self.imported += 1
        new = f"imported-{self.imported}"
        move(self.h.engine, self.dst.engine, seq, new)
        assert (
            self.dst.engine.kv.sequence(new, tenant="").kept_from == self.h.engine.kv.sequence(seq, tenant="").kept_from
        )
        self.h.reference.fork(seq, new)
        there = dataclasses.replace(spec, held_from=dict(spec.held_from))
        if there.length < MAX_LEN:
            self.dst.step([BatchEntry(new, there.length, 1)])
            there.grow(1)
        length = data.draw(st.integers(0, there.length))
        try:
            self.dst.engine.kv.truncate(new, length, tenant="")
        except PositionMismatch:
            assert not there.allows(length)
        else:
            assert there.allows(length)
        self.dst.release(new)
        assert self.dst.engine.pool.num_free == self.dst.engine.pool.num_blocks
        poison(self.dst.engine)

    @invariant()
    def pool_accounting_is_exact(self) -> None:
        pool = self.h.engine.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        owners_are_exact(self.h.engine)  # used == distinct blocks held; each block's owners == tables holding it

    @invariant()
    def tables_hold_exactly_what_the_spec_keeps(self) -> None:
        engine = self.h.engine
        assert sorted(engine.kv.sequence_ids(tenant="")) == sorted(self.seqs)
        for seq, spec in self.seqs.items():
            info = engine.kv.sequence(seq, tenant="")
            assert info.lengths == (spec.length,) * MODEL.num_layers
            for group, expected in spec.expected_tables(engine).items():
                assert set(info.tables[group]) == expected, (seq, spec, info)
            for layer, c in CHUNKED.items():  # the bound of docs/server.md
                group = engine.kv.group_of[layer].index
                assert len(info.tables[group]) <= -(-(c + self.window - 1) // BS)


class WindowMachine(TruncateMachine):
    window = 5  # more than a block, less than a chunk


TestTruncateMachine = TruncateMachine.TestCase
TestTruncateMachine.settings = settings(max_examples=40, stateful_step_count=30)
TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=40, stateful_step_count=30)


def move(src: Engine, dst: Engine, seq_id: str, new_id: str) -> KVManifest:
    """Export ``seq_id`` from src and import it into dst as ``new_id``, a few records at a time."""
    manifest = src.transfer.export_manifest(seq_id, tenant="")
    session = dst.transfer.begin_import(dataclasses.replace(manifest, seq_id=new_id), tenant="")
    try:
        for batch in batches(manifest.expected(), 3):
            records = [r.copy() for r in src.transfer.export_views(manifest, batch)]
            assert_no_nan(records)
            dst.transfer.import_records(session, records)
        dst.transfer.commit_import(session)
    finally:
        dst.transfer.abort_import(session)
    return manifest


# -- worked examples --------------------------------------------------------------------------------------


def test_the_worked_example_of_the_retention_docstring() -> None:
    """C = 8, blocks of 4, K = 3 (kv/sequences.py): a verify call of 4 tokens at 14, then rollbacks."""
    h = Harness.build(ModelShape(4, 2, 8, (LayerSpec(8),)), block_size=BS, spec_window=3)
    h.step([BatchEntry("s", 0, 14)])
    h.step([BatchEntry("s", 14, 4)])  # len 18: kept from chunk_start(15) = 8
    assert set(h.engine.kv.sequence("s", tenant="").tables[0]) == {2, 3, 4}
    before = snapshot(h.engine)
    with pytest.raises(
        PositionMismatch, match=r"to 7 tokens: layer 0 .* from 0 on again.* from 8 on only.*min_length=8"
    ):
        h.engine.kv.truncate("s", 7, tenant="")
    assert snapshot(h.engine) == before
    done = h.truncate("s", 15)  # one draft accepted: block 4 (16, 17) goes
    assert (done.released_blocks, done.dropped_tokens, done.min_length) == (1, 3, 8)
    for position in range(15, 19):
        h.step([BatchEntry("s", position, 1)])
    assert set(h.engine.kv.sequence("s", tenant="").tables[0]) == {4}  # len 19: kept from chunk_start(16) = 16
    assert h.truncate("s", 8).released_blocks == 1  # a chunk boundary: reads nothing older
    h.truncate("s", 0)
    assert h.engine.pool.num_free == h.engine.pool.num_blocks
    h.step([BatchEntry("s", 0, 3)])  # an empty sequence starts again from 0


def test_without_a_window_a_verify_across_a_boundary_cannot_roll_back_and_says_how_far_it_may() -> None:
    h = build(0)
    h.step([BatchEntry("s", 0, 14)])
    h.step([BatchEntry("s", 14, 4)])  # crosses 16: the C = 8 and C = 16 layers keep 16.. only
    with pytest.raises(PositionMismatch, match=r"min_length=16 .*0 is the nearest"):
        h.engine.kv.truncate("s", 15, tenant="")
    h.truncate("s", 16)  # the boundary itself needs no older keys
    h.step([BatchEntry("s", 16, 1)])


@pytest.mark.parametrize("window", [0, 1, 3, 4, 5, 8, 12, 20])
def test_a_chunked_group_holds_at_most_ceil_c_plus_k_over_block_size_blocks(window: int) -> None:
    """The bound of docs/server.md, exactly: the range kept starts at a multiple of C and spans at most
    C - 1 + K positions, so ceil((C + K - 1) / block_size) <= ceil((C + K) / block_size); it is reached."""
    h = build(window, num_blocks=256)
    most = Counter[int]()
    h.step([BatchEntry("s", 0, 1)])
    for position in range(1, 60):
        h.step([BatchEntry("s", position, 1)])
        info = h.engine.kv.sequence("s", tenant="")
        for layer in CHUNKED:
            group = h.engine.kv.group_of[layer].index
            most[layer] = max(most[layer], len(info.tables[group]))
    for layer, c in CHUNKED.items():
        assert most[layer] == -(-(c + window - 1) // BS) <= -(-(c + window) // BS), (layer, most)


def test_k_zero_keeps_exactly_what_it_kept_before() -> None:
    """--spec-window 0 is the retention of a server without it: the current chunk only."""
    h = build(0)
    for n in (3, 14, 1, 1, 9):
        before = h.engine.kv.sequence("s", tenant="").lengths[0] if "s" in h.engine.kv.sequence_ids(tenant="") else 0
        h.step([BatchEntry("s", before, n)])
        length = before + n
        info = h.engine.kv.sequence("s", tenant="")
        for layer, c in CHUNKED.items():
            assert set(info.tables[h.engine.kv.group_of[layer].index]) == blocks(chunk_start(length, c), length)


def test_errors_change_nothing() -> None:
    h = build(3)
    h.step([BatchEntry("s", 0, 10)])
    before = snapshot(h.engine)
    with pytest.raises(UnknownSequence, match="'nope'"):
        h.engine.kv.truncate("nope", 1, tenant="")
    with pytest.raises(UnknownSequence, match="'s'"):
        h.engine.kv.truncate("s", 1, tenant="someone-else")
    with pytest.raises(InvalidBatch, match="from 0 to 2147483647, got -1"):
        h.engine.kv.truncate("s", -1, tenant="")
    with pytest.raises(InvalidBatch, match="got 2147483648"):
        h.engine.kv.truncate("s", 2**31, tenant="")
    with pytest.raises(InvalidBatch, match="non-empty"):
        h.engine.kv.truncate("", 1, tenant="")
    with pytest.raises(PositionMismatch, match="to 11 tokens: it has 10; truncation only drops tokens"):
        h.engine.kv.truncate("s", 11, tenant="")
    assert snapshot(h.engine) == before
    done = h.engine.kv.truncate("s", 10, tenant="")  # a no-op
    assert (done.released_blocks, done.dropped_tokens) == (0, 0)
    assert snapshot(h.engine) == before


def test_a_lagging_layer_keeps_its_length_and_a_sharer_its_source_keys() -> None:
    """Layers out of step: every layer becomes min(its length, L), and a KV-sharing layer that lags still
    finds its chunk in its source's cache."""
    h = build(0)
    h.step([BatchEntry("s", 0, 12)])
    h.call(0, [BatchEntry("s", 12, 6)])  # layer 0 at 18; its sharer (layer 1) still at 12: kept from 8
    h.truncate("s", 14)
    assert h.engine.kv.sequence("s", tenant="").lengths == (14, 12, 12, 12)
    h.call(0, [BatchEntry("s", 14, 1)])
    h.call(1, [BatchEntry("s", 12, 3)])  # the sharer reads 8..14 of layer 0's cache
    with pytest.raises(PositionMismatch, match=r"layer 0 .* from 0 on again.*min_length=8 "):
        h.engine.kv.truncate("s", 7, tenant="")  # layers 0 and 1 would read 0..6 of layer 0's cache, long gone


@pytest.mark.parametrize("impl", ["auto", "triton"])  # the triton kernels under the interpreter too
def test_a_forks_truncation_drops_its_own_ownership_only_and_writes_copy(impl: str) -> None:
    h = build(3, impl=impl)
    h.step([BatchEntry("p", 0, 14)])
    h.engine.kv.fork("p", "c", tenant="")
    h.reference.fork("p", "c")
    used, parent = h.engine.pool.num_used, h.engine.kv.sequence("p", tenant="")
    done = h.truncate("c", 9)  # c drops the blocks past 9 (shared: p keeps them)
    assert done.released_blocks > 0
    assert h.engine.pool.num_used == used  # every block is still p's
    assert h.engine.kv.sequence("p", tenant="") == parent
    owners_are_exact(h.engine)
    h.step([BatchEntry("c", 9, 1)])  # into the shared block 2 (positions 8..11): a copy
    assert h.engine.pool.num_used > used
    owners_are_exact(h.engine)
    for i in range(14, 20):  # the parent's K/V is intact: it still matches the reference
        h.step([BatchEntry("p", i, 1)])
    h.release("p")
    for i in range(10, 20):
        h.step([BatchEntry("c", i, 1)])
    h.release("c")
    assert h.engine.pool.num_free == h.engine.pool.num_blocks


# -- KV transfer --------------------------------------------------------------------------------------------


def test_an_export_sends_exactly_the_positions_held_with_a_window_and_after_a_truncation() -> None:
    src = build(5)
    src.step([BatchEntry("s", 0, 18)])  # kept from chunk_start(13) = 8 in the C = 8 layer: more than its chunk
    src.truncate("s", 17)
    manifest = src.engine.transfer.export_manifest("s", tenant="")
    assert manifest.kept_from == (8, 0, 0, 0)
    _, header = kvwire.decode(kvwire.encode_header(manifest))  # kept_from goes through the wire
    assert isinstance(header, pb.KVHeader)
    assert kvwire.manifest_from_pb(header, "") == dataclasses.replace(manifest, truncations=0)
    dst = Harness(Engine(src.engine.config, backend=src.engine.backend), src.reference, "float32", "float32")
    poison(dst.engine)
    move(src.engine, dst.engine, "s", "t")
    src.reference.fork("s", "t")
    assert [set(t) for t in dst.engine.kv.sequence("t", tenant="").tables] == [
        set(t) for t in src.engine.kv.sequence("s", tenant="").tables
    ]
    dst.truncate("t", 13)  # the window goes with it: 13 reads 8..12, which came along
    for position in range(13, 20):
        dst.step([BatchEntry("t", position, 1)])


def test_an_importer_with_a_smaller_window_takes_the_stream_and_trims_at_its_next_call() -> None:
    src, dst = build(5), build(0)
    src.step([BatchEntry("s", 0, 18)])
    move(src.engine, dst.engine, "s", "s")
    dst.reference = src.reference  # the history of "s"
    group = dst.engine.kv.group_of[0].index
    assert set(dst.engine.kv.sequence("s", tenant="").tables[group]) == {2, 3, 4}  # as exported: 8..17
    dst.step([BatchEntry("s", 18, 1)])
    assert set(dst.engine.kv.sequence("s", tenant="").tables[group]) == {4}  # its own rule now: 16..18


def test_a_truncation_between_export_batches_is_reported_even_when_the_lengths_come_back() -> None:
    h = build(3)
    h.step([BatchEntry("s", 0, 10)])
    manifest = h.engine.transfer.export_manifest("s", tenant="")
    h.truncate("s", 9)
    h.step([BatchEntry("s", 9, 1)])  # the same lengths again, other K/V
    assert h.engine.kv.sequence("s", tenant="").lengths == manifest.lengths
    with pytest.raises(SequenceChanged, match="export it again"):
        h.engine.transfer.export_views(manifest, manifest.expected()[:1])
