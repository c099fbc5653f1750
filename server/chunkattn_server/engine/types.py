"""What the engine takes and gives besides tensors: a call of a step (sequence- or block-addressed), the one
form both are planned into (``Planned``), the Retry signal, and the pool's stats."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from chunkattn_client.batch import BatchEntry
from chunkattn_server.attention.backends.base import Table

if TYPE_CHECKING:
    from chunkattn_server.kv.grant_transfer import GrantManifest
    from chunkattn_server.kv.grants import GrantState


@dataclass(frozen=True)
class EngineStats:
    """The pool and the sequences at a glance (what the info RPC and metrics report)."""

    num_blocks: int
    free_blocks: int
    used_blocks: int
    block_size: int
    bytes_per_block: int
    num_sequences: int
    sequences_by_tenant: Mapping[str, int] = field(default_factory=dict)  # tenants holding none left out
    blocks_by_tenant: Mapping[str, int] = field(default_factory=dict)
    spaces_by_tenant: Mapping[str, int] = field(default_factory=dict)  # open block spaces
    grants: int = 0  # open grants (GrantBlocks), and the pool blocks they hold
    parked_blocks: int = 0


@dataclass(frozen=True)
class GrantAsk:
    """A GrantBlocks request as the engine takes it: the space and its blocks (in order), the grant's name, the
    tokens the blocks hold, its ttl (0: the default), the tenant that may take it besides the grantor's, and its
    tag."""

    space_id: str
    block_ids: Sequence[int]
    grant_id: str
    num_tokens: int
    ttl_s: float
    to_tenant: str
    tag: str = ""


class Handoff(NamedTuple):
    """What GrantBlocks parked or CopyBlocks copied: space blocks, the pool blocks behind them, their K/V
    bytes, and the grant's num_tokens (0 for a copy between spaces)."""

    blocks: int
    pool_blocks: int
    bytes: int
    num_tokens: int


class Leaving(NamedTuple):
    """A grant on its way to another server (Engine.grant_leaving): the grant, its stream's manifest, its
    records (plane, block) in order, and what was parked here."""

    grant: GrantState
    manifest: GrantManifest
    records: list[tuple[int, int]]
    parked: Handoff


class Swept(NamedTuple):
    """An idle sweep's work (Engine.sweep): sequences released, spaces closed, grants ended, and the next
    deadline of a space or grant (time.monotonic; None for none)."""

    evicted: int
    closed: int
    grants_ended: int
    due: float | None


@dataclass(frozen=True)
class AttendCall:
    """One Attend call of a step: its entries and tensors, as ``Engine.attend`` takes them, and its tenant."""

    entries: Sequence[BatchEntry]
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    tenant: str


@dataclass(frozen=True)
class BlockCall:
    """One block-addressed Attend call (the block API; see the proto's BlockBatch): its tenant's space, its
    tensors (q [T, num_heads, head_size]; k, v [T, num_kv_heads, head_size] or None for a KV-sharing layer)
    and its rows, int64 arrays as they came: slots [T] (negative: not written), starts [R + 1]
    (query_start_loc), seq_lens [R] and tables [R, W] (block ids). ``engine/blocks.py`` checks them against
    the space before anything is written."""

    space_id: str
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    slots: np.ndarray
    starts: np.ndarray
    seq_lens: np.ndarray
    tables: np.ndarray
    tenant: str


@dataclass(slots=True)
class Planned:
    """A checked call of either addressing, as the engine's one store and compute path takes it (core.py
    ``Engine._run``): which tokens go where in the pages, and which keys each of its rows reads.

    q: [T, num_heads, head_size]; k, v: [T, num_kv_heads, head_size] or None (a KV-sharing layer: its new
        tokens' K/V are read back at ``slots``, where its source wrote them); the call's dtype, any device.
    plane: the plane of the pages the call's K/V are in; source: the layer whose cache scales they use (its
        own, or a KV-sharing layer's source).
    slots: [T] int64, each token's slot in the pages (pool block * block_size + offset), or -1 where a token
        is not stored (a sequence's tokens before the chunk it keeps; a block row's padding).
    spans: per row (its first row of q, the position of its first new token, its new tokens); tables: per row
        its logical -> pool blocks (see attention.backends.base.Table), for the keys before its new tokens.
    chunk_size: the C the backend applies (a block call's: 0, the caller windows its rows).
    stored: every slot is >= 0 (the usual case: a decode, a short prefill), so the hot path need not look.
    """

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    plane: int
    source: int
    slots: np.ndarray
    spans: Sequence[tuple[int, int, int]]
    tables: Sequence[Table]
    chunk_size: int
    stored: bool


class Retry(Exception):
    """A call of a step found too few free blocks while earlier calls of the step held theirs: run it again
    in a step of its own, where it sees the pool as it would have alone (after their commits)."""
