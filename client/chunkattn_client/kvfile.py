"""KV export files: the KVChunk messages of an ExportKV stream, each after its length (4 bytes, little-endian).

    with ChunkAttnClient(a) as c: kvfile.write("s.kv", c.export_kv("s"))
    with ChunkAttnClient(b) as c: c.import_kv(kvfile.read("s.kv"))

A file cut short reads as a stream cut short: the import fails with DATA_LOSS and leaves nothing behind.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb

_LENGTH = struct.Struct("<I")


def write(path: str | Path, messages: Iterable[pb.KVChunk]) -> tuple[int, int]:
    """Write the messages; returns (messages, bytes written)."""
    count = size = 0
    with open(path, "wb") as f:
        for message in messages:
            data = message.SerializeToString()
            f.write(_LENGTH.pack(len(data)))
            f.write(data)
            count += 1
            size += _LENGTH.size + len(data)
    return count, size


def read(path: str | Path) -> Iterator[pb.KVChunk]:
    """The messages of a file, in order; stops at a message the file does not hold whole."""
    with open(path, "rb") as f:
        while len(head := f.read(_LENGTH.size)) == _LENGTH.size:
            (n,) = _LENGTH.unpack(head)
            data = f.read(n)
            if len(data) < n:
                return
            yield pb.KVChunk.FromString(data)
