"""Per-sequence KV state and the retention rule: which positions each layer must keep, which blocks to free.

A sequence has a length per layer (tokens it holds in that layer), per writing layer the first position
its cache still holds (``kept_from``), and, per KV group, a block table mapping logical block index
(position // block_size) to a physical block id. A layer needs the keys of its current chunk again,
nothing older; with a spec window of K tokens (``--spec-window``) it keeps the chunk K tokens back too,
so that a truncation (speculative decoding's rejected drafts) can go back K tokens across a chunk
boundary:

- a writing layer l keeps positions [chunk_start(max(0, len_l - K)), len_l);
- a KV-sharing layer s reading layer r keeps [chunk_start(max(0, len_s - K)), len_r) of r's cache, so a
  sharer that lags behind its source still finds its chunk;
- a global group (C = 0) keeps everything.

``kept_from[l]`` is the start of the union of those ranges, or later: data once dropped does not come
back, so after a truncation a layer may hold less than the rule would keep (a long prefill that skipped
whole chunks, likewise). Positions [kept_from[l], len_l) are exactly the ones layer l wrote and holds.
A group's table holds exactly the blocks that cover its writing layers' [kept_from, len) ranges; every
other block goes back to the pool after the call.

Worked example, C = 8, block_size 4, K = 3, one chunked layer:

```text
positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 17 18
a verify call of 4 tokens at 14 (len 18): kept from chunk_start(18 - 3) = 8, blocks 2, 3, 4
    (K = 0 would keep from chunk_start(18) = 16: block 4 only)
truncate to 15 (one draft accepted): 15 reads 8..14, held: allowed; kept_from stays 8
truncate to 7 instead: 7 reads 0..6, gone: refused (min_length 8; 0 reads nothing, allowed)
then decodes to len 19: kept from chunk_start(16) = 16, blocks 2 and 3 freed
```

Between calls, a chunked group whose layers are in step holds at most ceil((C + K) / block_size) blocks
per sequence (C / block_size when K = 0): its range starts at a multiple of C and spans at most C - 1 + K
positions. Plain Python, no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from chunkattn_server.config import EngineConfig, KVGroup


def chunk_start(position: int, chunk_size: int) -> int:
    """First position of the chunk that holds ``position`` (0 for a global layer)."""
    return position - position % chunk_size if chunk_size else 0


@dataclass
class SequenceState:
    """One sequence: tokens per layer, per writing layer the first position its cache holds (``kept_from``:
    0 for a new sequence, and always 0 for a KV-sharing layer, which holds none), one block table per KV
    group, last use (monotonic seconds), and how many times it was truncated (with the lengths, this names
    the state: lengths alone come back after a truncation and new calls)."""

    seq_id: str
    lengths: list[int]
    tables: list[dict[int, int]]
    tenant: str  # who it belongs to (see kv/manager.py)
    last_used: float = field(default_factory=time.monotonic)
    kept_from: list[int] = field(default_factory=list)  # empty: a new sequence's, all 0
    truncations: int = 0

    def __post_init__(self) -> None:
        if not self.kept_from:
            self.kept_from = [0] * len(self.lengths)

    def blocks(self) -> list[int]:
        """Every physical block the sequence holds."""
        return [b for table in self.tables for b in table.values()]


@dataclass(frozen=True)
class Refusal:
    """Why a truncation cannot be done: ``reader`` would read positions [reads_from, ...) of ``layer``'s
    cache (chunk size ``chunk_size``) again, which holds them from ``kept_from`` on only."""

    reader: int
    layer: int
    chunk_size: int
    reads_from: int
    kept_from: int


class Retention:
    """The retention rule for one engine config (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.cache.block_size
        self.window = config.cache.spec_window
        self._layers = config.model.layers
        self._sharers_of = [
            [s for s, spec in enumerate(self._layers) if spec.kv_source == layer] for layer in range(len(self._layers))
        ]
        # Per writing layer: the layers that read its cache (itself and its sharers), with its chunk size.
        self._readers = [
            (layer, (layer, *self._sharers_of[layer]), spec.chunk_size)
            for layer, spec in enumerate(self._layers)
            if spec.kv_source is None
        ]

    def _wanted_from(self, length: int, chunk_size: int) -> int:
        """First position a reader of ``length`` tokens wants kept: its chunk's start, ``window`` tokens back."""
        return chunk_start(max(0, length - self.window), chunk_size)

    def keep_from(self, lengths: Sequence[int], layer: int, new_length: int) -> int:
        """First position a writing layer must store when it grows to ``new_length``: its own chunk's
        start (``window`` tokens back), or earlier where one of its sharers still needs older keys."""
        c = self._layers[layer].chunk_size
        start = self._wanted_from(new_length, c)
        for s in self._sharers_of[layer]:
            start = min(start, self._wanted_from(lengths[s], c))
        return start

    def settle(self, state: SequenceState, layer: int) -> bool:
        """After a call: raise writing ``layer``'s kept_from to what the rule keeps (never lower it: dropped
        keys do not come back). Returns whether it moved (then blocks may be unneeded)."""
        kept = max(state.kept_from[layer], self.keep_from(state.lengths, layer, state.lengths[layer]))
        moved = kept != state.kept_from[layer]
        state.kept_from[layer] = kept
        return moved

    def current_chunks(self, lengths: Sequence[int]) -> list[int]:
        """kept_from of a sequence whose layers hold their current chunks only (no spec window, or an
        exporter that does not send kept_from): the start of the chunk each reader is in; 0 for sharers."""
        kept = [0] * len(lengths)
        for layer, readers, c in self._readers:
            kept[layer] = min(chunk_start(lengths[x], c) for x in readers)
        return kept

    def needed_blocks(self, lengths: Sequence[int], kept_from: Sequence[int], group: KVGroup) -> list[tuple[int, int]]:
        """Logical block ranges [lo, hi) the group must hold for a sequence of these lengths whose writing
        layers hold positions [kept_from, length)."""
        bs = self.block_size
        return [(kept_from[i] // bs, -(-lengths[i] // bs)) for i in group.layers if lengths[i] > kept_from[i]]

    def sharers_of(self, layer: int) -> list[int]:
        """The layers that read ``layer``'s cache (KV sharing)."""
        return self._sharers_of[layer]

    def unneeded(self, state: SequenceState, group: KVGroup) -> list[int]:
        """Logical blocks the group holds for this sequence that no layer needs any more.

        Only a layer whose kept_from moved, or a truncation, can make blocks unneeded, so callers ask after
        one of those.
        """
        needed = {b for lo, hi in self.needed_blocks(state.lengths, state.kept_from, group) for b in range(lo, hi)}
        return [b for b in state.tables[group.index] if b not in needed]

    # -- truncation ----------------------------------------------------------------------------------

    def kept_from_problem(self, lengths: Sequence[int], kept_from: Sequence[int]) -> str | None:
        """Why ``kept_from`` cannot describe a sequence of these lengths (an import's), or None: a writing
        layer's must lie in [0, its length] and at or before what each of its readers reads again; a
        KV-sharing layer's must be 0."""
        if len(kept_from) != len(lengths):
            return f"kept_from has {len(kept_from)} values for {len(lengths)} layers"
        for x, spec in enumerate(self._layers):
            if spec.kv_source is not None and kept_from[x]:
                return f"layer {x} has no cache of its own, so its kept_from must be 0, got {kept_from[x]}"
        for layer, readers, c in self._readers:
            kept, end = kept_from[layer], lengths[layer]
            if not 0 <= kept <= end:
                return f"layer {layer}'s kept_from {kept} is outside 0..{end} (its length)"
            for x in readers:
                lo = chunk_start(lengths[x], c)
                if end > lo and kept > lo:
                    return f"layer {x} reads layer {layer}'s positions from {lo} on again, but kept_from says {kept}"
        return None

    def refusal(self, lengths: Sequence[int], kept_from: Sequence[int], length: int) -> Refusal | None:
        """Why truncating a sequence to ``length`` tokens would leave a layer without keys it reads again,
        or None when it may be truncated there. After the truncation reader x holds n_x = min(len_x, length)
        tokens and reads positions [chunk_start(n_x), n_l) of its writing layer l again: those must be held
        (at or after kept_from[l]), unless there are none (n_l at a chunk boundary that x has reached)."""
        for layer, readers, c in self._readers:
            end = min(lengths[layer], length)
            for x in readers:
                lo = chunk_start(min(lengths[x], length), c)
                if end > lo and lo < kept_from[layer]:
                    return Refusal(x, layer, c, lo, kept_from[layer])
        return None

    def min_length(self, lengths: Sequence[int], kept_from: Sequence[int]) -> int:
        """The shortest length from which on every truncation is allowed (``refusal`` is None for every
        length in [min_length, max(lengths)]). Shorter ones may be allowed too: at a chunk boundary of
        every chunked layer, and 0.

        Per (writing layer l, reader x): a length L < len_x is refused iff chunk_start(L) < kept_from[l]
        and L is not a multiple of C, so every L from min(len_x, kept_from[l] rounded up to C) on is fine.
        """
        m = 0
        for layer, readers, c in self._readers:
            if c > 1:  # a global layer keeps every position; with C = 1 every length is a chunk boundary
                rounded = -(-kept_from[layer] // c) * c
                m = max(m, *(min(lengths[x], rounded) for x in readers))
        return m

    def boundary(self, length: int) -> int:
        """The longest length up to ``length`` at a chunk boundary of every chunked layer: always allowed
        (each reader there either reads no older keys or is not truncated)."""
        step = math.lcm(*(c for _, _, c in self._readers if c)) if any(c for _, _, c in self._readers) else 1
        return length - length % step

    def truncate(self, state: SequenceState, length: int) -> None:
        """Take the state back to ``length`` tokens in every layer (``refusal`` must be None): lengths
        become min(len, length), and each writing layer holds [min(kept_from, its new length), its new
        length). Blocks are the caller's to free (``unneeded``)."""
        state.lengths[:] = [min(n, length) for n in state.lengths]
        for layer, _, _ in self._readers:
            state.kept_from[layer] = min(state.kept_from[layer], state.lengths[layer])
            self.settle(state, layer)  # moves only a kept_from below the rule's (an import from a larger window)
        state.truncations += 1
