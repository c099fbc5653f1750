"""The engine as a state machine: random calls on random layers, releases, exports and imports, a pool small
enough to run out.

After every step: outputs match the reference; the pool's accounting is exact (free + used = total, no
block owned twice, every used block owned); each sequence's KV groups hold exactly the blocks their
layers still need, computed here from the spec; in-step chunked groups hold at most C / block_size
blocks. A refused call (out of blocks, a KV-sharing layer ahead of its source) changes nothing.

Isolation: after every step every free block, in every plane, is filled with NaN, as if the sequences that
held it had written NaN. A sequence that ever read a byte it did not write (attention over a position it
never stored, a block handed over with an earlier holder's data) would give NaN or disagree with the
reference; an export that carried such a byte would carry a NaN. Neither happens, in the engine or in a
second engine that imports the exports.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chunkattn_client import BatchEntry
from chunkattn_server import Engine, ModelShape
from chunkattn_server.errors import InvalidBatch, OutOfBlocks, PositionMismatch
from tests.helpers.harness import MODELS, Harness, snapshot
from tests.helpers.invariants import assert_no_nan, poison

IDS = ["s0", "s1", "s2", "s3"]
BS = 4


def spec_needed_blocks(
    model: ModelShape, group_layers: tuple[int, ...], sharers: tuple[int, ...], lengths: tuple[int, ...], chunk: int
) -> set[int]:
    """From the spec: a layer needs the positions of its current chunk it has written (a sharer: its
    source's); a global group needs everything written."""

    def start(n: int) -> int:
        return n - n % chunk if chunk else 0

    spans = [(start(lengths[i]), lengths[i]) for i in group_layers]
    for s in sharers:
        src = model.layers[s].kv_source
        assert src is not None
        spans.append((start(lengths[s]), lengths[src]))
    return {b for lo, hi in spans for b in range(lo // BS, -(-hi // BS)) if hi > lo}


class EngineMachine(RuleBasedStateMachine):
    model_name = "gqa"

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness.build(MODELS[self.model_name], num_blocks=40, block_size=BS)
        self.model = self.h.model
        self.lengths: dict[str, list[int]] = {}
        self.dst = Engine(self.h.engine.config, backend=self.h.engine.backend)  # imports land here
        self.imported = 0
        poison(self.h.engine)
        poison(self.dst)

    def _entries(self, layer: int, picks: list[tuple[str, int]]) -> list[BatchEntry]:
        return [BatchEntry(s, self.lengths.get(s, [0] * self.model.num_layers)[layer], n) for s, n in picks]

    def _call(self, layer: int, picks: list[tuple[str, int]]) -> bool:
        entries = self._entries(layer, picks)
        before = snapshot(self.h.engine)
        source = self.model.layers[layer].kv_source
        ahead = source is not None and any(
            e.position + e.num_tokens > self.lengths.get(e.seq_id, [0] * self.model.num_layers)[source] for e in entries
        )
        try:
            self.h.call(layer, entries)
            poison(self.h.engine)
        except PositionMismatch:
            assert ahead, "refused a call whose positions were right"
            assert snapshot(self.h.engine) == before
            return False
        except OutOfBlocks:
            assert not ahead, "a KV-sharing layer ahead of its source must be refused as such"
            assert snapshot(self.h.engine) == before
            return False
        assert not ahead
        for e in entries:
            self.lengths.setdefault(e.seq_id, [0] * self.model.num_layers)[layer] += e.num_tokens
        return True

    picks = st.lists(
        st.tuples(st.sampled_from(IDS), st.one_of(st.just(1), st.integers(1, 20))),
        min_size=1,
        max_size=3,
        unique_by=lambda p: p[0],
    )

    @rule(layer=st.integers(0, 5), picks=picks)
    def one_layer(self, layer: int, picks: list[tuple[str, int]]) -> None:
        """Layers out of step: a lagging or a leading layer."""
        self._call(layer % self.model.num_layers, picks)

    @rule(picks=picks)
    def model_step(self, picks: list[tuple[str, int]]) -> None:
        """Only sequences whose layers are in step, through every layer, as a model runner does."""
        picks = [(s, n) for s, n in picks if len(set(self.lengths.get(s, [0]))) == 1]
        for layer in range(self.model.num_layers):
            if picks and not self._call(layer, picks):
                break

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        self.h.release(seq)
        del self.lengths[seq]
        poison(self.h.engine)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def export_then_import_then_decode(self, data: st.DataObject) -> None:
        """Export (every layer, or some), import into the second engine, export from there, decode there."""
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        layers = data.draw(st.one_of(st.none(), st.sets(st.integers(0, self.model.num_layers - 1), min_size=1)))
        try:
            manifest = self.h.engine.transfer.export_manifest(
                seq, None if layers is None else sorted(layers), tenant=""
            )
        except InvalidBatch:  # a KV-sharing layer without its source, or a source without its sharers
            return
        records = [v.copy() for v in self.h.engine.transfer.export_views(manifest, manifest.expected())]
        assert_no_nan(records)
        self.imported += 1
        new = f"imported-{self.imported}"
        try:
            session = self.dst.transfer.begin_import(dataclasses.replace(manifest, seq_id=new), tenant="")
        except OutOfBlocks:
            return
        self.dst.transfer.import_records(session, records)
        self.dst.transfer.commit_import(session)
        poison(self.dst)
        again = self.dst.transfer.export_manifest(new, None if layers is None else sorted(layers), tenant="")
        assert_no_nan([v.copy() for v in self.dst.transfer.export_views(again, again.expected())])
        lengths = self.dst.kv.sequence(new, tenant="").lengths
        for layer in range(self.model.num_layers):  # one more token in every layer that can take one
            q, k, v = self.h.tensors(layer, 1)
            source = self.model.layers[layer].kv_source
            if source is not None and lengths[layer] + 1 > self.dst.kv.sequence(new, tenant="").lengths[source]:
                continue
            try:
                out = self.dst.attend(layer, [BatchEntry(new, lengths[layer], 1)], q, k, v, tenant="")
            except OutOfBlocks:
                continue
            assert torch.isfinite(out).all(), f"layer {layer} of an imported sequence read a byte it never wrote"
            poison(self.dst)
        self.dst.kv.release([new], tenant="")
        poison(self.dst)

    @invariant()
    def pool_accounting_is_exact(self) -> None:
        engine = self.h.engine
        owned = [
            b
            for s in engine.kv.sequence_ids(tenant="")
            for t in engine.kv.sequence(s, tenant="").tables
            for b in t.values()
        ]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        pool = engine.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert set(owned) == {b for b in range(pool.num_blocks) if not pool.is_free(b)}

    @invariant()
    def groups_hold_exactly_what_their_layers_need(self) -> None:
        engine = self.h.engine
        assert sorted(engine.kv.sequence_ids(tenant="")) == sorted(self.lengths)
        for seq, lengths in self.lengths.items():
            info = engine.kv.sequence(seq, tenant="")
            assert list(info.lengths) == lengths
            for group in engine.groups:
                needed = spec_needed_blocks(self.model, group.layers, group.sharers, info.lengths, group.chunk_size)
                assert set(info.tables[group.index]) == needed, (seq, group, info)
                members = [*group.layers, *group.sharers]
                if group.chunk_size and len({lengths[i] for i in members}) == 1:
                    assert len(info.tables[group.index]) <= group.chunk_size // BS


class SharingMachine(EngineMachine):
    model_name = "sharing"


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=60, stateful_step_count=25)
TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(max_examples=60, stateful_step_count=25)


@pytest.mark.parametrize("model", ["gqa", "sharing"])
def test_machine_smoke_runs(model: str) -> None:
    """A fixed run of the machine, readable as a story, so a regression shows a short trace."""
    machine = SharingMachine() if model == "sharing" else EngineMachine()
    machine.model_step([("s0", 13), ("s1", 1)])
    machine.one_layer(0, [("s0", 5)])
    machine.model_step([("s1", 20)])
    machine.pool_accounting_is_exact()
    machine.groups_hold_exactly_what_their_layers_need()
