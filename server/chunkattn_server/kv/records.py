"""The KV manager's records: what it reports of a sequence, a tenant's quota, what a truncation did, and a
call's write plan and reservation (kv/manager.py makes and consumes them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chunkattn_client.batch import BatchEntry
from chunkattn_server.kv.sequences import SequenceState


@dataclass(frozen=True)
class SequenceInfo:
    """A copy of one sequence's state: tokens per layer, per KV group {logical block: physical block}, and per
    layer the first position its cache holds (0 for a KV-sharing layer)."""

    seq_id: str
    lengths: tuple[int, ...]
    tables: tuple[dict[int, int], ...]
    last_used: float
    kept_from: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.tables)


@dataclass(frozen=True)
class Quota:
    """What one tenant may hold at once; None: no limit of that kind."""

    max_blocks: int | None = None
    max_sequences: int | None = None


@dataclass(frozen=True)
class Truncation:
    """What a truncation did: blocks the sequence no longer holds (a block still shared with a fork stays
    with it), tokens it dropped (of its longest layer), and how far back it may be truncated now
    (``Retention.min_length``)."""

    released_blocks: int
    dropped_tokens: int
    min_length: int


@dataclass(frozen=True)
class Write:
    """One entry's write plan: store positions [start, end) (start == end: nothing), allocating the
    logical blocks ``missing`` of its KV group's table."""

    start: int
    end: int
    missing: list[int]


@dataclass
class Reservation:
    """What one call took before its compute: undone by ``rollback``, made final by ``commit``."""

    layer: int
    entries: Sequence[BatchEntry]
    writes: list[Write]
    tenant: str
    states: list[SequenceState] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    taken: list[tuple[dict[int, int], int]] = field(default_factory=list)
    copied: list[tuple[dict[int, int], int, int]] = field(default_factory=list)  # (table, logical, old block)
