"""A sequence's live KV as data that can leave one engine and enter another (no protobuf here).

An export is a ``KVManifest`` (the model it came from, the sequence's length in every layer, and per KV
group the logical blocks it holds) followed by one record per (exported writing layer, logical block):
that layer's K and V pages of the block, as raw bytes, with an XXH3-64 checksum over the layer, the block
index and the bytes. The exporter reads records as ``BlockView``s (views of the pages), the importer
receives them as ``BlockRecord``s (views of the received message). Only live blocks exist to be sent: a
chunked group holds its current chunk, a global group everything, so a 128K-token prompt with C = 8192
sends at most 8K tokens' worth for each chunked layer.

An import is a session: ``begin`` checks the manifest against this engine (model, free id, free
blocks) and reserves every block; ``add`` checks each record (expected, not seen, checksum) and writes it;
``commit`` checks that every expected record arrived and only then makes the sequence visible.
``abort`` (or any failure) returns every reserved block: a broken stream leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

Buffer = bytes | memoryview


@dataclass(frozen=True)
class ModelFingerprint:
    """What two engines must agree on for KV to move between them."""

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
    """

    seq_id: str
    model: ModelFingerprint
    lengths: tuple[int, ...]
    layers: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]  # per layer: its KV group

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


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def record_bytes(model: ModelFingerprint) -> int:
    """Bytes of K plus V in one record."""
    return 2 * model.num_kv_heads * model.block_size * model.head_size * ITEMSIZE[model.cache_dtype]


def batches(items: Sequence[tuple[int, int]], per_batch: int) -> list[Sequence[tuple[int, int]]]:
    """``items`` cut into runs of at most ``per_batch``."""
    return [items[i : i + per_batch] for i in range(0, len(items), per_batch)]
