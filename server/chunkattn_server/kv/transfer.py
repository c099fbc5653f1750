"""A sequence's live KV leaving one engine and entering another (no protobuf here; what an export is, as
data, is kv/manifest.py). Only live blocks exist to be sent: a
chunked group holds its current chunk (and --spec-window tokens before it), a global group everything,
so a 128K-token prompt with C = 8192 sends at most 8K tokens' worth for each chunked layer.

An import is a session (``KVExchange``): ``begin_import`` checks the manifest against this engine (model, free id, free
blocks) and reserves every block; ``import_records`` checks each record (expected, not seen, checksum) and writes it;
``commit_import`` checks that every expected record arrived and only then makes the sequence visible.
``abort_import`` (or any failure) returns every reserved block: a broken stream leaves nothing behind.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from chunkattn_client import dtypes
from chunkattn_client.limits import MAX_TOKENS, QUOTE_IDS, id_problem, quote, some
from chunkattn_server.errors import (
    DataLoss,
    IncompatibleKV,
    InvalidBatch,
    OutOfBlocks,
    SequenceChanged,
    SequenceExists,
    UnknownSequence,
)
from chunkattn_server.kv.manifest import BlockRecord, BlockView, KVManifest, ModelFingerprint, masked, record_bytes
from chunkattn_server.kv.scales import KVScaleTable
from chunkattn_server.kv.sequences import SequenceState

if TYPE_CHECKING:
    from chunkattn_server.kv.cache import KVCache
    from chunkattn_server.kv.manager import KVManager

# -- the protocol on one engine: export and import sessions ---------------------------------------------


@dataclass
class ImportSession:
    """An import in progress: its reserved blocks (per KV group), the records expected and received."""

    manifest: KVManifest
    tables: list[dict[int, int]]
    expected: set[tuple[int, int]]
    tenant: str  # whose sequence it becomes
    received: set[tuple[int, int]] = field(default_factory=set)
    committed: bool = False
    aborted: bool = False


class KVExchange:
    """Exports and imports of one engine's sequences: ``kv`` holds their state, ``cache`` their pages;
    ``plane_of[layer]`` is the layer's plane (its pages' storage) in its KV group, ``fingerprint`` the engine's model;
    ``scales`` the cache's scale table (the engine's own: an import into a calibrating layer gives it the
    stream's scales, as its first write would have); ``held``: the largest |k| and |v| the cache gives back
    finite in the compute dtype (torchtypes.storable).

    Runs on the engine's thread, like everything that touches the KV."""

    def __init__(
        self,
        kv: KVManager,
        cache: KVCache,
        plane_of: Sequence[int],
        fingerprint: ModelFingerprint,
        scales: KVScaleTable,
        held: float = math.inf,
    ) -> None:
        self._kv = kv
        self._cache = cache
        self._plane_of = plane_of
        self._model = kv.config.model
        self.fingerprint = fingerprint
        self._scales = scales
        self._held = held  # the largest |k|, |v| the cache gives back finite in the compute dtype

    def export_manifest(self, seq_id: str, layers: Sequence[int] | None = None, *, tenant: str) -> KVManifest:
        """What an export of ``tenant``'s ``seq_id`` (every layer, or ``layers``) sends. Raises UnknownSequence,
        UnknownLayer, or InvalidBatch for a layer listed twice, or a KV-sharing layer listed without its
        source or a source without its sharers (a source keeps older keys for its sharers: apart, either
        side's state would be wrong).

        Per KV group the manifest lists the blocks the exported layers need, nothing more."""
        problem = id_problem(seq_id)
        if problem:
            raise InvalidBatch(problem)
        model = self._model
        if layers is not None and len(set(layers)) != len(layers):
            raise InvalidBatch(f"{len(layers)} layers to export with repeats; list each layer once")
        listed = sorted(range(model.num_layers) if layers is None else layers)
        for layer in listed:
            spec = self._model.spec(layer)
            if spec.kv_source is not None and spec.kv_source not in listed:
                raise InvalidBatch(
                    f"layer {layer} reads layer {spec.kv_source}'s KV: export layer {spec.kv_source} too"
                )
            missing = [s for s in self._kv.retention.sharers_of(layer) if s not in listed]
            if missing:
                raise InvalidBatch(f"layer {layer}'s KV is read by layers {missing} (KV sharing): export them too")
        state = self._kv.get(seq_id, tenant=tenant)
        if state is None:
            raise UnknownSequence(f"cannot export sequence {quote(seq_id)}: it does not exist")
        lengths = tuple(state.lengths[x] if x in listed else 0 for x in range(model.num_layers))
        kept_from = tuple(state.kept_from[x] if x in listed else 0 for x in range(model.num_layers))
        blocks = []
        for group, table in zip(self._kv.groups, state.tables, strict=True):
            spans = self._kv.retention.needed_blocks(lengths, kept_from, group)
            blocks.append(tuple(b for b in sorted(table) if any(lo <= b < hi for lo, hi in spans)))
        return KVManifest(
            seq_id=seq_id,
            model=self.fingerprint,
            lengths=lengths,
            layers=tuple(x for x in listed if model.layers[x].kv_source is None),
            blocks=tuple(blocks),
            group_of=tuple(g.index for g in self._kv.group_of),
            scales=self._scales_now(),
            tenant=tenant,
            kept_from=kept_from,
            truncations=state.truncations,
        )

    def _scales_now(self) -> tuple[tuple[float, float], ...]:
        """Per layer, its cache's (k, v) scales as a manifest carries them (see KVManifest.scales)."""
        if not self._scales.fp8:
            return ()
        return tuple(self._scales.of(x) or (0.0, 0.0) for x in range(self._model.num_layers))

    def _check_scales(self, manifest: KVManifest) -> list[int]:
        """``check_scales`` for the layers a manifest carries KV of (its sharers read no more than it holds)."""
        return self.check_scales(manifest.scales, [x for x in manifest.layers if manifest.lengths[x]])

    def check_scales(self, scales: Sequence[tuple[float, float]], layers: Sequence[int]) -> list[int]:
        """IncompatibleKV unless each of ``layers`` (the layers a stream carries KV of) has in ``scales`` (the
        stream's, per layer) the scales this engine holds its cache over; returns the layers that take the
        stream's (calibrating ones with none yet)."""
        scale_range = self._scales.range
        if scale_range is None:
            return []  # not a float8 cache: the fingerprint's cache dtype has said all
        if len(scales) != self._model.num_layers:
            raise IncompatibleKV(
                f"the KV stream carries {len(scales)} layers' float8 scales; this model has"
                f" {self._model.num_layers} layers"
            )
        adopt = []
        for x in layers:
            theirs, ours = scales[x], self._scales.of(x)
            for name, scale in zip(("k_scale", "v_scale"), theirs, strict=True):
                problem = scale_range.problem(scale, f"its {name}")
                if problem:
                    raise IncompatibleKV(f"layer {x}'s float8 scales in the KV stream are {theirs}: {problem}")
            if ours is None:
                adopt.append(x)
            elif theirs != ours:
                raise IncompatibleKV(
                    f"layer {x}'s float8 KV is held over scales (k, v) = {ours} here, {theirs} in the stream:"
                    " give both servers the same --kv-scales"
                )
        return adopt

    def adopt_scales(self, layers: Sequence[int], scales: Sequence[tuple[float, float]]) -> None:
        """Calibrating ``layers`` take the stream's ``scales`` (per layer), as their first write would give them."""
        for x in layers:
            self._scales.adopt(x, scales[x])

    def scales_now(self) -> tuple[tuple[float, float], ...]:
        """Per layer, the scales a KV stream from here carries (``_scales_now``)."""
        return self._scales_now()

    def export_views(self, manifest: KVManifest, items: Sequence[tuple[int, int]]) -> list[BlockView]:
        """The records (layer, logical block) of an export with their checksums. A record carries only the
        positions its layer wrote and keeps ([kept_from, length)); the rest of the block is zeros,
        never what an earlier holder of the block left there. Full blocks are views of the pages on the CPU
        (see BlockView: encode them before this engine runs anything else).

        Raises SequenceChanged when the sequence is no longer what the manifest describes."""
        state = self._kv.get(manifest.seq_id, tenant=manifest.tenant)
        current = (
            None
            if state is None
            else self.export_manifest(manifest.seq_id, self._listed(manifest), tenant=manifest.tenant)
        )
        if current != manifest or state is None:
            raise SequenceChanged(f"sequence {quote(manifest.seq_id)} changed during its export; export it again")
        bs, heads = self._kv.block_size, self._model.num_kv_heads
        views: list[BlockView] = []
        for layer in dict.fromkeys(x for x, _ in items):
            logicals = [b for x, b in items if x == layer]
            table = state.tables[self._kv.group_of[layer].index]
            pieces = self._cache.block_views(self._plane_of[layer], [table[b] for b in logicals])
            lo, hi = manifest.kept_from[layer], manifest.lengths[layer]
            for b, (k, v) in zip(logicals, pieces, strict=True):
                first, end = min(max(lo - b * bs, 0), bs), min(max(hi - b * bs, 0), bs)
                if (first, end) == (0, bs):  # the whole block is the layer's: views, no copy
                    views.append(BlockView.of(layer, b, k, v))
                else:  # an edge of what the layer holds: a copy with the rest zeroed
                    views.append(
                        BlockView.of(layer, b, [masked(k, heads, bs, first, end)], [masked(v, heads, bs, first, end)])
                    )
        return views

    def begin_import(self, manifest: KVManifest, *, tenant: str) -> ImportSession:
        """Check a manifest against this engine and reserve every block it needs, as a sequence of ``tenant``.

        The checks take time in proportion to the manifest's size, whatever it claims, and the blocks it
        lists must be exactly those its lengths need: a block no exported layer writes would hand the new
        sequence whatever an earlier holder left in it.

        Raises IncompatibleKV, InvalidBatch (a bad id), SequenceExists or OutOfBlocks (QuotaExceeded), having
        reserved nothing."""
        manifest = self._check_manifest(manifest)
        self._check_scales(manifest)
        problem = id_problem(manifest.seq_id)
        if problem:
            raise InvalidBatch(f"the imported sequence's {problem}")
        if self._kv.get(manifest.seq_id, tenant=tenant) is not None:
            raise SequenceExists(f"cannot import into {quote(manifest.seq_id)}: a sequence with that id exists")
        total = sum(len(b) for b in manifest.blocks)
        self._kv.check_quota(tenant, total, 1)
        if not self._kv.pool.can_allocate(total):
            raise OutOfBlocks(
                f"the import needs {total} KV blocks and the pool has {self._kv.pool.num_free} free of"
                f" {self._kv.pool.num_blocks}; release sequences or start the server with a larger pool"
            )
        tables: list[dict[int, int]] = []
        for logicals in manifest.blocks:
            tables.append(dict(zip(logicals, self._kv.pool.allocate(len(logicals), account=tenant), strict=True)))
        self._kv.expect(tenant, 1)  # its sequence counts against the quota from now on
        return ImportSession(manifest, tables, set(manifest.expected()), tenant=tenant)

    def _check_manifest(self, manifest: KVManifest) -> KVManifest:
        """IncompatibleKV unless the manifest fits this model and describes a state this engine could hold.
        Returns it with its kept_from filled in (empty: each layer's current chunk)."""
        diffs = self.fingerprint.differences(manifest.model)
        if diffs:
            raise IncompatibleKV("the KV comes from another model shape: " + "; ".join(diffs))
        model = self._model
        if (
            len(manifest.lengths) != model.num_layers
            or len(manifest.blocks) != len(self._kv.groups)
            or manifest.group_of != tuple(g.index for g in self._kv.group_of)
        ):
            raise IncompatibleKV(
                f"the KV manifest has {len(manifest.lengths)} layers and {len(manifest.blocks)} KV groups; this"
                f" model has {model.num_layers} layers in {len(self._kv.groups)} KV groups"
            )
        bad = [x for x in manifest.layers if not 0 <= x < model.num_layers or model.layers[x].kv_source is not None]
        if bad or len(set(manifest.layers)) != len(manifest.layers):
            raise IncompatibleKV(
                f"the KV manifest's exported layers must be distinct layers with KV of their own, got {some(bad)}"
                if bad
                else "the KV manifest lists an exported layer twice"
            )
        for x, n in enumerate(manifest.lengths):
            if not 0 <= n <= MAX_TOKENS:
                raise IncompatibleKV(f"layer {x}'s length {n} in the KV manifest is outside 0..{MAX_TOKENS}")
            source = model.layers[x].kv_source
            if n and (x if source is None else source) not in manifest.layers:
                raise IncompatibleKV(f"layer {x} has {n} tokens but its KV is not in the stream")
        retention = self._kv.retention
        kept_from = manifest.kept_from or tuple(retention.current_chunks(manifest.lengths))
        problem = retention.kept_from_problem(manifest.lengths, kept_from)
        if problem:
            raise IncompatibleKV(f"the KV manifest's kept_from does not fit its lengths: {problem}")
        for group in self._kv.groups:
            held = manifest.blocks[group.index]
            if len(held) > self._kv.pool.num_blocks:
                raise OutOfBlocks(
                    f"the import needs {len(held)} KV blocks for KV group {group.index} alone, and this server's"
                    f" pool has {self._kv.pool.num_blocks} in all"
                )
            needed = _merged(retention.needed_blocks(manifest.lengths, kept_from, group))
            size = sum(hi - lo for lo, hi in needed)
            if size != len(held) or len(set(held)) != len(held) or not all(_within(needed, b) for b in held):
                raise IncompatibleKV(
                    f"the KV manifest lists {len(held)} blocks for KV group {group.index}, but its lengths need"
                    f" exactly the {size} blocks {_spans_text(needed)}"
                )
        return replace(manifest, kept_from=kept_from)

    def import_records(self, session: ImportSession, records: Sequence[BlockRecord]) -> None:
        """Check and write records of an import. Raises IncompatibleKV (unexpected, repeated or misshapen
        record, or one holding a NaN or an infinity) or DataLoss (checksum); the caller then aborts the session."""
        for r in records:
            key = (r.layer, r.logical)
            if key not in session.expected or key in session.received:
                raise IncompatibleKV(f"record (layer {r.layer}, block {r.logical}) is not expected or came twice")
            self.check_record(r, f"record (layer {r.layer}, block {r.logical})", [r.layer], session.manifest.scales)
            block = session.tables[self._kv.group_of[r.layer].index][r.logical]
            self._cache.write_block(self._plane_of[r.layer], block, r.k, r.v)
            session.received.add(key)

    def check_record(
        self, r: BlockRecord, what: str, layers: Sequence[int], scales: Sequence[tuple[float, float]]
    ) -> None:
        """IncompatibleKV unless record ``r`` (named ``what`` in messages) is whole (one K and one V page of this
        model's size) and holds only finite values Attend would take for each of ``layers`` over their float8
        ``scales`` (per layer; unread in a cache of another dtype); DataLoss when it fails its checksum."""
        cache_dtype = dtypes.BY_NAME[self.fingerprint.cache_dtype]
        if len(r.k) + len(r.v) != record_bytes(self.fingerprint) or len(r.k) != len(r.v):
            raise IncompatibleKV(f"{what} has the wrong size")
        if not r.intact():
            raise DataLoss(f"{what} fails its checksum: the data is damaged")
        if not (dtypes.all_finite(r.k, cache_dtype) and dtypes.all_finite(r.v, cache_dtype)):
            raise IncompatibleKV(
                f"{what} holds a NaN or an infinity: this server's KV is finite (as Attend refuses such q/k/v, an"
                " import does)"
            )
        for layer in layers:
            self._check_bounds(r, what, layer, scales[layer] if cache_dtype.fp8 else (1.0, 1.0), cache_dtype)

    def _check_bounds(
        self, r: BlockRecord, what: str, layer: int, scales: tuple[float, float], cache_dtype: dtypes.DType
    ) -> None:
        """IncompatibleKV when a record's K or V, over ``scales``, is past the bounds Attend holds ``layer``'s k
        and v to (ModelShape.value_limits): larger finite values could overflow a later call's scores or sums."""
        # A float8 cache rounds what Attend wrote (at most the bound) to nearest: up by half a step at most.
        slack = 1.0 + 2.0**-cache_dtype.mantissa_bits if cache_dtype.fp8 else 1.0
        bounds = [min(x, self._held) for x in self._model.value_limits(layer)]
        for name, raw, scale, limit in zip(("K", "V"), (r.k, r.v), scales, bounds, strict=True):
            top = dtypes.max_abs(raw, cache_dtype) * scale
            if top > limit * slack:
                power = math.log2(limit)
                shown = f"{limit:g} (2^{int(power)})" if power == int(power) else f"{limit:g}"
                raise IncompatibleKV(
                    f"{what} holds a {name} of {top:g}, past {shown}, the largest |{name.lower()}| Attend takes for"
                    f" layer {layer}, its cache and compute dtype: larger values could overflow attention"
                    " (server.md, limits)"
                )

    def commit_import(self, session: ImportSession) -> int:
        """Make the imported sequence visible; returns its block count. Raises DataLoss when records are
        missing or SequenceExists when the id was taken meanwhile; the caller then aborts the session."""
        missing = len(session.expected) - len(session.received)
        if missing:
            raise DataLoss(
                f"the KV stream ended with {missing} of {len(session.expected)} records missing: it was cut short"
            )
        seq_id = session.manifest.seq_id
        adopt = self._check_scales(session.manifest)  # again: a call may have calibrated a layer meanwhile
        m = session.manifest
        kept_from = list(m.kept_from)
        self._kv.add(SequenceState(seq_id, list(m.lengths), session.tables, tenant=session.tenant, kept_from=kept_from))
        self.adopt_scales(adopt, session.manifest.scales)
        session.committed = True
        self._kv.expect(session.tenant, -1)  # it is held now, no longer to come
        return sum(len(t) for t in session.tables)

    def _listed(self, manifest: KVManifest) -> list[int]:
        """The layers an export covered: its writing layers and their sharers."""
        sharers = (s for x in manifest.layers for s in self._kv.retention.sharers_of(x))
        return sorted({*manifest.layers, *sharers})

    def release_exported(self, manifest: KVManifest) -> None:
        """Release a sequence that was exported, unless it changed since (SequenceChanged: then a call
        to it ran after the export, and releasing would lose what it wrote)."""
        state = self._kv.get(manifest.seq_id, tenant=manifest.tenant)
        if (
            state is None
            or self.export_manifest(manifest.seq_id, self._listed(manifest), tenant=manifest.tenant) != manifest
        ):
            raise SequenceChanged(
                f"sequence {quote(manifest.seq_id)} changed after its export, so it was not released here"
            )
        self._kv.release([manifest.seq_id], tenant=manifest.tenant)

    def abort_import(self, session: ImportSession) -> None:
        """Return an unfinished import's blocks (idempotent; nothing to do after a commit)."""
        if not session.committed and not session.aborted:
            self._kv.pool.free(b for t in session.tables for b in t.values())
            session.tables = [{} for _ in session.tables]
            session.aborted = True
            self._kv.expect(session.tenant, -1)


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges [lo, hi) merged where they overlap or touch, sorted."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _within(spans: Sequence[tuple[int, int]], b: int) -> bool:
    """Whether ``b`` lies in one of the sorted, disjoint ``spans``."""
    i = bisect.bisect_right(spans, (b, MAX_TOKENS + 1)) - 1
    return i >= 0 and spans[i][0] <= b < spans[i][1]


def _spans_text(spans: Sequence[tuple[int, int]]) -> str:
    text = ", ".join(f"{lo}..{hi - 1}" for lo, hi in spans[:QUOTE_IDS]) or "(none)"
    return text + (f" and {len(spans) - QUOTE_IDS} more ranges" if len(spans) > QUOTE_IDS else "")
