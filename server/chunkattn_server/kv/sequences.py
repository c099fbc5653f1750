"""Per-sequence KV state and the retention rule: which positions each layer must keep, which blocks to free.

A sequence has a length per layer (tokens it holds in that layer) and, per KV group, a block table
mapping logical block index (position // block_size) to a physical block id. A layer needs the keys of
its current chunk again, nothing older:

- a writing layer l keeps positions [chunk_start(len_l), len_l);
- a KV-sharing layer s reading layer r keeps [chunk_start(len_s), len_r) of r's cache, so a sharer that
  lags behind its source still finds its chunk;
- a global group (C = 0) keeps everything.

A group's table holds exactly the blocks that cover the union of its layers' ranges; every other block
goes back to the pool after the call. Plain Python, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from chunkattn_server.config import EngineConfig, KVGroup


def chunk_start(position: int, chunk_size: int) -> int:
    """First position of the chunk that holds ``position`` (0 for a global layer)."""
    return position - position % chunk_size if chunk_size else 0


@dataclass
class SequenceState:
    """One sequence: tokens per layer, one block table per KV group, last use (monotonic seconds)."""

    seq_id: str
    lengths: list[int]
    tables: list[dict[int, int]]
    last_used: float = field(default_factory=time.monotonic)
    tenant: str = ""  # who it belongs to (see kv/manager.py)

    def blocks(self) -> list[int]:
        """Every physical block the sequence holds."""
        return [b for table in self.tables for b in table.values()]


class Retention:
    """The retention rule for one engine config (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.cache.block_size
        self._layers = config.model.layers
        self._sharers_of = [
            [s for s, spec in enumerate(self._layers) if spec.kv_source == layer] for layer in range(len(self._layers))
        ]

    def keep_from(self, lengths: Sequence[int], layer: int, new_length: int) -> int:
        """First position a writing layer must store when it grows to ``new_length``: its own chunk's
        start, or earlier where one of its sharers still needs older keys."""
        c = self._layers[layer].chunk_size
        start = chunk_start(new_length, c)
        for s in self._sharers_of[layer]:
            start = min(start, chunk_start(lengths[s], c))
        return start

    def held_from(self, lengths: Sequence[int], layer: int) -> int:
        """First position a writing layer's cache holds, given every layer's length: the positions
        [held_from, lengths[layer]) are the ones it wrote and keeps (its chunk, and older keys its sharers
        still read); everything else in its blocks is not its data."""
        return self.keep_from(lengths, layer, lengths[layer])

    def needed_blocks(self, lengths: Sequence[int], group: KVGroup) -> list[tuple[int, int]]:
        """Logical block ranges [lo, hi) the group must hold for a sequence of these lengths."""
        bs = self.block_size
        c = group.chunk_size
        spans = [(chunk_start(lengths[i], c), lengths[i]) for i in group.layers]
        for s in group.sharers:
            source = self._layers[s].kv_source
            assert source is not None  # sharers always have a source (checked by the config)
            spans.append((chunk_start(lengths[s], c), lengths[source]))
        return [(lo // bs, -(-hi // bs)) for lo, hi in spans if hi > lo]

    def sharers_of(self, layer: int) -> list[int]:
        """The layers that read ``layer``'s cache (KV sharing)."""
        return self._sharers_of[layer]

    def unneeded(self, state: SequenceState, group: KVGroup) -> list[int]:
        """Logical blocks the group holds for this sequence that no layer needs any more.

        Only a layer whose chunk start moved can make blocks unneeded, so callers ask after such a call.
        """
        if group.chunk_size == 0:
            return []  # global groups keep every block until release
        needed = {b for lo, hi in self.needed_blocks(state.lengths, group) for b in range(lo, hi)}
        return [b for b in state.tables[group.index] if b not in needed]
