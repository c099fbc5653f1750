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

The engine is not thread-safe: exactly one worker calls it (the scheduler's thread).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from chunkattn_client import dtypes, work
from chunkattn_client.batch import BatchEntry
from chunkattn_server import torchtypes
from chunkattn_server.attention.backends import AttentionBatch, Backend
from chunkattn_server.config import EngineConfig, LayerSpec, default_call_work
from chunkattn_server.engine import blocks, checks
from chunkattn_server.engine.device import make_backend, resolve_device
from chunkattn_server.engine.entries import Entries
from chunkattn_server.engine.types import AttendCall, BlockCall, EngineStats, Retry
from chunkattn_server.errors import (
    InvalidTensor,
    OutOfBlocks,
)
from chunkattn_server.kv.cache import KVCache, token_slots
from chunkattn_server.kv.manager import KVManager
from chunkattn_server.kv.manifest import ModelFingerprint
from chunkattn_server.kv.records import Reservation, Write
from chunkattn_server.kv.scales import KVScaleTable
from chunkattn_server.kv.sequences import SequenceState
from chunkattn_server.kv.spaces import BlockSpace
from chunkattn_server.kv.transfer import KVExchange

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
        self.scales = KVScaleTable.starting(model, config.cache.scales, dtypes.BY_NAME[cache], dtypes.BY_NAME[compute])
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
        self._on_cpu = self.device.type == "cpu"
        # The most work one call may ask for (chunkattn_client.work; 0: any): what it may hold the device for.
        limit = config.max_call_work
        self.max_call_work = default_call_work(self.device.type) if limit is None else limit
        self._scales = [model.scale_of(i) for i in range(model.num_layers)]
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
        head_size] in its q's dtype) or the error it fails with alone, nothing of it written."""
        with torch.no_grad():
            return blocks.attend_step(self, layer, calls)

    def open_space(self, num_blocks: int, planes: Sequence[int], *, tenant: str, lease_s: float = 0.0) -> BlockSpace:
        """A new block space of ``tenant`` (kv/spaces.py). Its blocks are not zeroed now: each is zeroed by the
        first call that touches it (engine/blocks.py), so no previous owner's K/V ever shows and opening costs
        no more than the pool's bookkeeping."""
        return self.kv.spaces.open(num_blocks, planes, tenant=tenant, lease_s=lease_s)

    def _attend_step(self, layer: int, calls: Sequence[AttendCall]) -> list[torch.Tensor | Exception | Retry]:
        results: list[torch.Tensor | Exception | Retry] = [Retry()] * len(calls)
        spec = self.config.model.spec(layer)
        planned: list[tuple[int, list[SequenceState | None], list[Write]]] = []
        for i, call in enumerate(calls):
            try:
                states, writes = self._plan(layer, spec, call)
            except Exception as e:  # an EngineError; anything else is a bug, and still this call's alone
                results[i] = e
            else:
                planned.append((i, states, writes))
        seen: set[tuple[str, str]] = set()
        for i, _, _ in planned:
            ids = {(calls[i].tenant, e.seq_id) for e in calls[i].entries}
            assert seen.isdisjoint(ids), "calls of one step must not share a sequence"
            seen |= ids
        owners: dict[int, int] = {}
        reserved: list[tuple[int, Reservation]] = []
        for i, states, writes in planned:
            try:
                reserved.append(
                    (i, self.kv.reserve(layer, calls[i].entries, states, writes, owners, tenant=calls[i].tenant))
                )
            except OutOfBlocks as e:
                results[i] = Retry() if reserved else e
        if not reserved:
            return results
        try:
            out = self._compute_step(layer, spec, [calls[i] for i, _ in reserved], [r for _, r in reserved])
        except BaseException:
            for _, r in reversed(reserved):
                self.kv.rollback(r)
            raise
        now = time.monotonic()
        row = 0
        for i, r in reserved:
            self.kv.commit(r, now)
            n = calls[i].q.shape[0]
            part = out if len(reserved) == 1 else out[row : row + n]
            results[i] = part if part.dtype == calls[i].q.dtype else part.to(calls[i].q.dtype)
            row += n
        return results

    def _plan(self, layer: int, spec: LayerSpec, call: AttendCall) -> tuple[list[SequenceState | None], list[Write]]:
        """A call's checks (everything is checked before anything changes) and its write plan."""
        # Entries were checked where they were built (the service's parser): only a plain list is checked here.
        entries = call.entries
        total = sum(e.num_tokens for e in entries) if isinstance(entries, Entries) else checks.check_entries(entries)
        checks.check_tensors(
            self.config.model, layer, spec, call.entries, total, call.q, call.k, call.v, self.dtype, self.cache_dtype
        )
        if call.k is not None and call.v is not None and self.scales.calibrating(layer):
            self.check_calibration(self.on_device(call.k), self.on_device(call.v))
        states = [self.kv.get(e.seq_id, tenant=call.tenant) for e in call.entries]
        checks.check_positions(layer, spec, call.entries, states)
        if self.max_call_work:
            done = sum(work.entry_work(e.position, e.num_tokens, spec.chunk_size) for e in call.entries)
            checks.check_work(done, self.max_call_work)
        return states, self.kv.plan_writes(layer, spec, call.entries, states)

    def _compute_step(
        self, layer: int, spec: LayerSpec, calls: Sequence[AttendCall], reserved: Sequence[Reservation]
    ) -> torch.Tensor:
        """One compute over the reserved calls' tokens, in their order: [sum T_i, H, D] in the cache dtype."""
        if len(calls) == 1:
            c, r = calls[0], reserved[0]
            return self._compute(layer, spec, r.entries, r.states, r.writes, c.q, c.k, c.v)
        entries = [e for r in reserved for e in r.entries]
        states = [s for r in reserved for s in r.states]
        writes = [w for r in reserved for w in r.writes]

        def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            if ts[0] is None:
                return None
            return torch.cat([self.on_device(t) for t in ts if t is not None])

        q = cat([c.q for c in calls])
        assert q is not None
        return self._compute(
            layer, spec, entries, states, writes, q, cat([c.k for c in calls]), cat([c.v for c in calls])
        )

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the engine's device in the compute dtype (itself when it is already: ``to`` is not free)."""
        if self._on_cpu and t.dtype == self.dtype and t.is_cpu:
            return t
        return t.to(device=self.device, dtype=self.dtype)

    def _compute(
        self,
        layer: int,
        spec: LayerSpec,
        entries: Sequence[BatchEntry],
        states: Sequence[SequenceState],
        writes: Sequence[Write],
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write the call's K/V into the cache and run the backend; returns [T, H, D] in the compute dtype."""
        group, plane, bs = self.kv.group_of[layer], self._plane_of[layer], self.block_size
        tables = [s.tables[group.index] for s in states]
        source = layer if spec.kv_source is None else spec.kv_source
        if k is None or v is None:  # KV sharing: the new tokens' K/V come back from the source's cache
            kc, vc = self._read_back(source, plane, tables, entries)
        else:
            kc, vc = self._store(source, plane, tables, entries, writes, self.on_device(k), self.on_device(v))
        k_scale, v_scale = self.read_scales(source)
        spans, row = [], 0
        for e in entries:
            spans.append((row, e.position, e.num_tokens))
            row += e.num_tokens
        batch = AttentionBatch(
            q=self.on_device(q),
            k=kc,
            v=vc,
            k_pages=self.cache.k[plane],
            v_pages=self.cache.v[plane],
            spans=spans,
            tables=tables,
            chunk_size=spec.chunk_size,
            block_size=bs,
            scale=self._scales[layer],
            alibi_slopes=self.slopes(layer),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        out = torch.empty(q.shape, dtype=self.dtype, device=self.device)
        self.backend.attend(batch, out)
        return out

    def _read_back(
        self, source: int, plane: int, tables: Sequence[dict[int, int]], entries: Sequence[BatchEntry]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K/V [T, Hkv, D] in the compute dtype, read from the source layer's cache (a
        KV-sharing layer writes none)."""
        bs = self.block_size
        slots = _concat(
            [token_slots(t, e.position, e.position + e.num_tokens, bs) for t, e in zip(tables, entries, strict=True)]
        )
        return self.cache.read(plane, self.index(slots), self.read_scales(source), self.dtype)

    def _store(
        self,
        source: int,
        plane: int,
        tables: Sequence[dict[int, int]],
        entries: Sequence[BatchEntry],
        writes: Sequence[Write],
        kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the call's K/V ([T, Hkv, D], compute dtype) at its writes' cache slots (a float8 cache: over
        the layer's scales, calibrated by this write if it is the first); returns them as the cache holds them
        (KVCache.write)."""
        scales = self.write_scales(source, kc, vc) if self._converts else (1.0, 1.0)
        # The rows of k/v to store and their cache slots; usually every row (a decode, a short prefill).
        rows: list[tuple[int, int]] = []
        slot_parts: list[np.ndarray] = []
        full, row = True, 0
        for table, e, w in zip(tables, entries, writes, strict=True):
            if w.start < w.end:
                rows.append((row + w.start - e.position, row + e.num_tokens))
                slot_parts.append(token_slots(table, w.start, w.end, self.block_size))
            full = full and w.start == e.position
            row += e.num_tokens
        slots = self.index(_concat(slot_parts) if slot_parts else np.empty(0, np.int64))
        index = None if full or not slot_parts else self.index(_concat([np.arange(a, b) for a, b in rows]))
        return self.cache.write(plane, slots, kc, vc, scales, index)

    def read_scales(self, layer: int) -> tuple[float, float]:
        """A layer's cache scales (k, v), its first write having calibrated them where it had to."""
        scales = self.scales.of(layer)
        assert scales is not None, "a calibrating layer is read only after its first write"
        return scales

    def write_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        """The scales a write of ``k``, ``v`` ([T, Hkv, D] in the compute dtype, as they are stored) is stored
        over: the layer's, set now from this write if it is calibrating (kv/scales.py: max |x| / K_RANGE or
        V_RANGE, as vLLM's calculate_kv_scales). Each call of a step was checked on its own (_plan), so their
        merged first write calibrates without error: its largest values are one of theirs."""
        if not self.scales.calibrating(layer):
            return self.read_scales(layer)
        return self.scales.calibrated(layer, _top(k), _top(v))

    def check_calibration(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """InvalidTensor for a first write that cannot calibrate a layer's scales (one too small to read back
        would store every later value as 0); ``k``, ``v`` as for ``write_scales``."""
        assert self.scales.range is not None
        try:
            self.scales.range.calibrate(_top(k), _top(v))
        except ValueError as e:
            raise InvalidTensor(f"{e}. Nothing was written") from None

    def index(self, values: np.ndarray) -> torch.Tensor:
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
            kv_sources=tuple(x.kv_source for x in model.layers),
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
        )

    def scale(self, layer: int) -> float:
        """The softmax scale the layer uses (its configured one, or 1 / sqrt(head_size))."""
        return self._scales[layer]

    def slopes(self, layer: int) -> torch.Tensor | None:
        """The layer's ALiBi slopes [num_heads] float32 on the device, or None."""
        return self._slopes[layer]


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _top(x: torch.Tensor) -> float:
    """The largest |x| (0 for no tokens)."""
    return float(x.abs().amax()) if x.numel() else 0.0
