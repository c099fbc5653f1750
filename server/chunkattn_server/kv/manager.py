"""The KV manager: every sequence's state, the block pool, retention and copy-on-write. Plain Python, no torch.

The engine asks it, per Attend call, for a *write plan* (which positions to store, which blocks are
missing), then a *reservation* (the blocks allocated, new sequences created, shared blocks copied: all of
the call's or none), and after the step's compute either ``commit`` (lengths grow, blocks out of every
layer's chunk go back to the pool) or ``rollback`` (as if the call had never come). Several calls may hold
reservations at once (one engine step); they touch disjoint sequences.

The control plane lives here too: fork (copy-on-write sharing), truncate (speculative decoding's rollback),
release, idle eviction, and the read-only views the info RPC and the tests use; and the block API's spaces
(kv/spaces.py), whose blocks come from the same pool under the same quotas.

Every sequence belongs to a *tenant* (a string; "" when the server has no authentication) and is named by
(tenant, seq_id): two tenants' "s1" are two sequences, and nothing here lets one tenant's call name
another's. A tenant may have a ``Quota`` (KV blocks and sequences held); a call that would pass it is
refused (QuotaExceeded, a kind of OutOfBlocks) and changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import MAX_BATCH, MAX_TOKENS, id_problem, quote, some
from chunkattn_server.config import EngineConfig, KVGroup, LayerSpec
from chunkattn_server.errors import (
    InvalidBatch,
    OutOfBlocks,
    PositionMismatch,
    QuotaExceeded,
    SequenceExists,
    UnknownSequence,
)
from chunkattn_server.kv.block_pool import BlockPool
from chunkattn_server.kv.grants import Grants
from chunkattn_server.kv.records import Quota, Reservation, SequenceInfo, Truncation, Write
from chunkattn_server.kv.sequences import Refusal, Retention, SequenceState
from chunkattn_server.kv.spaces import BlockSpaces


class KVManager:
    """Sequences and blocks for one engine config. ``copy_block(src, dst)`` copies a block's pages in
    every layer (the cache's job: copy-on-write after a fork)."""

    def __init__(self, config: EngineConfig, num_blocks: int, copy_block: Callable[[int, int], None]) -> None:
        self.config = config
        self.block_size = config.cache.block_size
        self.groups = config.kv_groups
        self.pool = BlockPool(num_blocks)
        self.retention = Retention(config)
        self._copy_block = copy_block
        self._seqs: dict[tuple[str, str], SequenceState] = {}  # (tenant, seq_id) -> state
        self._count: dict[str, int] = {}  # tenant -> sequences held
        self._incoming: dict[str, int] = {}  # tenant -> imports begun and not yet ended (sequences to come)
        self.quotas: dict[str, Quota] = {}  # tenant -> its quota (none: no limit)
        # The block API's spaces: their blocks come from the same pool, under the same quotas.
        self.spaces = BlockSpaces(self.pool, config.model, config.group_size, self.check_quota)
        # Their handoffs: blocks of a space parked under a grant until another space takes them.
        self.grants = Grants(
            self.pool,
            self.check_quota,
            self.block_size,
            config.group_size,
            lambda tenant, blocks, now: self.spaces.charge(tenant, blocks, now=now, what="this grant"),
        )
        self.group_of: list[KVGroup] = []  # per layer; a KV-sharing layer's is its source's
        for i, spec in enumerate(config.model.layers):
            owner = i if spec.kv_source is None else spec.kv_source
            self.group_of.append(next(g for g in self.groups if owner in g.layers))

    # -- one Attend call: plan -> reserve -> commit or rollback ---------------------------------------

    def get(self, seq_id: str, *, tenant: str) -> SequenceState | None:
        return self._seqs.get((tenant, seq_id))

    def plan_writes(
        self, layer: int, spec: LayerSpec, entries: Sequence[BatchEntry], states: Sequence[SequenceState | None]
    ) -> list[Write]:
        """Per entry: what the call stores and the blocks it lacks (pure: nothing changes).

        Only positions some layer will read again are stored: a 100,000-token prefill of a layer with
        C = 8192 stores (and allocates) its last chunk, not the whole prompt. A KV-sharing layer stores
        nothing.
        """
        group = self.group_of[layer]
        bs = self.block_size
        writes: list[Write] = []
        fresh = [0] * self.config.model.num_layers  # a new sequence has no tokens anywhere
        for e, state in zip(entries, states, strict=True):
            end = e.position + e.num_tokens
            if spec.kv_source is not None:
                writes.append(Write(end, end, []))
                continue
            if e.num_tokens == 1:
                start = e.position  # a decode reads its own key from the cache (see plan.split)
            else:
                start = max(e.position, self.retention.keep_from(state.lengths if state else fresh, layer, end))
            table = state.tables[group.index] if state else {}
            writes.append(Write(start, end, [b for b in range(start // bs, -(-end // bs)) if b not in table]))
        return writes

    def reserve(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        states: Sequence[SequenceState | None],
        writes: list[Write],
        owners: dict[int, int],
        *,
        tenant: str,
    ) -> Reservation:
        """Take every block the call needs, or none (OutOfBlocks, QuotaExceeded). ``owners`` carries, across
        the calls of one step, how many owners each shared block still has once the earlier calls' copies are
        made, so that the last writer of a shared block writes in place, as it would have alone."""
        group = self.group_of[layer]
        mine = dict(owners)
        shared = self._shared_blocks_written(group, entries, writes, states, mine)
        needed = sum(len(w.missing) for w in writes) + sum(len(s) for s in shared)
        self.check_quota(tenant, needed, sum(s is None for s in states))
        if not self.pool.can_allocate(needed):
            raise OutOfBlocks(
                f"layer {layer}: the batch needs {needed} new KV blocks of {self.block_size} tokens and the"
                f" pool has {self.pool.num_free} free of {self.pool.num_blocks}. Release finished sequences,"
                " retry later, send a smaller batch, or start the server with a larger pool"
            )
        r = Reservation(layer, entries, writes, tenant)
        try:
            for e, state in zip(entries, states, strict=True):
                if state is None:
                    state = SequenceState(
                        e.seq_id, [0] * self.config.model.num_layers, [{} for _ in self.groups], tenant=tenant
                    )
                    self._insert(state)
                    r.created.append(e.seq_id)
                r.states.append(state)
            for state, w in zip(r.states, writes, strict=True):
                table = state.tables[group.index]
                if w.missing:
                    after = table.get(w.missing[0] - 1)
                    taken = self.pool.allocate(len(w.missing), after, account=tenant)
                    for logical, physical in zip(w.missing, taken, strict=True):
                        table[logical] = physical
                        r.taken.append((table, logical))
            for state, logicals in zip(r.states, shared, strict=True):
                table = state.tables[group.index]
                for logical in logicals:  # copy-on-write: never write into a block another sequence reads
                    old = table[logical]
                    (new,) = self.pool.allocate(1, table.get(logical - 1), account=tenant)
                    self._copy_block(old, new)
                    table[logical] = new
                    r.copied.append((table, logical, old))
        except BaseException:
            self.rollback(r)
            raise
        owners.update(mine)
        return r

    def rollback(self, r: Reservation) -> None:
        """Undo a reservation: its blocks back to the pool, its new sequences gone, its copies dropped."""
        for table, logical, old in reversed(r.copied):
            self.pool.free([table[logical]])
            table[logical] = old
        self.pool.free(table.pop(logical) for table, logical in r.taken)
        for seq_id in r.created:
            self._remove(r.tenant, seq_id)
        r.copied, r.taken, r.created = [], [], []

    def commit(self, r: Reservation, now: float) -> None:
        """The call's K/V is written: its sequences grow, and blocks no layer needs any more are freed."""
        for _, _, shared_block in r.copied:  # the copies are in use: drop this call's owners of the originals
            self.pool.free([shared_block])
        source = self.config.model.layers[r.layer].kv_source
        owner = r.layer if source is None else source  # the layer whose cache the call wrote or read
        group = self.group_of[r.layer]
        for e, state, w in zip(r.entries, r.states, r.writes, strict=True):
            state.lengths[r.layer] = e.position + e.num_tokens
            state.last_used = now
            before = state.kept_from[owner]
            if source is None and w.start > e.position:  # a long prefill stored its last chunk(s) only
                state.kept_from[owner] = w.start
            self.retention.settle(state, owner)
            if state.kept_from[owner] != before:
                table = state.tables[group.index]
                self.pool.free([table.pop(b) for b in self.retention.unneeded(state, group)])

    def _shared_blocks_written(
        self,
        group: KVGroup,
        entries: Sequence[BatchEntry],
        writes: list[Write],
        states: Sequence[SequenceState | None],
        owners: dict[int, int],
    ) -> list[list[int]]:
        """Per entry: the logical blocks the call must copy before writing into them (after a fork).

        A block with n owners is copied by the first n - 1 writers into it; the last writer (a parent and
        its child decoding in one step) then owns it alone and writes in place.
        """
        bs = self.block_size
        out: list[list[int]] = []
        for w, state in zip(writes, states, strict=True):
            copies: list[int] = []
            if state is not None and w.start < w.end:
                table = state.tables[group.index]
                for b in range(w.start // bs, -(-w.end // bs)):
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

    def check_quota(self, tenant: str, blocks: int, sequences: int) -> None:
        """QuotaExceeded when ``tenant`` holding ``blocks`` more KV blocks and ``sequences`` more sequences
        would pass its quota."""
        quota = self.quotas.get(tenant)
        if quota is None:
            return
        held = self.pool.used_by(tenant)
        if quota.max_blocks is not None and blocks and held + blocks > quota.max_blocks:
            raise QuotaExceeded(
                f"the call needs {blocks} more KV blocks and your tenant holds {held} of its quota of"
                f" {quota.max_blocks} (max_kv_blocks); release finished sequences, or ask the operator for more"
            )
        count = self._count.get(tenant, 0) + self._incoming.get(tenant, 0)
        if quota.max_sequences is not None and sequences and count + sequences > quota.max_sequences:
            raise QuotaExceeded(
                f"the call starts {sequences} new sequences and your tenant holds {count} of its quota of"
                f" {quota.max_sequences} (max_sequences); release finished sequences, or ask the operator for more"
            )

    def expect(self, tenant: str, n: int) -> None:
        """Count ``n`` (or, negative, no longer) sequences to come for ``tenant``'s quota: an import between
        its header, which reserves its blocks, and its commit."""
        left = self._incoming.get(tenant, 0) + n
        if left:
            self._incoming[tenant] = left
        else:
            self._incoming.pop(tenant, None)

    def fork(self, parent: str, child: str, *, tenant: str) -> int:
        """A new sequence ``child`` with ``parent``'s tokens in every layer, sharing its blocks copy-on-write
        (parallel sampling, beam search): no copy now; whichever of the two first writes into a shared block
        gets its own copy then. Returns the number of blocks shared.

        Raises UnknownSequence (no parent), SequenceExists (child taken), InvalidBatch (a bad id) or
        QuotaExceeded (the tenant holds as many sequences as it may).
        """
        for what, seq_id in (("parent", parent), ("child", child)):
            problem = id_problem(seq_id, what)
            if problem:
                raise InvalidBatch(problem)
        state = self._seqs.get((tenant, parent))
        if state is None:
            raise UnknownSequence(f"cannot fork sequence {quote(parent)}: it does not exist")
        if (tenant, child) in self._seqs:
            raise SequenceExists(f"cannot fork into {quote(child)}: a sequence with that id exists; pick a new id")
        self.check_quota(tenant, 0, 1)
        blocks = state.blocks()
        self.pool.share(blocks)
        tables = [dict(t) for t in state.tables]
        self._insert(SequenceState(child, list(state.lengths), tables, tenant=tenant, kept_from=list(state.kept_from)))
        return len(blocks)

    def truncate(self, seq_id: str, length: int, *, tenant: str) -> Truncation:
        """Take ``tenant``'s sequence back to its first ``length`` tokens in every layer, as if the later ones
        had never been sent (speculative decoding drops the drafts a verify call rejected): each layer holds
        min(its length, ``length``) tokens, and the blocks no layer needs any more go back to the pool (a
        block shared with a fork loses this sequence as an owner only; later writes into it copy it first).

        Allowed where every layer still holds the keys it would read again (``Retention.refusal``): from
        ``min_length`` on, and at a chunk boundary of every chunked layer. Raises InvalidBatch (a bad id or
        length), UnknownSequence, or PositionMismatch (past the sequence's length, or further back than its
        layers hold); nothing has changed then.
        """
        problem = id_problem(seq_id)
        if problem:
            raise InvalidBatch(problem)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= MAX_TOKENS:
            raise InvalidBatch(f"length must be an integer from 0 to {MAX_TOKENS}, got {quote(length)}")
        state = self._seqs.get((tenant, seq_id))
        if state is None:
            raise UnknownSequence(f"cannot truncate sequence {quote(seq_id)}: it does not exist")
        total = max(state.lengths)
        if length > total:
            raise PositionMismatch(
                f"cannot truncate sequence {quote(seq_id)} to {length} tokens: it has {total}; truncation only"
                " drops tokens"
            )
        refusal = self.retention.refusal(state.lengths, state.kept_from, length)
        if refusal is not None:
            raise PositionMismatch(self._refusal_text(seq_id, length, refusal, state))
        released = 0
        if length < total:
            self.retention.truncate(state, length)
            state.last_used = time.monotonic()
            for group in self.groups:
                table = state.tables[group.index]
                gone = [table.pop(b) for b in self.retention.unneeded(state, group)]
                self.pool.free(gone)
                released += len(gone)
        return Truncation(released, total - length, self.retention.min_length(state.lengths, state.kept_from))

    def _refusal_text(self, seq_id: str, length: int, refusal: Refusal, state: SequenceState) -> str:
        r = refusal
        whose = "its own" if r.reader == r.layer else f"layer {r.layer}'s"
        return (
            f"cannot truncate sequence {quote(seq_id)} to {length} tokens: layer {r.reader} (chunk size"
            f" {r.chunk_size}) would read positions from {r.reads_from} on again, and {whose} cache holds them from"
            f" {r.kept_from} on only (a chunked layer keeps its current chunk and --spec-window"
            f" {self.retention.window} tokens before it). It may go back to"
            f" min_length={self.retention.min_length(state.lengths, state.kept_from)} tokens or more, or to a chunk"
            f" boundary of every chunked layer ({self.retention.boundary(length)} is the nearest)"
        )

    def add(self, state: SequenceState) -> None:
        """Make a sequence whose blocks are already allocated visible (a committed import). SequenceExists
        when its id is taken."""
        if (state.tenant, state.seq_id) in self._seqs:
            raise SequenceExists(
                f"cannot import into {quote(state.seq_id)}: a sequence with that id was created meanwhile"
            )
        self._insert(state)

    def release(self, seq_ids: Iterable[str], *, missing_ok: bool = False, tenant: str) -> int:
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
        unknown = [s for s in ids if (tenant, s) not in self._seqs]
        if unknown and not missing_ok:
            raise UnknownSequence(
                f"{len(unknown)} of the {len(ids)} sequences to release do not exist ({some(unknown)});"
                " nothing was released (missing_ok ignores unknown ids)"
            )
        return self._drop((tenant, s) for s in ids)

    def _insert(self, state: SequenceState) -> None:
        self._seqs[state.tenant, state.seq_id] = state
        self._count[state.tenant] = self._count.get(state.tenant, 0) + 1

    def _remove(self, tenant: str, seq_id: str) -> SequenceState | None:
        state = self._seqs.pop((tenant, seq_id), None)
        if state is not None:
            self._count[tenant] -= 1
        return state

    def _drop(self, keys: Iterable[tuple[str, str]]) -> int:
        """Drop the sequences of ``keys`` that exist and return their blocks; returns how many existed."""
        released = 0
        for tenant, seq_id in keys:
            state = self._remove(tenant, seq_id)
            if state is not None:
                self.pool.free(state.blocks())
                released += 1
        return released

    def evict_idle(self, max_idle_s: float, now: float | None = None) -> list[tuple[str, str]]:
        """Release every sequence untouched for more than ``max_idle_s`` seconds; returns their (tenant, id)."""
        now = time.monotonic() if now is None else now
        idle = [key for key, state in self._seqs.items() if now - state.last_used > max_idle_s]
        self._drop(idle)
        return idle

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def sequences_by_tenant(self) -> dict[str, int]:
        """Sequences held per tenant (tenants holding none left out)."""
        return {t: n for t, n in self._count.items() if n}

    def sequence_ids(self, *, tenant: str) -> list[str]:
        """The ids of ``tenant``'s sequences, oldest first."""
        return [seq_id for t, seq_id in self._seqs if t == tenant]

    def sequence(self, seq_id: str, *, tenant: str) -> SequenceInfo:
        """A copy of a sequence's state. Raises UnknownSequence."""
        state = self._seqs.get((tenant, seq_id))
        if state is None:
            raise UnknownSequence(f"sequence {quote(seq_id)} does not exist")
        return SequenceInfo(
            seq_id=seq_id,
            lengths=tuple(state.lengths),
            tables=tuple(dict(sorted(t.items())) for t in state.tables),
            last_used=state.last_used,
            kept_from=tuple(state.kept_from),
        )
