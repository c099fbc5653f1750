"""KV transfer messages <-> the engine's transfer types (kv/transfer.py). Protobuf stays at this edge."""

from __future__ import annotations

from collections.abc import Sequence

from chunkattn_client import codec
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_server.errors import IncompatibleKV
from chunkattn_server.kv.transfer import BlockRecord, KVManifest, ModelFingerprint


def manifest_to_pb(m: KVManifest) -> pb.KVHeader:
    f = m.model
    return pb.KVHeader(
        seq_id=m.seq_id,
        model=pb.KVModel(
            num_heads=f.num_heads,
            num_kv_heads=f.num_kv_heads,
            head_size=f.head_size,
            block_size=f.block_size,
            chunk_sizes=f.chunk_sizes,
            kv_sources=[-1 if s is None else s for s in f.kv_sources],
            cache_dtype=codec.WIRE_DTYPES[f.cache_dtype],
        ),
        lengths=m.lengths,
        layers=m.layers,
        groups=[pb.KVGroupBlocks(logical=b) for b in m.blocks],
        group_of=m.group_of,
        num_records=len(m.expected()),
    )


def manifest_from_pb(h: pb.KVHeader) -> KVManifest:
    """The manifest of a header; IncompatibleKV when it cannot be read (a dtype this server does not know)."""
    try:
        dtype = codec.dtype_name(h.model.cache_dtype)
    except codec.CodecError:
        raise IncompatibleKV(f"the KV stream's cache dtype {h.model.cache_dtype} is unknown here") from None
    model = ModelFingerprint(
        num_heads=h.model.num_heads,
        num_kv_heads=h.model.num_kv_heads,
        head_size=h.model.head_size,
        block_size=h.model.block_size,
        chunk_sizes=tuple(h.model.chunk_sizes),
        kv_sources=tuple(None if s < 0 else s for s in h.model.kv_sources),
        cache_dtype=dtype,
    )
    manifest = KVManifest(
        seq_id=h.seq_id,
        model=model,
        lengths=tuple(h.lengths),
        layers=tuple(h.layers),
        blocks=tuple(tuple(g.logical) for g in h.groups),
        group_of=tuple(h.group_of),
    )
    if any(not 0 <= g < len(manifest.blocks) for g in manifest.group_of) or any(
        not 0 <= x < len(manifest.group_of) for x in manifest.layers
    ):
        raise IncompatibleKV("the KV header's layers and groups do not fit together")
    if h.num_records != len(manifest.expected()):
        raise IncompatibleKV(f"the KV header announces {h.num_records} blocks but lists {len(manifest.expected())}")
    return manifest


def records_to_pb(records: Sequence[BlockRecord]) -> pb.KVBlocks:
    return pb.KVBlocks(
        blocks=[pb.KVBlock(layer=r.layer, logical=r.logical, crc32=r.crc32, k=r.k, v=r.v) for r in records]
    )


def records_from_pb(blocks: pb.KVBlocks) -> list[BlockRecord]:
    return [BlockRecord(b.layer, b.logical, b.k, b.v, b.crc32) for b in blocks.blocks]
