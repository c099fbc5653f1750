"""The engine: the one owner of the device, the KV pool and every sequence's state.

``Engine.attend_step(layer, calls)`` serves one engine step: several Attend calls of one layer, each a batch
of sequences (prefill pieces of any length and single-token decodes, mixed), none sharing a sequence with
another. Each call goes through

1. plan: its checks against the model and its sequences' state, and its write plan (pure, per call);
2. reserve: every block it needs, or none (per call, in the KV manager);
3. one compute for the step: K/V written, the backend run once over every call's tokens;
4. commit: lengths grow, blocks out of every layer's chunk go back to the pool.

A call that fails its checks or its reservation fails alone, with the error it would have had alone, and
changes nothing; the others in its step go on. ``Engine.attend`` is a step of one call.

The engine is not thread-safe: exactly one thread calls it (the scheduler's engine thread).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch

from chunkattn_client import dtypes, work
from chunkattn_client.batch import BatchEntry
from chunkattn_server import torchtypes
from chunkattn_server.attention.backends import AttentionBatch, Backend
from chunkattn_server.attention.backends.base import FusedDecodes, Table
from chunkattn_server.config import EngineConfig, LayerSpec, default_call_work
from chunkattn_server.engine import blocks, checks
from chunkattn_server.engine.device import make_backend, resolve_device
from chunkattn_server.engine.entries import Entries
from chunkattn_server.engine.types import (
    AttendCall,
    BlockCall,
    EngineStats,
    GrantAsk,
    Handoff,
    Leaving,
    Planned,
    Retry,
    Swept,
)
from chunkattn_server.errors import (
    GrantMismatch,
    InvalidArgument,
    InvalidBatch,
    InvalidTensor,
    OutOfBlocks,
    PositionMismatch,
)
from chunkattn_server.kv.cache import KVCache, token_slots
from chunkattn_server.kv.grant_transfer import GrantExchange, GrantImport, GrantManifest
from chunkattn_server.kv.grants import GrantState, block_ids, same_layout
from chunkattn_server.kv.manager import KVManager
from chunkattn_server.kv.manifest import BlockRecord, BlockView, KVManifest, ModelFingerprint
from chunkattn_server.kv.records import Quota, Reservation, Truncation, Write
from chunkattn_server.kv.scales import KVScaleTable
from chunkattn_server.kv.sequences import SequenceState
from chunkattn_server.kv.spaces import SpaceState
from chunkattn_server.kv.transfer import ImportSession, KVExchange

# Tensors made from received bytes (requests, imported KV) are read-only views; the engine never writes into
# them, so torch.frombuffer's warning about it says nothing.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class Engine:
    """Paged KV cache + chunked-local attention for one model shape, on one device.

    The data plane is ``attend`` / ``attend_step``; the state is reached through the parts that own it:
    ``kv`` (kv/manager.py: sequences, fork, truncate, release, eviction), ``transfer`` (kv/transfer.py:
    export and import), ``scales`` (kv/scales.py: a float8 cache's scales) and ``pool``.
    """

    def __init__(self, config: EngineConfig, *, backend: Backend | None = None) -> None:
        self.config = config
        model = config.model
        self.device = resolve_device(config.device)
        self.backend: Backend = backend if backend is not None else make_backend(config.backend, self.device)
        compute, cache = config.dtypes_on(self.device.type)
        self.dtype = torchtypes.of(compute)  # attention computes in it; outputs come back in q's dtype
        self.cache_dtype = torchtypes.of(cache)
        self._converts = self.cache_dtype != self.dtype  # its writes need the layer's scales (KVCache.write)
        self.scales = KVScaleTable.starting(
            model.kv_sources, config.cache.scales, dtypes.BY_NAME[cache], dtypes.BY_NAME[compute]
        )
        self.block_size = config.cache.block_size
        self.groups = config.kv_groups
        self.bytes_per_block = KVCache.bytes_per_block(
            num_planes=config.group_size,
            block_size=self.block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            itemsize=self.cache_dtype.itemsize,
        )
        num_blocks = KVCache.blocks_for(config.cache, self.bytes_per_block)
        self.cache = KVCache(
            num_planes=config.group_size,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            dtype=self.cache_dtype,
            device=self.device,
            writer=self.backend.write,
        )
        self.kv = KVManager(config, num_blocks, self.cache.copy_block)
        self.pool = self.kv.pool
        # Per layer: its plane in its KV group (its pages' storage) (a KV-sharing layer's is its source's).
        self._plane_of = [
            self.kv.group_of[i].layers.index(i if spec.kv_source is None else spec.kv_source)
            for i, spec in enumerate(model.layers)
        ]
        held = torchtypes.storable(self.cache_dtype, self.dtype)
        self.transfer = KVExchange(self.kv, self.cache, self._plane_of, self.fingerprint(), self.scales, held)
        self.grant_transfer = GrantExchange(self.kv, self.cache, self.transfer)
        self._on_cpu = self.device.type == "cpu"
        # The most work one call may ask for (chunkattn_client.work; 0: any): what it may hold the device for.
        limit = config.max_call_work
        self.max_call_work = default_call_work(self.device.type) if limit is None else limit
        self._scales = [model.scale_of(i) for i in range(model.num_layers)]
        self._bounds = [checks.bounds(model, i, self.dtype, self.cache_dtype) for i in range(model.num_layers)]
        self._slopes = [
            None
            if spec.alibi_slopes is None
            else torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=self.device)
            for spec in model.layers
        ]

    # -- the data plane ------------------------------------------------------------------------------

    def attend(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        tenant: str,
    ) -> torch.Tensor:
        """Append the batch's K/V to the layer's cache and return chunked-local attention of q over it.

        Args:
            layer: the layer index.
            entries: one per sequence, in the order the tensors pack them; a sequence unknown to the
                engine is created when its entry starts at position 0.
            q: [T, num_heads, head_size] float32 / float16 / bfloat16, T = sum of num_tokens.
            k, v: [T, num_kv_heads, head_size], q's dtype; None for a KV-sharing layer.
            tenant: whose sequences the ids name (see kv/manager.py).

        Returns:
            [T, num_heads, head_size] in q's dtype, on the engine's device.

        Raises:
            InvalidArgument (UnknownLayer, InvalidBatch, InvalidTensor), UnknownSequence,
            PositionMismatch, OutOfBlocks (QuotaExceeded). Nothing has changed when one is raised.
        """
        (result,) = self.attend_step(layer, [AttendCall(tuple(entries), q, k, v, tenant)])
        if isinstance(result, BaseException):
            raise result
        return result

    def attend_step(self, layer: int, calls: Sequence[AttendCall]) -> list[torch.Tensor | Exception | Retry]:
        """Serve several calls of one layer in one compute; per call, its output ([T_i, num_heads,
        head_size] in its q's dtype) or the error it fails with alone (nothing of it changed: an EngineError,
        or an unexpected error while it was checked, a bug that stays that call's), or Retry (see there). No
        two calls may share a sequence (the scheduler's rule; checked).

        An error that is not a call's own (a backend failure) undoes every call and is raised."""
        if torch.is_grad_enabled():  # the cache must never join an autograd graph, whatever the caller's tensors
            with torch.no_grad():  # (the server's threads run with grad off: entering this costs ~5 us)
                return self._attend_step(layer, calls)
        return self._attend_step(layer, calls)

    def attend_blocks(self, layer: int, calls: Sequence[BlockCall]) -> list[torch.Tensor | Exception]:
        """Block-addressed calls of one layer (engine/blocks.py): per call its output ([T_i, num_heads,
        head_size] in its q's dtype) or the error it fails with alone (a call refused by its checks wrote
        nothing). The calls that share a plane of the pages are stored and computed together; an error that is
        not a call's own (a backend failure, after their K/V were written at their slots) fails every call of
        its plane."""
        with torch.no_grad():
            spec = self.config.model.spec(layer)  # UnknownLayer for the whole step, as attend_step raises it
            results: list[torch.Tensor | Exception] = [RuntimeError("not served")] * len(calls)
            by_plane: dict[int, list[tuple[int, Planned, SpaceState]]] = {}
            for i, (planned, space) in _each(calls, lambda c: self._plan_blocks(layer, spec, c), results):
                by_plane.setdefault(planned.plane, []).append((i, planned, space))
            for members in by_plane.values():
                try:
                    outs = self._run(layer, [p for _, p, _ in members])
                except Exception as e:
                    for i, _, _ in members:
                        results[i] = e
                    continue
                now = time.monotonic()
                for (i, _, space), out in zip(members, outs, strict=True):
                    results[i] = out
                    space.last_used = now  # used until the call's end: its lease runs from here
            return results

    def open_space(self, num_blocks: int, planes: Sequence[int], *, tenant: str, lease_s: float = 0.0) -> SpaceState:
        """A new block space of ``tenant`` (kv/spaces.py). Its blocks are not zeroed now: each is zeroed by the
        first call that touches it (``_plan_blocks``), so no previous owner's K/V ever shows and opening costs
        no more than the pool's bookkeeping."""
        return self.kv.spaces.open(num_blocks, planes, tenant=tenant, lease_s=lease_s)

    # -- the sequence API: plan -> reserve -> run -> commit ------------------------------------------------------

    def _attend_step(self, layer: int, calls: Sequence[AttendCall]) -> list[torch.Tensor | Exception | Retry]:
        results: list[torch.Tensor | Exception | Retry] = [Retry()] * len(calls)
        spec = self.config.model.spec(layer)
        planned = _each(calls, lambda c: self._plan(layer, spec, c), results)
        seen: set[tuple[str, str]] = set()
        for i, _ in planned:
            ids = {(calls[i].tenant, e.seq_id) for e in calls[i].entries}
            assert seen.isdisjoint(ids), "calls of one step must not share a sequence"
            seen |= ids
        owners: dict[int, int] = {}
        reserved: list[tuple[int, Reservation]] = []
        for i, (states, writes) in planned:
            try:
                reserved.append(
                    (i, self.kv.reserve(layer, calls[i].entries, states, writes, owners, tenant=calls[i].tenant))
                )
            except OutOfBlocks as e:
                results[i] = Retry() if reserved else e
        if not reserved:
            return results
        try:
            outs = self._run(layer, [self._reserved(layer, spec, calls[i], r) for i, r in reserved])
        except BaseException:
            for _, r in reversed(reserved):
                self.kv.rollback(r)
            raise
        now = time.monotonic()
        for (i, r), out in zip(reserved, outs, strict=True):
            self.kv.commit(r, now)
            results[i] = out
        return results

    def _plan(self, layer: int, spec: LayerSpec, call: AttendCall) -> tuple[list[SequenceState | None], list[Write]]:
        """A call's checks (everything is checked before anything changes) and its write plan."""
        # Entries were checked where they were built (the service's parser): only a plain list is checked here.
        entries = call.entries
        total = sum(e.num_tokens for e in entries) if isinstance(entries, Entries) else checks.check_entries(entries)
        self._check_tensors(layer, spec, entries, total, call)
        self._check_first_write(layer, call)
        states = [self.kv.get(e.seq_id, tenant=call.tenant) for e in call.entries]
        checks.check_positions(layer, spec, call.entries, states)
        if self.max_call_work:
            done = sum(work.entry_work(e.position, e.num_tokens, spec.chunk_size) for e in call.entries)
            checks.check_work(done, self.max_call_work)
        return states, self.kv.plan_writes(layer, spec, call.entries, states)

    def _reserved(self, layer: int, spec: LayerSpec, call: AttendCall, r: Reservation) -> Planned:
        """A reserved sequence call in the engine's one form: each entry a span over its KV group's table; each
        token's slot where that table puts it, -1 for those its write skips (before the chunk it keeps); a
        KV-sharing layer reads every new token back where its source wrote it."""
        group, bs = self.kv.group_of[layer], self.block_size
        tables = [s.tables[group.index] for s in r.states]
        spans, parts, row, stored = [], [], 0, True
        reads_back = call.k is None or call.v is None
        for table, e, w in zip(tables, r.entries, r.writes, strict=True):
            spans.append((row, e.position, e.num_tokens))
            end = e.position + e.num_tokens
            first = e.position if reads_back else w.start
            if first > e.position:
                parts.append(np.full(min(first, end) - e.position, -1, np.int64))
                stored = False
            if first < end:
                parts.append(token_slots(table, first, end, bs))
            row += e.num_tokens
        return Planned(
            q=call.q,
            k=call.k,
            v=call.v,
            plane=self._plane_of[layer],
            source=layer if spec.kv_source is None else spec.kv_source,
            slots=_concat(parts) if parts else np.empty(0, np.int64),
            spans=spans,
            tables=tables,
            chunk_size=spec.chunk_size,
            stored=stored,
        )

    # -- the block API: a call checked against its space -----------------------------------------------------

    def _plan_blocks(self, layer: int, spec: LayerSpec, call: BlockCall) -> tuple[Planned, SpaceState]:
        """A block call's checks against the model, its space (engine/blocks.py) and the engine's bounds, and
        its plan; the space blocks it touches that are still stale are zeroed now (nothing else has changed)."""
        space = self.kv.spaces.get(call.space_id, tenant=call.tenant)
        tokens = int(call.q.shape[0]) if call.q.dim() else 0
        if tokens < 1:
            raise InvalidBatch("q has no tokens; a block batch brings at least one new token")
        self._check_tensors(layer, spec, (), tokens, call)
        source = layer if spec.kv_source is None else spec.kv_source
        planned, touched = blocks.plan(call, space, layer, source, self.block_size)
        if self.max_call_work:
            checks.check_work(int(work.token_work(call.starts, call.seq_lens).sum()), self.max_call_work)
        self._check_first_write(layer, call)
        if source != layer and self.scales.calibrating(source):
            raise PositionMismatch(
                f"layer {layer} reads layer {source}'s KV cache (KV sharing), which has had no write yet:"
                f" call layer {source} first"
            )
        space.zero_stale(touched, self.cache.zero_blocks)  # first touch: no previous owner's bytes show
        return planned, space

    def _check_tensors(
        self, layer: int, spec: LayerSpec, entries: Sequence[BatchEntry], total: int, call: AttendCall | BlockCall
    ) -> None:
        """A call's tensors against the model and their values (checks.check_tensors)."""
        q, k, v = call.q, call.k, call.v
        model = self.config.model
        checks.check_tensors(
            model, layer, spec, entries, total, q, k, v, self.dtype, self.cache_dtype, self._bounds[layer]
        )

    def _check_first_write(self, layer: int, call: AttendCall | BlockCall) -> None:
        """A first write of a calibrating float8 layer against what its scales can hold (``_check_calibration``)."""
        if call.k is not None and call.v is not None and self.scales.calibrating(layer):
            self._check_calibration(self._on_device(call.k), self._on_device(call.v))

    # -- the one store and compute path, for both addressings ------------------------------------------------

    def _run(self, layer: int, calls: Sequence[Planned]) -> list[torch.Tensor]:
        """Store the calls' K/V (all of one plane) and run the backend once over all their rows; per call its
        output [T_i, num_heads, head_size] in its q's dtype. A step of decodes only goes to a fused backend's
        one call (store, metadata and attention together: ``_fused``)."""
        first = calls[0]
        one = len(calls) == 1
        q = self._on_device(first.q) if one else _cat([self._on_device(c.q) for c in calls])
        spans: list[tuple[int, int, int]] = []
        tables: list[Table] = []
        unwritten: list[int] = []  # decodes whose key is not in the pages: they read it from k and v (ascending)
        sizes: list[int] = []
        decodes = True
        base = 0
        for c in calls:
            for row, position, n in c.spans:
                if n == 1:
                    if not c.stored and c.slots[row] < 0:
                        unwritten.append(len(spans))
                else:
                    decodes = False
                spans.append((base + row, position, n))
            tables.extend(c.tables)
            sizes.append(int(c.q.shape[0]))
            base += sizes[-1]
        out = torch.empty(q.shape, dtype=self.dtype, device=self.device)
        if decodes and getattr(self.backend, "fused", False):  # a backend that serves them in one call (native)
            self._fused_step(layer, cast(FusedDecodes, self.backend), calls, q, spans, tables, unwritten, out)
        else:
            kc, vc = self._store(first.plane, first.source, calls)
            k_scale, v_scale = self._read_scales(first.source)
            if spans:
                batch = AttentionBatch(
                    q=q,
                    k=kc,
                    v=vc,
                    k_pages=self.cache.k[first.plane],
                    v_pages=self.cache.v[first.plane],
                    spans=spans,
                    tables=tables,
                    chunk_size=first.chunk_size,
                    block_size=self.block_size,
                    scale=self._scales[layer],
                    alibi_slopes=self._slopes[layer],
                    k_scale=k_scale,
                    v_scale=v_scale,
                    unwritten=frozenset(unwritten),
                )
                self.backend.attend(batch, out)
        if one:
            return [out if out.dtype == first.q.dtype else out.to(first.q.dtype)]
        parts, row = [], 0
        for c, n in zip(calls, sizes, strict=True):
            part = out[row : row + n]
            parts.append(part if part.dtype == c.q.dtype else part.to(c.q.dtype))
            row += n
        return parts

    def _fused_step(
        self,
        layer: int,
        backend: FusedDecodes,
        calls: Sequence[Planned],
        q: torch.Tensor,
        spans: list[tuple[int, int, int]],
        tables: list[Table],
        unwritten: list[int],
        out: torch.Tensor,
    ) -> None:
        """A step of decodes only in the fused backend's one call: the calls' K/V stored at their slots (as
        ``_store`` stores them: a float8 cache over the source layer's scales, calibrated by a first write; a
        KV-sharing layer stores nothing and reads its keys in the pages), their attention into ``out``."""
        first = calls[0]
        one = len(calls) == 1
        k = v = slots = None
        if first.k is not None and first.v is not None:
            k = self._on_device(first.k) if one else _cat([self._on_device(c.k) for c in calls if c.k is not None])
            v = self._on_device(first.v) if one else _cat([self._on_device(c.v) for c in calls if c.v is not None])
            if self._converts:
                self._write_scales(first.source, k, v)  # calibrates the layer's scales on its first write
            slots = first.slots if one else _concat([c.slots for c in calls])
        backend.store_and_decode(
            q,
            k,
            v,
            slots,
            self.cache.k[first.plane],
            self.cache.v[first.plane],
            spans,
            tables,
            unwritten,
            first.chunk_size,
            self._scales[layer],
            self._slopes[layer],
            self._read_scales(first.source),
            out,
        )

    def _store(self, plane: int, source: int, calls: Sequence[Planned]) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the calls' K/V at their slots (a float8 cache: over the source layer's scales, calibrated by
        this write if it is the first; each call was checked on its own, so their merged first write calibrates
        without error: its largest values are one of theirs); returns all their rows' K/V [T, Hkv, D] as the
        cache holds them (KVCache.write), in the compute dtype. A KV-sharing layer's calls store nothing: their
        K/V are read back at their slots."""
        slots = _concat([c.slots for c in calls])
        if calls[0].k is None or calls[0].v is None:
            return self.cache.read(plane, self._index(slots), self._read_scales(source), self.dtype)
        k, v = (
            _cat([self._on_device(c.k) for c in calls if c.k is not None]),
            _cat([self._on_device(c.v) for c in calls if c.v is not None]),
        )
        scales = self._write_scales(source, k, v) if self._converts else (1.0, 1.0)
        if all(c.stored for c in calls):
            return self.cache.write(plane, self._index(slots), k, v, scales)
        rows = np.flatnonzero(slots >= 0)
        return self.cache.write(plane, self._index(slots[rows]), k, v, scales, self._index(rows))

    def _read_scales(self, layer: int) -> tuple[float, float]:
        """A layer's cache scales (k, v), its first write having calibrated them where it had to."""
        scales = self.scales.of(layer)
        assert scales is not None, "a calibrating layer is read only after its first write"
        return scales

    def _write_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        """The scales a write of ``k``, ``v`` ([T, Hkv, D] in the compute dtype, as they are stored) is stored
        over: the layer's, set now from this write if it is calibrating (kv/scales.py: max |x| / K_RANGE or
        V_RANGE, as vLLM's calculate_kv_scales). Each call of a step was checked on its own (_plan), so their
        merged first write calibrates without error: its largest values are one of theirs."""
        if not self.scales.calibrating(layer):
            return self._read_scales(layer)
        return self.scales.calibrated(layer, _top(k), _top(v))

    def _check_calibration(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """InvalidTensor for a first write that cannot calibrate a layer's scales (one too small to read back
        would store every later value as 0); ``k``, ``v`` as for ``write_scales``."""
        assert self.scales.range is not None
        try:
            self.scales.range.calibrate(_top(k), _top(v))
        except ValueError as e:
            raise InvalidTensor(f"{e}. Nothing was written") from None

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the engine's device in the compute dtype (itself when it is already: ``to`` is not free)."""
        if self._on_cpu and t.dtype == self.dtype and t.is_cpu:
            return t
        return t.to(device=self.device, dtype=self.dtype)

    def _index(self, values: np.ndarray) -> torch.Tensor:
        """An int64 index tensor on the engine's device."""
        t = torch.from_numpy(values)
        return t if self._on_cpu else t.to(self.device)

    def fingerprint(self) -> ModelFingerprint:
        model = self.config.model
        return ModelFingerprint(
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            block_size=self.block_size,
            chunk_sizes=tuple(x.chunk_size for x in model.layers),
            kv_sources=model.kv_sources,
            cache_dtype=torchtypes.OF_TORCH[self.cache_dtype].name,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free,
            used_blocks=self.pool.num_used,
            block_size=self.block_size,
            bytes_per_block=self.bytes_per_block,
            num_sequences=self.kv.num_sequences,
            sequences_by_tenant=self.kv.sequences_by_tenant(),
            blocks_by_tenant=self.pool.usage(),
            spaces_by_tenant=self.kv.spaces.by_tenant(),
            grants=len(self.kv.grants),
            parked_blocks=self.kv.grants.parked_blocks(),
        )

    def scale(self, layer: int) -> float:
        """The softmax scale the layer uses (its configured one, or 1 / sqrt(head_size))."""
        return self._scales[layer]

    # -- the control plane: the service's one door to sequences, spaces, quotas, transfer and scales -----------
    # Each runs on the engine's thread, as a control job (Scheduler.run). The service reaches the KV's state
    # through these alone (tests/service/test_engine_door.py); the parts they delegate to say more.

    def release(self, seq_ids: Sequence[str], *, missing_ok: bool = False, tenant: str) -> int:
        """Drop ``tenant``'s sequences and return their blocks; how many existed (KVManager.release:
        UnknownSequence for an unknown id unless ``missing_ok``, InvalidBatch; nothing released then)."""
        return self.kv.release(seq_ids, missing_ok=missing_ok, tenant=tenant)

    def fork(self, parent: str, child: str, *, tenant: str) -> int:
        """``child``, a copy-on-write copy of ``parent``; the number of blocks they share (KVManager.fork)."""
        return self.kv.fork(parent, child, tenant=tenant)

    def truncate(self, seq_id: str, length: int, *, tenant: str) -> Truncation:
        """The sequence back to its first ``length`` tokens in every layer (KVManager.truncate)."""
        return self.kv.truncate(seq_id, length, tenant=tenant)

    def set_quotas(self, quotas: dict[str, Quota]) -> None:
        """Each tenant's quota from now on (a tenant left out has none); the calls under way keep theirs."""
        self.kv.quotas = quotas

    def close_space(self, space_id: str, *, tenant: str) -> int:
        """Close ``tenant``'s block space; the pool blocks it gave back (UnknownSpace)."""
        return self.kv.spaces.close(space_id, tenant=tenant)

    def renew_space(self, space_id: str, *, tenant: str) -> SpaceState:
        """``tenant``'s block space, used now: its lease starts again (UnknownSpace)."""
        return self.kv.spaces.renew(space_id, tenant=tenant)

    def spaces_of(self, *, tenant: str) -> list[SpaceState]:
        """``tenant``'s open block spaces."""
        return self.kv.spaces.of(tenant)

    def grant_blocks(self, ask: GrantAsk, *, tenant: str) -> Handoff:
        """Park a copy of ``tenant``'s space blocks ``ask.block_ids``, every plane, under a new grant
        (kv/grants.py); a block no call has touched yet parks as zeros. UnknownSpace, InvalidArgument,
        GrantExists, OutOfBlocks / QuotaExceeded: nothing changed then."""
        space = self.kv.spaces.get(ask.space_id, tenant=tenant)
        grant, checked = self.kv.grants.reserve_from(
            space,
            ask.block_ids,
            ask.grant_id,
            num_tokens=ask.num_tokens,
            ttl_s=ask.ttl_s,
            to_tenant=ask.to_tenant,
            tag=ask.tag,
        )
        parked = grant.blocks.reshape(-1).tolist()
        try:  # opened only once it holds the copy: a copy that fails (out of memory) leaves no grant
            space.zero_stale(checked, self.cache.zero_blocks)  # no previous owner's bytes in the copy
            self.cache.copy_blocks(space.blocks[checked].reshape(-1).tolist(), parked)
        except BaseException:
            self.kv.grants.release(grant)
            raise
        self.kv.grants.insert(grant)
        space.last_used = time.monotonic()
        return Handoff(len(checked), len(parked), len(parked) * self.bytes_per_block, ask.num_tokens)

    def copy_blocks(
        self,
        dest_space_id: str,
        dest_ids: Sequence[int],
        source_ids: Sequence[int],
        *,
        space_id: str = "",
        grant_id: str | None = None,
        expect_tag: str = "",
        tenant: str,
    ) -> Handoff:
        """Copy blocks, every plane, into ``tenant``'s space ``dest_space_id``'s ``dest_ids``: from its space
        ``space_id``'s ``source_ids``, or, ``grant_id`` not None (an empty name too: no grant has it), from that
        grant (``source_ids`` index its blocks; empty: all), which this takes, if its tag is ``expect_tag`` (when
        given). The destination blocks hold exactly the source's bytes afterwards. UnknownSpace, UnknownGrant,
        InvalidArgument, GrantMismatch, QuotaExceeded (the tenant's allowance of blocks to copy): nothing changed
        then (a grant is not taken)."""
        dest = self.kv.spaces.get(dest_space_id, tenant=tenant)
        grant = self.kv.grants.get(grant_id, tenant=tenant) if grant_id is not None else None
        source = None if grant is not None else self.kv.spaces.get(space_id, tenant=tenant)
        if grant is not None:
            rows, planes, num_planes, what = grant.blocks, grant.layer_planes, grant.num_planes, "the grant"
            if not len(source_ids):
                source_ids = range(grant.num_blocks)
        else:
            assert source is not None
            rows, planes, num_planes, what = source.blocks, source.layer_planes, source.num_planes, "the source space"
        src = block_ids("source_block_ids", source_ids, len(rows), unique=False)
        dst = block_ids("dest_block_ids", dest_ids, dest.num_blocks, unique=True)
        if len(src) != len(dst):
            raise InvalidArgument(
                f"source_block_ids lists {len(src)} blocks and dest_block_ids {len(dst)}; expected one destination"
                " block per source block"
            )
        same_layout(planes, num_planes, dest, what)
        if grant is not None and expect_tag and grant.tag != expect_tag:
            raise GrantMismatch(
                "the grant holds other KV than the one expected (its tag is not expect_tag): not taken; the"
                " prompt it was handed for is not the one it holds"
            )
        pool = rows[src].reshape(-1).tolist()
        self.kv.spaces.charge(tenant, len(pool), what="this copy")
        if source is not None:
            source.zero_stale(src, self.cache.zero_blocks)  # no previous owner's bytes in the copy
        self.cache.copy_blocks(pool, dest.blocks[dst].reshape(-1).tolist())
        dest.stale[dst] = False  # every byte of their pool blocks written now
        now = time.monotonic()
        dest.last_used = now
        if source is not None:
            source.last_used = now
        num_tokens = 0
        if grant is not None:
            num_tokens = grant.num_tokens
            self.kv.grants.release(grant)
        return Handoff(len(src), len(pool), len(pool) * self.bytes_per_block, num_tokens)

    def sweep(self, idle_timeout_s: float, *, sequences: bool) -> Swept:
        """Idle eviction: sequences released (untouched for more than ``idle_timeout_s``, only when
        ``sequences``), block spaces closed (unused past their lease), grants ended (past their ttl), and when
        the next space's lease or grant's ttl ends, in time.monotonic()'s seconds (None for none)."""
        evicted = len(self.kv.evict_idle(idle_timeout_s)) if sequences else 0
        closed = len(self.kv.spaces.expire(idle_timeout_s))
        ended = self.kv.grants.expire()
        due = [t for t in (self.kv.spaces.next_expiry(idle_timeout_s), self.kv.grants.next_expiry()) if t is not None]
        return Swept(evicted, closed, ended, min(due, default=None))

    def max_held_blocks(self) -> int:
        """A bound on the blocks one sequence's tables list, over all its KV groups (each group's table at most
        the whole pool): what sizes a KV export's header."""
        return len(self.groups) * self.pool.num_blocks

    def scales_now(self) -> tuple[tuple[float, float] | None, ...]:
        """Per layer, its float8 cache's (k, v) scales as of now; None while a calibrating layer has had no
        write (1.0 in a cache of the compute dtype). A snapshot for readers on other threads."""
        return tuple(self.scales.of(i) for i in range(self.config.model.num_layers))

    def export_manifest(self, seq_id: str, layers: Sequence[int] | None, *, tenant: str) -> KVManifest:
        """What an export of ``tenant``'s sequence sends (``layers`` None: all), as of now (KVExchange)."""
        return self.transfer.export_manifest(seq_id, layers, tenant=tenant)

    def export_views(self, manifest: KVManifest, records: Sequence[tuple[int, int]]) -> list[BlockView]:
        """The export's ``records`` (layer, logical block) read from the cache; ABORTED when the sequence changed
        since its manifest (KVExchange.export_views)."""
        return self.transfer.export_views(manifest, records)

    def release_exported(self, manifest: KVManifest) -> None:
        """Release the exported sequence, unless a call changed it since the export (KVExchange)."""
        self.transfer.release_exported(manifest)

    def begin_import(self, manifest: KVManifest | GrantManifest, *, tenant: str) -> ImportSession | GrantImport:
        """An import of ``manifest`` into ``tenant``'s sequences, or of a grant (GrantManifest) as ``tenant``'s:
        its blocks reserved now (KVExchange, GrantExchange)."""
        if isinstance(manifest, GrantManifest):
            return self.grant_transfer.begin_import(manifest, tenant=tenant)
        return self.transfer.begin_import(manifest, tenant=tenant)

    def import_records(self, session: ImportSession | GrantImport, records: Sequence[BlockRecord]) -> None:
        """Write an import's records into its reserved blocks (KVExchange.import_records)."""
        if isinstance(session, GrantImport):
            self.grant_transfer.import_records(session, records)
        else:
            self.transfer.import_records(session, records)

    def commit_import(self, session: ImportSession | GrantImport) -> int:
        """The import's sequence (grant), made from its blocks; how many blocks it holds (KVExchange)."""
        if isinstance(session, GrantImport):
            return self.grant_transfer.commit_import(session)
        return self.transfer.commit_import(session)

    def abort_import(self, session: ImportSession | GrantImport) -> None:
        """Return an import's reserved blocks (nothing to do after its commit)."""
        if isinstance(session, GrantImport):
            self.grant_transfer.abort_import(session)
        else:
            self.transfer.abort_import(session)

    def grant_leaving(self, ask: GrantAsk, *, tenant: str, whole: bool, within_s: float) -> Leaving:
        """A grant parked (``grant_blocks``) for another server: detached at once (no one here takes it; it
        ends ``within_s`` and a grace later if nobody releases it), with its stream's manifest and records
        (every block's every plane when ``whole``); ``release_grant`` it once sent (GrantExchange)."""
        done = self.grant_blocks(ask, tenant=tenant)
        grant = self.kv.grants.get(ask.grant_id, tenant=tenant)
        manifest, records = self.grant_transfer.detach(grant, ask.ttl_s, whole=whole, within_s=within_s)
        return Leaving(grant, manifest, records, done)

    def grant_views(self, grant: GrantState, items: Sequence[tuple[int, int]]) -> list[BlockView]:
        """A leaving grant's records (plane, block) (GrantExchange.views)."""
        return self.grant_transfer.views(grant, items)

    def release_grant(self, grant: GrantState) -> EngineStats:
        """Give back a leaving grant's name and blocks; the pool after."""
        self.kv.grants.release(grant)
        return self.stats()


C = TypeVar("C")
P = TypeVar("P")


def _each(calls: Sequence[C], plan: Callable[[C], P], results: list[Any]) -> list[tuple[int, P]]:
    """Per call that ``plan`` takes, its index and plan; a call it refuses gets its error in ``results`` (an
    EngineError; anything else is a bug, and still that call's alone: the others of its step go on)."""
    planned: list[tuple[int, P]] = []
    for i, call in enumerate(calls):
        try:
            planned.append((i, plan(call)))
        except Exception as e:
            results[i] = e
    return planned


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _top(x: torch.Tensor) -> float:
    """The largest |x| (0 for no tokens)."""
    return float(x.abs().amax()) if x.numel() else 0.0
