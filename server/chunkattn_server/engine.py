"""The engine: the one owner of the device, the KV pool and every sequence's state.

``Engine.attend(layer, entries, q, k, v)`` serves one call: one layer, one batch of sequences (prefill
pieces of any length and single-token decodes, mixed). It checks the whole request against the model and
the sequences' state first, reserves every block the call needs or none, then writes K/V, runs the
backend and frees the blocks no layer needs any more. A request that cannot be served raises an
``EngineError`` and changes nothing.

The engine is not thread-safe: exactly one worker calls it (the service's engine thread).
"""

from __future__ import annotations

import bisect
import math
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import MAX_BATCH, MAX_TOKENS, QUOTE_IDS, id_problem, quote, some
from chunkattn_server.attention.backends import AttentionBatch, Backend, TorchBackend
from chunkattn_server.config import EngineConfig, KVGroup, LayerSpec
from chunkattn_server.errors import (
    ConfigError,
    DataLoss,
    IncompatibleKV,
    InvalidBatch,
    InvalidTensor,
    OutOfBlocks,
    PositionMismatch,
    SequenceChanged,
    SequenceExists,
    UnknownLayer,
    UnknownSequence,
)
from chunkattn_server.kv.block_pool import BlockPool
from chunkattn_server.kv.cache import KVCache
from chunkattn_server.kv.sequences import Retention, SequenceState, chunk_start
from chunkattn_server.kv.transfer import BlockRecord, BlockView, KVManifest, ModelFingerprint, masked, record_bytes

# Tensors made from received bytes (requests, imported KV) are read-only views; the engine never writes into
# them, so torch.frombuffer's warning about it says nothing.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineStats:
    """The pool and the sequences at a glance (what the info RPC and metrics report)."""

    num_blocks: int
    free_blocks: int
    used_blocks: int
    block_size: int
    bytes_per_block: int
    num_sequences: int


@dataclass(frozen=True)
class SequenceInfo:
    """A copy of one sequence's state: tokens per layer and, per KV group, {logical block: physical block}."""

    seq_id: str
    lengths: tuple[int, ...]
    tables: tuple[dict[int, int], ...]
    last_used: float

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.tables)


def resolve_device(name: str) -> torch.device:
    """ "auto" -> CUDA when available, else CPU. Asking for CUDA without one is a start-up error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for but torch sees no CUDA device; use --device cpu")
    return device


def make_backend(name: str, device: torch.device) -> Backend:
    """ "auto": triton on CUDA, torch elsewhere; or the one named."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from chunkattn_server.attention.backends.triton_backend import TritonBackend  # imports triton

        return TritonBackend(device)
    return TorchBackend(device)


class Engine:
    """Paged KV cache + chunked-local attention for one model shape, on one device."""

    def __init__(self, config: EngineConfig, *, backend: Backend | None = None) -> None:
        self.config = config
        model = config.model
        self.device = resolve_device(config.device)
        dtype_name = config.cache.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = DTYPES[dtype_name]
        self.block_size = config.cache.block_size
        self.groups = config.kv_groups
        # Per layer: its KV group and storage slot (a KV-sharing layer's are its source's).
        self._group_of: list[KVGroup] = []
        self._slot_of: list[int] = []
        for i, spec in enumerate(model.layers):
            owner = i if spec.kv_source is None else spec.kv_source
            group = next(g for g in self.groups if owner in g.layers)
            self._group_of.append(group)
            self._slot_of.append(group.layers.index(owner))

        self.bytes_per_block = KVCache.bytes_per_block(
            num_slots=config.group_size,
            block_size=self.block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            itemsize=self.dtype.itemsize,
        )
        num_blocks = config.cache.num_blocks
        if num_blocks is None:
            assert config.cache.memory_bytes is not None  # CacheConfig guarantees one of the two
            num_blocks = config.cache.memory_bytes // self.bytes_per_block
            if num_blocks < 1:
                raise ConfigError(
                    f"a KV memory budget of {config.cache.memory_bytes} bytes holds no block of"
                    f" {self.bytes_per_block} bytes; raise the budget or lower block_size"
                )
        self.pool = BlockPool(num_blocks)
        self.cache = KVCache(
            num_slots=config.group_size,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            dtype=self.dtype,
            device=self.device,
        )
        self.backend: Backend = backend if backend is not None else make_backend(config.backend, self.device)
        self._retention = Retention(config)
        self._seqs: dict[str, SequenceState] = {}
        self._scales = [spec.scale or 1.0 / math.sqrt(model.head_size) for spec in model.layers]
        self._slopes = [
            None
            if spec.alibi_slopes is None
            else torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=self.device)
            for spec in model.layers
        ]

    # -- the data plane ------------------------------------------------------------------------------

    @torch.no_grad()  # the cache must never join an autograd graph, whatever the caller's tensors
    def attend(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the batch's K/V to the layer's cache and return chunked-local attention of q over it.

        Args:
            layer: the layer index.
            entries: one per sequence, in the order the tensors pack them; a sequence unknown to the
                engine is created when its entry starts at position 0.
            q: [T, num_heads, head_size] float32 / float16 / bfloat16, T = sum of num_tokens.
            k, v: [T, num_kv_heads, head_size], q's dtype; None for a KV-sharing layer.

        Returns:
            [T, num_heads, head_size] in q's dtype, on the engine's device.

        Raises:
            InvalidArgument (UnknownLayer, InvalidBatch, InvalidTensor), UnknownSequence,
            PositionMismatch, OutOfBlocks. Nothing has changed when one is raised.
        """
        spec = self._layer_spec(layer)
        entries = tuple(entries)  # a generator would be used up by the checks
        total = _check_entries(entries)
        self._check_tensors(layer, spec, total, q, k, v)
        states = [self._seqs.get(e.seq_id) for e in entries]
        self._check_positions(layer, spec, entries, states)
        group = self._group_of[layer]
        writes = self._plan_writes(layer, spec, entries, states)
        shared = self._shared_blocks_written(group, entries, writes, states)
        needed = sum(len(missing) for _, missing in writes) + sum(len(s) for s in shared)
        if not self.pool.can_allocate(needed):
            raise OutOfBlocks(
                f"layer {layer}: the batch needs {needed} new KV blocks of {self.block_size} tokens and the"
                f" pool has {self.pool.num_free} free of {self.pool.num_blocks}. Release finished sequences,"
                " retry later, send a smaller batch, or start the server with a larger pool"
            )

        created: list[str] = []
        taken: list[tuple[dict[int, int], int]] = []
        copied: list[tuple[dict[int, int], int, int]] = []  # (table, logical, the shared block it had)
        try:
            live: list[SequenceState] = []
            for e, state in zip(entries, states, strict=True):
                if state is None:
                    state = self._new_state(e.seq_id)
                    self._seqs[e.seq_id] = state
                    created.append(e.seq_id)
                live.append(state)
            for state, (_, missing) in zip(live, writes, strict=True):
                table = state.tables[group.index]
                if missing:
                    for logical, physical in zip(
                        missing, self.pool.allocate(len(missing), after=table.get(missing[0] - 1)), strict=True
                    ):
                        table[logical] = physical
                        taken.append((table, logical))
            for state, logicals in zip(live, shared, strict=True):
                table = state.tables[group.index]
                for logical in logicals:  # copy-on-write: never write into a block another sequence reads
                    old = table[logical]
                    (new,) = self.pool.allocate(1, after=table.get(logical - 1))
                    self.cache.copy_block(old, new)
                    table[logical] = new
                    copied.append((table, logical, old))
            out = self._compute(layer, spec, entries, live, writes, q, k, v).to(q.dtype)
        except BaseException:
            for table, logical, old in reversed(copied):
                self.pool.free([table[logical]])
                table[logical] = old
            self.pool.free(table.pop(logical) for table, logical in taken)
            for seq_id in created:
                del self._seqs[seq_id]
            raise

        for _, _, shared_block in copied:  # the copies are in use: drop this call's owners of the originals
            self.pool.free([shared_block])
        now = time.monotonic()
        for e, state in zip(entries, live, strict=True):
            old = state.lengths[layer]
            state.lengths[layer] = e.position + e.num_tokens
            state.last_used = now
            if chunk_start(old, spec.chunk_size) != chunk_start(state.lengths[layer], spec.chunk_size):
                table = state.tables[group.index]
                self.pool.free([table.pop(b) for b in self._retention.unneeded(state, group)])
        return out

    def _compute(
        self,
        layer: int,
        spec: LayerSpec,
        entries: Sequence[BatchEntry],
        states: list[SequenceState],
        writes: list[tuple[int, list[int]]],
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write the call's K/V into the cache and run the backend; returns [T, H, D] in the cache dtype."""
        group, slot, bs = self._group_of[layer], self._slot_of[layer], self.block_size
        tables = [s.tables[group.index] for s in states]
        if k is None or v is None:
            # KV sharing: the new tokens' K/V come back from the source's cache.
            slots = np.concatenate(
                [_slots(t, e.position, e.position + e.num_tokens, bs) for t, e in zip(tables, entries, strict=True)]
            )
            kc, vc = self.cache.read(slot, torch.from_numpy(slots).to(self.device))
        else:
            kc = k.to(device=self.device, dtype=self.dtype)
            vc = v.to(device=self.device, dtype=self.dtype)
            rows, slots_list, row = [], [], 0
            for table, e, (start, _) in zip(tables, entries, writes, strict=True):
                end = e.position + e.num_tokens
                if start < end:
                    rows.append(np.arange(row + start - e.position, row + e.num_tokens))
                    slots_list.append(_slots(table, start, end, bs))
                row += e.num_tokens
            if rows:
                index = torch.from_numpy(np.concatenate(rows)).to(self.device)
                full = index.numel() == kc.shape[0]
                self.backend.write(
                    self.cache.k[slot],
                    self.cache.v[slot],
                    torch.from_numpy(np.concatenate(slots_list)).to(self.device),
                    kc if full else kc.index_select(0, index),
                    vc if full else vc.index_select(0, index),
                )
        spans, row = [], 0
        for e in entries:
            spans.append((row, e.position, e.num_tokens))
            row += e.num_tokens
        batch = AttentionBatch(
            q=q.to(device=self.device, dtype=self.dtype),
            k=kc,
            v=vc,
            k_pages=self.cache.k[slot],
            v_pages=self.cache.v[slot],
            spans=spans,
            tables=tables,
            chunk_size=spec.chunk_size,
            block_size=bs,
            scale=self._scales[layer],
            alibi_slopes=self._slopes[layer],
        )
        out = torch.empty(q.shape, dtype=self.dtype, device=self.device)
        self.backend.attend(batch, out)
        return out

    def _plan_writes(
        self, layer: int, spec: LayerSpec, entries: Sequence[BatchEntry], states: list[SequenceState | None]
    ) -> list[tuple[int, list[int]]]:
        """Per entry: the first position to store, and the logical blocks to allocate for it.

        Only positions some layer will read again are stored: a 100,000-token prefill of a layer with
        C = 8192 stores (and allocates) its last chunk, not the whole prompt. A KV-sharing layer stores
        nothing.
        """
        group = self._group_of[layer]
        bs = self.block_size
        writes: list[tuple[int, list[int]]] = []
        fresh = [0] * self.config.model.num_layers  # a new sequence has no tokens anywhere
        for e, state in zip(entries, states, strict=True):
            end = e.position + e.num_tokens
            if spec.kv_source is not None:
                writes.append((end, []))
                continue
            start = max(e.position, self._retention.keep_from(state.lengths if state else fresh, layer, end))
            if e.num_tokens == 1:
                start = e.position  # a decode reads its own key from the cache (see plan.split)
            table = state.tables[group.index] if state else {}
            missing = [b for b in range(start // bs, -(-end // bs)) if b not in table]
            writes.append((start, missing))
        return writes

    def _shared_blocks_written(
        self,
        group: KVGroup,
        entries: Sequence[BatchEntry],
        writes: list[tuple[int, list[int]]],
        states: list[SequenceState | None],
    ) -> list[list[int]]:
        """Per entry: the logical blocks the call must copy before writing into them (after a fork).

        A block with n owners is copied by the first n - 1 of the call's entries that write into it; the
        last writer (a parent and its child decoding in one batch) then owns it alone and writes in place.
        """
        bs = self.block_size
        owners: dict[int, int] = {}
        out: list[list[int]] = []
        for e, (start, _), state in zip(entries, writes, states, strict=True):
            end = e.position + e.num_tokens
            copies: list[int] = []
            if state is not None and start < end:
                table = state.tables[group.index]
                for b in range(start // bs, -(-end // bs)):
                    block = table.get(b)
                    if block is None:
                        continue
                    left = owners.setdefault(block, self.pool.owners(block))
                    if left > 1:
                        copies.append(b)
                        owners[block] = left - 1
            out.append(copies)
        return out

    # -- the control plane ---------------------------------------------------------------------------

    def fork(self, parent: str, child: str) -> int:
        """A new sequence ``child`` with ``parent``'s tokens in every layer, sharing its blocks copy-on-write
        (parallel sampling, beam search): no copy now; whichever of the two first writes into a shared block
        gets its own copy then. Returns the number of blocks shared.

        Raises UnknownSequence (no parent), SequenceExists (child taken) or InvalidBatch (a bad id).
        """
        for what, seq_id in (("parent", parent), ("child", child)):
            problem = id_problem(seq_id, what)
            if problem:
                raise InvalidBatch(problem)
        state = self._seqs.get(parent)
        if state is None:
            raise UnknownSequence(f"cannot fork sequence {quote(parent)}: it does not exist")
        if child in self._seqs:
            raise SequenceExists(f"cannot fork into {quote(child)}: a sequence with that id exists; pick a new id")
        blocks = state.blocks()
        self.pool.share(blocks)
        self._seqs[child] = SequenceState(child, list(state.lengths), [dict(t) for t in state.tables])
        return len(blocks)

    # -- KV transfer (see kv/transfer.py) ---------------------------------------------------------------

    def fingerprint(self) -> ModelFingerprint:
        model = self.config.model
        return ModelFingerprint(
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            block_size=self.block_size,
            chunk_sizes=tuple(x.chunk_size for x in model.layers),
            kv_sources=tuple(x.kv_source for x in model.layers),
            cache_dtype=str(self.dtype).removeprefix("torch."),
        )

    def export_manifest(self, seq_id: str, layers: Sequence[int] | None = None) -> KVManifest:
        """What an export of ``seq_id`` (every layer, or ``layers``) sends. Raises UnknownSequence,
        UnknownLayer, or InvalidBatch for a layer listed twice, or a KV-sharing layer listed without its
        source or a source without its sharers (a source keeps older keys for its sharers: apart, either
        side's state would be wrong).

        Per KV group the manifest lists the blocks the exported layers need, nothing more."""
        problem = id_problem(seq_id)
        if problem:
            raise InvalidBatch(problem)
        model = self.config.model
        if layers is not None and len(set(layers)) != len(layers):
            raise InvalidBatch(f"{len(layers)} layers to export with repeats; list each layer once")
        listed = sorted(range(model.num_layers) if layers is None else layers)
        for layer in listed:
            spec = self._layer_spec(layer)
            if spec.kv_source is not None and spec.kv_source not in listed:
                raise InvalidBatch(
                    f"layer {layer} reads layer {spec.kv_source}'s KV: export layer {spec.kv_source} too"
                )
            missing = [s for s in self._retention.sharers_of(layer) if s not in listed]
            if missing:
                raise InvalidBatch(f"layer {layer}'s KV is read by layers {missing} (KV sharing): export them too")
        state = self._seqs.get(seq_id)
        if state is None:
            raise UnknownSequence(f"cannot export sequence {quote(seq_id)}: it does not exist")
        lengths = tuple(state.lengths[x] if x in listed else 0 for x in range(model.num_layers))
        blocks = []
        for group, table in zip(self.groups, state.tables, strict=True):
            spans = self._retention.needed_blocks(lengths, group)
            blocks.append(tuple(b for b in sorted(table) if any(lo <= b < hi for lo, hi in spans)))
        return KVManifest(
            seq_id=seq_id,
            model=self.fingerprint(),
            lengths=lengths,
            layers=tuple(x for x in listed if model.layers[x].kv_source is None),
            blocks=tuple(blocks),
            group_of=tuple(g.index for g in self._group_of),
        )

    def export_views(self, manifest: KVManifest, items: Sequence[tuple[int, int]]) -> list[BlockView]:
        """The records (layer, logical block) of an export with their checksums. A record carries only the
        positions its layer wrote and keeps ([Retention.held_from, length)); the rest of the block is zeros,
        never what an earlier holder of the block left there. Full blocks are views of the pages on the CPU
        (see BlockView: encode them before this engine runs anything else).

        Raises SequenceChanged when the sequence is no longer what the manifest describes."""
        state = self._seqs.get(manifest.seq_id)
        current = None if state is None else self.export_manifest(manifest.seq_id, self._listed(manifest))
        if current != manifest or state is None:
            raise SequenceChanged(f"sequence {quote(manifest.seq_id)} changed during its export; export it again")
        bs, heads = self.block_size, self.config.model.num_kv_heads
        views: list[BlockView] = []
        for layer in dict.fromkeys(x for x, _ in items):
            logicals = [b for x, b in items if x == layer]
            table = state.tables[self._group_of[layer].index]
            pieces = self.cache.block_views(self._slot_of[layer], [table[b] for b in logicals])
            lo, hi = self._retention.held_from(manifest.lengths, layer), manifest.lengths[layer]
            for b, (k, v) in zip(logicals, pieces, strict=True):
                first, end = min(max(lo - b * bs, 0), bs), min(max(hi - b * bs, 0), bs)
                if (first, end) == (0, bs):  # the whole block is the layer's: views, no copy
                    views.append(BlockView.of(layer, b, k, v))
                else:  # an edge of what the layer holds: a copy with the rest zeroed
                    views.append(
                        BlockView.of(layer, b, [masked(k, heads, bs, first, end)], [masked(v, heads, bs, first, end)])
                    )
        return views

    def begin_import(self, manifest: KVManifest) -> ImportSession:
        """Check a manifest against this engine and reserve every block it needs (see kv/transfer.py).

        The checks take time in proportion to the manifest's size, whatever it claims, and the blocks it
        lists must be exactly those its lengths need: a block no exported layer writes would hand the new
        sequence whatever an earlier holder left in it.

        Raises IncompatibleKV, InvalidBatch (a bad id), SequenceExists or OutOfBlocks, having reserved nothing."""
        self._check_manifest(manifest)
        problem = id_problem(manifest.seq_id)
        if problem:
            raise InvalidBatch(f"the imported sequence's {problem}")
        if manifest.seq_id in self._seqs:
            raise SequenceExists(f"cannot import into {quote(manifest.seq_id)}: a sequence with that id exists")
        total = sum(len(b) for b in manifest.blocks)
        if not self.pool.can_allocate(total):
            raise OutOfBlocks(
                f"the import needs {total} KV blocks and the pool has {self.pool.num_free} free of"
                f" {self.pool.num_blocks}; release sequences or start the server with a larger pool"
            )
        tables: list[dict[int, int]] = []
        for logicals in manifest.blocks:
            tables.append(dict(zip(logicals, self.pool.allocate(len(logicals)), strict=True)))
        return ImportSession(manifest, tables, set(manifest.expected()))

    def _check_manifest(self, manifest: KVManifest) -> None:
        """IncompatibleKV unless the manifest fits this model and describes a state this engine could hold."""
        diffs = self.fingerprint().differences(manifest.model)
        if diffs:
            raise IncompatibleKV("the KV comes from another model shape: " + "; ".join(diffs))
        model = self.config.model
        if (
            len(manifest.lengths) != model.num_layers
            or len(manifest.blocks) != len(self.groups)
            or manifest.group_of != tuple(g.index for g in self._group_of)
        ):
            raise IncompatibleKV(
                f"the KV manifest has {len(manifest.lengths)} layers and {len(manifest.blocks)} KV groups; this"
                f" model has {model.num_layers} layers in {len(self.groups)} KV groups"
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
        for group in self.groups:
            held = manifest.blocks[group.index]
            if len(held) > self.pool.num_blocks:
                raise OutOfBlocks(
                    f"the import needs {len(held)} KV blocks for KV group {group.index} alone, and this server's"
                    f" pool has {self.pool.num_blocks} in all"
                )
            needed = _merged(self._retention.needed_blocks(manifest.lengths, group))
            size = sum(hi - lo for lo, hi in needed)
            if size != len(held) or len(set(held)) != len(held) or not all(_within(needed, b) for b in held):
                raise IncompatibleKV(
                    f"the KV manifest lists {len(held)} blocks for KV group {group.index}, but its lengths need"
                    f" exactly the {size} blocks {_spans_text(needed)}"
                )

    def import_records(self, session: ImportSession, records: Sequence[BlockRecord]) -> None:
        """Check and write records of an import. Raises IncompatibleKV (unexpected, repeated or misshapen
        record) or DataLoss (checksum); the caller then aborts the session."""
        for r in records:
            key = (r.layer, r.logical)
            if key not in session.expected or key in session.received:
                raise IncompatibleKV(f"record (layer {r.layer}, block {r.logical}) is not expected or came twice")
            if len(r.k) + len(r.v) != record_bytes(session.manifest.model) or len(r.k) != len(r.v):
                raise IncompatibleKV(f"record (layer {r.layer}, block {r.logical}) has the wrong size")
            if not r.intact():
                raise DataLoss(f"record (layer {r.layer}, block {r.logical}) fails its checksum: the data is damaged")
            block = session.tables[self._group_of[r.layer].index][r.logical]
            slot = self._slot_of[r.layer]
            self.cache.write_block(slot, block, r.k, r.v)
            session.received.add(key)

    def commit_import(self, session: ImportSession) -> int:
        """Make the imported sequence visible; returns its block count. Raises DataLoss when records are
        missing or SequenceExists when the id was taken meanwhile; the caller then aborts the session."""
        missing = len(session.expected) - len(session.received)
        if missing:
            raise DataLoss(
                f"the KV stream ended with {missing} of {len(session.expected)} records missing: it was cut short"
            )
        seq_id = session.manifest.seq_id
        if seq_id in self._seqs:
            raise SequenceExists(f"cannot import into {quote(seq_id)}: a sequence with that id was created meanwhile")
        self._seqs[seq_id] = SequenceState(seq_id, list(session.manifest.lengths), session.tables)
        session.committed = True
        return sum(len(t) for t in session.tables)

    def _listed(self, manifest: KVManifest) -> list[int]:
        """The layers an export covered: its writing layers and their sharers."""
        sharers = (s for x in manifest.layers for s in self._retention.sharers_of(x))
        return sorted({*manifest.layers, *sharers})

    def release_exported(self, manifest: KVManifest) -> None:
        """Release a sequence that was exported, unless it changed since (SequenceChanged: then a call
        to it ran after the export, and releasing would lose what it wrote)."""
        state = self._seqs.get(manifest.seq_id)
        if state is None or self.export_manifest(manifest.seq_id, self._listed(manifest)) != manifest:
            raise SequenceChanged(
                f"sequence {quote(manifest.seq_id)} changed after its export, so it was not released here"
            )
        self.release([manifest.seq_id])

    def abort_import(self, session: ImportSession) -> None:
        """Return an unfinished import's blocks (idempotent; nothing to do after a commit)."""
        if not session.committed:
            self.pool.free(b for t in session.tables for b in t.values())
            session.tables = [{} for _ in session.tables]

    def release(self, seq_ids: Iterable[str], *, missing_ok: bool = False) -> int:
        """Drop sequences and return their blocks; returns how many existed.

        An unknown id raises UnknownSequence (and releases nothing) unless ``missing_ok``.
        """
        given = list(seq_ids)
        if len(given) > MAX_BATCH:
            raise InvalidBatch(f"{len(given)} sequences to release; at most {MAX_BATCH} per call")
        for i, seq_id in enumerate(given):
            problem = id_problem(seq_id)
            if problem:
                raise InvalidBatch(f"id {i}: {problem}; nothing was released")
        ids = list(dict.fromkeys(given))
        unknown = [s for s in ids if s not in self._seqs]
        if unknown and not missing_ok:
            raise UnknownSequence(
                f"{len(unknown)} of the {len(ids)} sequences to release do not exist ({some(unknown)});"
                " nothing was released (missing_ok ignores unknown ids)"
            )
        return self._drop(ids)

    def _drop(self, ids: Iterable[str]) -> int:
        """Drop the sequences of ``ids`` that exist and return their blocks; returns how many existed."""
        released = 0
        for seq_id in ids:
            state = self._seqs.pop(seq_id, None)
            if state is not None:
                self.pool.free(state.blocks())
                released += 1
        return released

    def evict_idle(self, max_idle_s: float, now: float | None = None) -> list[str]:
        """Release every sequence untouched for more than ``max_idle_s`` seconds; returns their ids."""
        now = time.monotonic() if now is None else now
        idle = [s for s, state in self._seqs.items() if now - state.last_used > max_idle_s]
        self._drop(idle)
        return idle

    def stats(self) -> EngineStats:
        return EngineStats(
            num_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free,
            used_blocks=self.pool.num_used,
            block_size=self.block_size,
            bytes_per_block=self.bytes_per_block,
            num_sequences=len(self._seqs),
        )

    def scale(self, layer: int) -> float:
        """The softmax scale the layer uses (its configured one, or 1 / sqrt(head_size))."""
        return self._scales[layer]

    def sequence_ids(self) -> list[str]:
        return list(self._seqs)

    def sequence(self, seq_id: str) -> SequenceInfo:
        """A copy of a sequence's state. Raises UnknownSequence."""
        state = self._seqs.get(seq_id)
        if state is None:
            raise UnknownSequence(f"sequence {quote(seq_id)} does not exist")
        return SequenceInfo(
            seq_id=seq_id,
            lengths=tuple(state.lengths),
            tables=tuple(dict(sorted(t.items())) for t in state.tables),
            last_used=state.last_used,
        )

    # -- checks: everything is checked before anything changes ----------------------------------------

    def _new_state(self, seq_id: str) -> SequenceState:
        return SequenceState(seq_id, [0] * self.config.model.num_layers, [{} for _ in self.groups])

    def _layer_spec(self, layer: int) -> LayerSpec:
        layers = self.config.model.layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
            raise UnknownLayer(f"layer {quote(layer)} does not exist; the model has layers 0..{len(layers) - 1}")
        return layers[layer]

    def _check_tensors(
        self,
        layer: int,
        spec: LayerSpec,
        total: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> None:
        model = self.config.model
        _check_tensor("q", q, (total, model.num_heads, model.head_size), "[tokens, num_heads, head_size]", None)
        if spec.kv_source is not None:
            if k is not None or v is not None:
                raise InvalidTensor(
                    f"layer {layer} reads layer {spec.kv_source}'s KV cache (KV sharing) and writes none:"
                    " send q only, without k and v"
                )
            return
        if k is None or v is None:
            raise InvalidTensor(f"layer {layer} writes its own KV cache: k and v are required")
        shape = (total, model.num_kv_heads, model.head_size)
        _check_tensor("k", k, shape, "[tokens, num_kv_heads, head_size]", q.dtype)
        _check_tensor("v", v, shape, "[tokens, num_kv_heads, head_size]", q.dtype)

    def _check_positions(
        self, layer: int, spec: LayerSpec, entries: Sequence[BatchEntry], states: list[SequenceState | None]
    ) -> None:
        for e, state in zip(entries, states, strict=True):
            if state is None:
                if e.position != 0:
                    raise UnknownSequence(
                        f"sequence {quote(e.seq_id)} does not exist; a new sequence starts at position 0,"
                        f" got position {e.position}"
                    )
            elif e.position != state.lengths[layer]:
                have = state.lengths[layer]
                raise PositionMismatch(
                    f"sequence {quote(e.seq_id)} has {have} tokens in layer {layer}, so its next position is"
                    f" {have}; got position {e.position}"
                )
            source = spec.kv_source
            if source is not None:
                held = state.lengths[source] if state else 0
                if e.position + e.num_tokens > held:
                    raise PositionMismatch(
                        f"layer {layer} reads layer {source}'s KV cache, which holds {held} tokens of sequence"
                        f" {quote(e.seq_id)}; positions up to {e.position + e.num_tokens - 1} need layer {source}"
                        " to be called first"
                    )


def _check_entries(entries: Sequence[BatchEntry]) -> int:
    """Validate batch metadata on its own; returns the total number of tokens."""
    if not entries:
        raise InvalidBatch("the batch is empty; send at least one sequence")
    if len(entries) > MAX_BATCH:
        raise InvalidBatch(f"the batch has {len(entries)} sequences; at most {MAX_BATCH} per call")
    seen: set[str] = set()
    for i, e in enumerate(entries):
        if not isinstance(e, BatchEntry):
            raise InvalidBatch(
                f"entry {i} is a {type(e).__name__}; expected a BatchEntry(seq_id, position, num_tokens)"
            )
        problem = id_problem(e.seq_id)
        if problem:
            raise InvalidBatch(f"entry {i}: {problem}")
        if isinstance(e.position, bool) or not isinstance(e.position, int) or e.position < 0:
            raise InvalidBatch(
                f"entry {i} ({quote(e.seq_id)}): position must be an integer >= 0, got {quote(e.position)}"
            )
        if isinstance(e.num_tokens, bool) or not isinstance(e.num_tokens, int) or e.num_tokens < 1:
            raise InvalidBatch(
                f"entry {i} ({quote(e.seq_id)}): num_tokens must be an integer >= 1, got {quote(e.num_tokens)}"
            )
        if e.position + e.num_tokens > MAX_TOKENS:
            raise InvalidBatch(
                f"entry {i} ({quote(e.seq_id)}): position {e.position} + num_tokens {e.num_tokens} is past the"
                f" longest sequence served, {MAX_TOKENS} tokens"
            )
        if e.seq_id in seen:
            raise InvalidBatch(
                f"sequence {quote(e.seq_id)} appears twice in the batch; send each sequence once per call"
            )
        seen.add(e.seq_id)
    return sum(e.num_tokens for e in entries)


def _check_tensor(name: str, t: object, shape: tuple[int, ...], meaning: str, dtype: torch.dtype | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTensor(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES.values():
        raise InvalidTensor(f"{name} has dtype {t.dtype}; expected float32, float16 or bfloat16")
    if dtype is not None and t.dtype != dtype:
        raise InvalidTensor(f"{name} has dtype {t.dtype}; expected q's dtype {dtype}")
    if tuple(t.shape) != shape:
        raise InvalidTensor(f"{name} has shape {list(t.shape)}; expected {list(shape)} {meaning}")


@dataclass
class ImportSession:
    """An import in progress: its reserved blocks (per KV group), the records expected and received."""

    manifest: KVManifest
    tables: list[dict[int, int]]
    expected: set[tuple[int, int]]
    received: set[tuple[int, int]] = field(default_factory=set)
    committed: bool = False


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


def _slots(table: dict[int, int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots (physical block * block_size + offset) [end - start] int64 of positions start..end-1."""
    first, last = start // block_size, (end - 1) // block_size
    physical = np.fromiter((table[b] for b in range(first, last + 1)), dtype=np.int64, count=last - first + 1)
    positions = np.arange(start, end, dtype=np.int64)
    return physical[positions // block_size - first] * block_size + positions % block_size
