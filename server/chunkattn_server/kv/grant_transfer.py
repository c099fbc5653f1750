"""A grant's live KV leaving this server and parked as a grant on another (GrantBlocks with a target). No
protobuf here (service/kvwire.py reads and writes the header).

The sender parks the blocks first (a snapshot: the prefill engine may reuse them at once), detaches the grant
(no one takes it; it ends at the push's deadline if the push never comes back), sends its live records
(``live_spans``: a chunked layer's current chunk, not the whole prompt; every record when sent ``whole``) as a
KV stream whose header is a GrantHeader, and releases it.
The receiver checks the stream as it checks a sequence's import (kv/transfer.py: the model's shape, the float8
scales, each record's size, checksum, finiteness and bounds; every record expected exactly once; all or
nothing), into pool blocks it zeroed first, laid out by its own planes per block, and opens the grant when the
trailer comes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from chunkattn_server.errors import DataLoss, IncompatibleKV, InvalidArgument
from chunkattn_server.kv.grants import GrantState, live_spans, span_count, span_records, whole_spans
from chunkattn_server.kv.manifest import BlockRecord, BlockView, ModelFingerprint
from chunkattn_server.kv.spaces import layer_planes

if TYPE_CHECKING:
    from chunkattn_server.kv.cache import KVCache
    from chunkattn_server.kv.manager import KVManager
    from chunkattn_server.kv.transfer import KVExchange


@dataclass(frozen=True)
class GrantManifest:
    """What a grant's stream says of it: its name, the model it was computed for and (float8) the scales of
    its pages per layer, its space's layout (per layer its plane, and the plane count), its blocks and tokens,
    its ttl, second tenant and tag, how many records follow, and whether they are every block's every plane
    (``whole``) or the live ones."""

    grant_id: str
    model: ModelFingerprint
    layer_planes: tuple[int, ...]
    num_planes: int
    num_blocks: int
    num_tokens: int
    ttl_s: float
    to_tenant: str
    scales: tuple[tuple[float, float], ...]
    num_records: int
    tag: str = ""
    whole: bool = False

    def spans(self) -> dict[int, tuple[int, int]]:
        """Per plane, the blocks [first, end) its stream carries (arithmetic: no list of records is made)."""
        if self.whole:
            return whole_spans(self.num_planes, self.num_blocks)
        m = self.model
        return live_spans(self.layer_planes, m.chunk_sizes, self.num_tokens, self.num_blocks, m.block_size)


@dataclass
class GrantImport:
    """A grant arriving: its manifest, the grant reserved for it (name and zeroed pool blocks), per plane the
    blocks expected ([first, end)) and how many, the records received, and the calibrating layers that take its
    scales."""

    manifest: GrantManifest
    grant: GrantState
    spans: dict[int, tuple[int, int]]
    expected: int
    adopt: list[int]
    received: set[tuple[int, int]] = field(default_factory=set)
    committed: bool = False
    aborted: bool = False


class GrantExchange:
    """Grants leaving and arriving on one engine: ``kv`` holds the grants, ``cache`` their pages, ``exchange``
    checks records and scales as a sequence's import does. Runs on the engine's thread."""

    def __init__(self, kv: KVManager, cache: KVCache, exchange: KVExchange) -> None:
        self._kv = kv
        self._cache = cache
        self._exchange = exchange
        self._model = kv.config.model
        self._writers = [x for x, spec in enumerate(self._model.layers) if spec.kv_source is None]

    # -- leaving -------------------------------------------------------------------------------------------

    def detach(
        self, grant: GrantState, ttl_s: float, *, whole: bool, within_s: float
    ) -> tuple[GrantManifest, list[tuple[int, int]]]:
        """Close an open grant to takers (it is leaving: ``release`` it after, or it ends ``within_s`` and a
        grace later) and describe it for its stream: its manifest, and its records (plane, block) in order."""
        self._kv.grants.detach(grant, within_s)
        manifest = GrantManifest(
            grant_id=grant.grant_id,
            model=self._exchange.fingerprint,
            layer_planes=grant.layer_planes,
            num_planes=grant.num_planes,
            num_blocks=grant.num_blocks,
            num_tokens=grant.num_tokens,
            ttl_s=ttl_s,
            to_tenant=grant.to_tenant,
            scales=self._exchange.scales_now(),
            num_records=0,
            tag=grant.tag,
            whole=whole,
        )
        records = span_records(manifest.spans())
        return replace(manifest, num_records=len(records)), records

    def views(self, grant: GrantState, items: Sequence[tuple[int, int]]) -> list[BlockView]:
        """The records (plane, block) of a detached grant with their checksums: views of its pages (on the CPU;
        nothing writes a detached grant's pages, so they may be encoded after this job)."""
        g = self._kv.grants.planes_per_block
        views = []
        for plane, block in items:
            (k, v), *_ = self._cache.block_views(plane % g, [int(grant.blocks[block, plane // g])])
            views.append(BlockView.of(plane, block, k, v))
        return views

    # -- arriving ------------------------------------------------------------------------------------------

    def begin_import(self, manifest: GrantManifest, *, tenant: str) -> GrantImport:
        """Check a grant's header against this engine and reserve its grant (name, pool blocks, zeroed), as
        ``tenant``'s. IncompatibleKV (another model shape, scales, a layout or counts that do not fit),
        InvalidArgument, GrantExists, OutOfBlocks / QuotaExceeded: nothing reserved then. Every check before the
        reservation takes time in proportion to the model's layers, whatever the header claims."""
        diffs = self._exchange.fingerprint.differences(manifest.model)
        if diffs:
            raise IncompatibleKV("the KV comes from another model shape: " + "; ".join(diffs))
        if not 1 <= manifest.num_blocks <= self._kv.pool.num_blocks:
            raise IncompatibleKV(
                f"the grant has {manifest.num_blocks} blocks; this server's pool has {self._kv.pool.num_blocks}"
            )
        try:
            resolved, count = layer_planes(self._model, manifest.layer_planes)
        except InvalidArgument as e:
            raise IncompatibleKV(f"the grant's layout does not fit this model: {e}") from None
        if resolved != manifest.layer_planes or count != manifest.num_planes:
            raise IncompatibleKV(
                f"the grant's layout {list(manifest.layer_planes)} ({manifest.num_planes} planes) is not one this"
                " model's spaces can have (a KV-sharing layer's plane is its source's)"
            )
        if not 0 <= manifest.num_tokens <= manifest.num_blocks * self._kv.block_size:
            raise IncompatibleKV(
                f"the grant holds {manifest.num_tokens} tokens in {manifest.num_blocks} blocks of {self._kv.block_size}"
            )
        spans = manifest.spans()
        expected = span_count(spans)
        if manifest.num_records != expected:
            raise IncompatibleKV(
                f"the grant's header announces {manifest.num_records} records; its lengths need {expected}"
            )
        adopt = self._exchange.check_scales(manifest.scales, self._writers) if manifest.num_tokens else []
        grant = self._kv.grants.reserve(
            manifest.grant_id,
            tenant,
            manifest.num_blocks,
            manifest.layer_planes,
            manifest.num_planes,
            num_tokens=manifest.num_tokens,
            ttl_s=manifest.ttl_s,
            to_tenant=manifest.to_tenant,
            tag=manifest.tag,
        )
        try:
            self._cache.zero_blocks(grant.blocks.reshape(-1).tolist())  # the planes no record fills read as zeros
        except BaseException:
            self._kv.grants.release(grant)
            raise
        return GrantImport(manifest, grant, spans, expected, adopt)

    def import_records(self, session: GrantImport, records: Sequence[BlockRecord]) -> None:
        """Check and write records of a grant's stream (a record's ``layer`` is its plane, ``logical`` its
        block). IncompatibleKV or DataLoss as a sequence's import; the caller then aborts the session."""
        g = self._kv.grants.planes_per_block
        m = session.manifest
        for r in records:
            key = (r.layer, r.logical)
            what = f"record (plane {r.layer}, block {r.logical})"
            first, end = session.spans.get(r.layer, (0, 0))
            if not first <= r.logical < end or key in session.received:
                raise IncompatibleKV(f"{what} is not expected or came twice")
            writers = [x for x, p in enumerate(m.layer_planes) if p == r.layer and x in self._writers]
            self._exchange.check_record(r, what, writers, m.scales)
            self._cache.write_block(r.layer % g, int(session.grant.blocks[r.logical, r.layer // g]), r.k, r.v)
            session.received.add(key)

    def commit_import(self, session: GrantImport) -> int:
        """Open the arrived grant; returns its pool blocks. DataLoss when records are missing; the caller then
        aborts the session."""
        missing = session.expected - len(session.received)
        if missing:
            raise DataLoss(
                f"the grant's stream ended with {missing} of {session.expected} records missing: it was cut short"
            )
        m = session.manifest
        adopt = self._exchange.check_scales(m.scales, self._writers) if m.num_tokens else []  # calibrated meanwhile?
        self._exchange.adopt_scales(adopt, m.scales)
        self._kv.grants.insert(session.grant)
        session.committed = True
        return int(session.grant.blocks.size)

    def abort_import(self, session: GrantImport) -> None:
        """Give back an unfinished grant's name and blocks (idempotent; nothing to do after a commit)."""
        if not session.committed and not session.aborted:
            self._kv.grants.release(session.grant)
            session.aborted = True
