"""What an export is, as data (no protobuf here): the ``KVManifest`` (the model it came from, the sequence's
length in every layer, per KV group the logical blocks it holds) and one record per (exported writing layer,
logical block): that layer's K and V pages of the block, raw bytes, with an XXH3-64 checksum over the layer,
the block index and the bytes. The exporter reads records as ``BlockView``s (views of the pages), the importer
receives them as ``BlockRecord``s (views of the received message). kv/transfer.py runs exports and imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from chunkattn_client import dtypes

Buffer = bytes | memoryview


@dataclass(frozen=True)
class ModelFingerprint:
    """What two engines must agree on for KV to move between them (a float8 cache's scales too: see
    KVManifest.scales)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    chunk_sizes: tuple[int, ...]
    kv_sources: tuple[int | None, ...]
    cache_dtype: str

    def differences(self, other: ModelFingerprint) -> list[str]:
        """Human descriptions of every field that differs ("head_size: 128 here, 64 in the stream")."""
        return [
            f"{name}: {getattr(self, name)} here, {getattr(other, name)} in the stream"
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(other, name)
        ]


@dataclass(frozen=True)
class KVManifest:
    """Everything about an export but the data.

    lengths: tokens per layer (0 for a layer that is not exported).
    layers: the exported writing layers, whose blocks follow.
    blocks: per KV group, the logical blocks the exported layers need there (sorted).
    kept_from: per layer, the first position its cache holds (0 for a layer not exported or without a
        cache of its own): its records carry positions [kept_from, length). Empty (a stream from an
        exporter that does not send it): each layer's current chunk (``Retention.current_chunks``).
    scales: per layer, the (k, v) scales its float8 cache holds K/V over (a KV-sharing layer's are its
        source's; (0, 0): none yet, a calibrating layer with no write); empty for any other cache dtype.
    """

    seq_id: str
    model: ModelFingerprint
    lengths: tuple[int, ...]
    layers: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]  # per layer: its KV group
    tenant: str  # whose sequence it is (this server's business: not on the wire)
    scales: tuple[tuple[float, float], ...] = ()
    kept_from: tuple[int, ...] = ()
    # The sequence's truncation count at export (not on the wire either): a truncation and new calls can
    # bring the lengths back to what they were, with other K/V, so the lengths alone do not say "unchanged".
    truncations: int = 0

    def num_records(self) -> int:
        """len(expected()), without listing them."""
        return sum(len(self.blocks[self.group_of[layer]]) for layer in self.layers)

    def expected(self) -> list[tuple[int, int]]:
        """(layer, logical block) of every record, in the order an export sends them."""
        return [(layer, b) for layer in self.layers for b in self.blocks[self.group_of[layer]]]


def checksum(layer: int, logical: int, pieces: Iterable[Buffer]) -> int:
    """XXH3-64 of "layer:logical:" and then the record's K and V bytes, given as ``pieces`` whose
    concatenation is K then V. ~35 GB/s on the dev machines, where zlib's CRC-32 does 2.6 GB/s, which made
    checksums a third of a transfer's time."""
    h = xxhash.xxh3_64(f"{layer}:{logical}:".encode())
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


@dataclass(frozen=True)
class BlockRecord:
    """One layer's K and V pages of one logical block: bytes of [num_kv_heads, block_size, head_size]
    (views into a bigger buffer, often: a received message)."""

    layer: int
    logical: int
    k: Buffer
    v: Buffer
    checksum: int

    def intact(self) -> bool:
        return checksum(self.layer, self.logical, (self.k, self.v)) == self.checksum


@dataclass(frozen=True, eq=False)  # views: compared and hashed by identity
class BlockView:
    """A record as an export reads it: K and V each as pieces whose concatenation is its bytes
    [num_kv_heads, block_size, head_size] (on the CPU one piece per KV head, views of the pages, so no copy
    is made before the one into the outgoing message), and the checksum of those bytes.

    Views of the pages show later writes: encode them within the engine job that read them. ``copy``
    makes a record that owns its bytes."""

    layer: int
    logical: int
    k: Sequence[Buffer]
    v: Sequence[Buffer]
    checksum: int

    @classmethod
    def of(cls, layer: int, logical: int, k: Sequence[Buffer], v: Sequence[Buffer]) -> BlockView:
        return cls(layer, logical, k, v, checksum(layer, logical, (*k, *v)))

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.k) + sum(len(p) for p in self.v)

    def copy(self) -> BlockRecord:
        return BlockRecord(self.layer, self.logical, b"".join(self.k), b"".join(self.v), self.checksum)


def masked(pieces: Sequence[Buffer], heads: int, block_size: int, first: int, end: int) -> bytes:
    """The bytes [heads, block_size, row] that ``pieces`` concatenate to, with every token row outside
    [first, end) zeroed: what a record carries of a block its layer holds only in part."""
    data = bytearray(b"".join(pieces))
    per_head = len(data) // heads
    row = per_head // block_size
    for h in range(heads):
        at = h * per_head
        data[at : at + first * row] = bytes(first * row)
        data[at + end * row : at + per_head] = bytes(per_head - end * row)
    return bytes(data)


def record_bytes(model: ModelFingerprint) -> int:
    """Bytes of K plus V in one record."""
    itemsize = dtypes.BY_NAME[model.cache_dtype].itemsize
    return 2 * model.num_kv_heads * model.block_size * model.head_size * itemsize


def batches(items: Sequence[tuple[int, int]], per_batch: int) -> list[Sequence[tuple[int, int]]]:
    """``items`` cut into runs of at most ``per_batch``."""
    return [items[i : i + per_batch] for i in range(0, len(items), per_batch)]
