"""KV transfer messages <-> the engine's transfer types (kv/transfer.py). Protobuf stays at this edge.

Block messages carry almost all the bytes, so they are built and read by ``chunkattn_client.wire`` without
copying K/V (protobuf would copy each buffer twice per side); headers and trailers go through protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from chunkattn_client import dtypes, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_server.errors import IncompatibleKV
from chunkattn_server.kv.manifest import BlockRecord, BlockView, KVManifest, ModelFingerprint, record_bytes


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
            cache_dtype=dtypes.BY_NAME[f.cache_dtype].wire,  # type: ignore[arg-type]
            k_scales=[k for k, _ in m.scales],
            v_scales=[v for _, v in m.scales],
        ),
        lengths=m.lengths,
        layers=m.layers,
        groups=[pb.KVGroupBlocks(logical=b) for b in m.blocks],
        group_of=m.group_of,
        num_records=m.num_records(),
        kept_from=m.kept_from,
    )


def fingerprint_of_info(info: pb.InfoResponse) -> ModelFingerprint:
    """What a server's Info says of the model it serves, as a KV stream's header would (a dtype this server
    does not know keeps its number)."""
    return ModelFingerprint(
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_size=info.head_size,
        block_size=info.block_size,
        chunk_sizes=tuple(x.chunk_size for x in info.layers),
        kv_sources=tuple(x.kv_source if x.HasField("kv_source") else None for x in info.layers),
        cache_dtype=dtypes.wire_name(info.cache_dtype),
    )


def manifest_from_pb(h: pb.KVHeader, tenant: str) -> KVManifest:
    """The manifest of a header sent by ``tenant``; IncompatibleKV when it cannot be read (a dtype this server
    does not know)."""
    try:
        dtype = dtypes.of_wire(h.model.cache_dtype, dtypes.CACHE, "cache dtype").name
    except dtypes.DTypeError as e:
        raise IncompatibleKV(f"the KV stream's {e}") from None
    if len(h.model.k_scales) != len(h.model.v_scales):
        raise IncompatibleKV(
            f"the KV stream has {len(h.model.k_scales)} k scales and {len(h.model.v_scales)} v scales;"
            " expected one of each per layer"
        )
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
        tenant=tenant,
        kept_from=tuple(h.kept_from),
        scales=tuple(zip(h.model.k_scales, h.model.v_scales, strict=True)),
    )
    if any(not 0 <= g < len(manifest.blocks) for g in manifest.group_of) or any(
        not 0 <= x < len(manifest.group_of) for x in manifest.layers
    ):
        raise IncompatibleKV("the KV header's layers and groups do not fit together")
    listed = manifest.num_records()  # arithmetic: layers x blocks is what the stream claims, not its size
    if h.num_records != listed:
        raise IncompatibleKV(f"the KV header announces {h.num_records} blocks but lists {listed}")
    return manifest


def encode_header(m: KVManifest, as_id: str = "") -> bytes:
    """A serialized KVChunk holding the manifest's header (under ``as_id`` when given)."""
    header = manifest_to_pb(m)
    if as_id:
        header.seq_id = as_id
    return bytes(pb.KVChunk(header=header).SerializeToString())


def encode_trailer(num_records: int) -> bytes:
    return bytes(pb.KVChunk(trailer=pb.KVTrailer(num_records=num_records)).SerializeToString())


def encode_blocks(views: Sequence[BlockView]) -> bytes:
    """A serialized KVChunk of blocks; their K/V pieces are copied once, into the message (on the CPU,
    straight from the pages)."""
    return wire.encode_kv_blocks([(r.layer, r.logical, r.checksum, r.k, r.v) for r in views])


def decode(
    data: bytes, model: ModelFingerprint | None = None
) -> tuple[str, pb.KVHeader | list[BlockRecord] | int | None]:
    """A serialized KVChunk: ("header", its header: ``manifest_from_pb`` reads it), ("blocks", records viewing
    ``data``), ("trailer", count) or ("", None). IncompatibleKV when it does not parse, or (given the stream's
    ``model``) when a block has the wrong size: found before reading more blocks than the message's size can
    hold."""
    size = None if model is None else record_bytes(model) // 2
    try:
        part, body = wire.decode_kv_message(data, None if size is None else len(data) // (2 * size))
        if part == "blocks":
            assert isinstance(body, list)
            records = [BlockRecord(layer, logical, k, v, digest) for layer, logical, digest, k, v in body]
            for r in records:
                if size is not None and not len(r.k) == len(r.v) == size:
                    raise IncompatibleKV(f"record (layer {r.layer}, block {r.logical}) has the wrong size")
            return part, records
        assert isinstance(body, memoryview)
        if part == "header":
            return part, pb.KVHeader.FromString(bytes(body))
        if part == "trailer":
            return part, int(pb.KVTrailer.FromString(bytes(body)).num_records)
    except (wire.WireError, DecodeError) as e:
        raise IncompatibleKV(f"a KV stream message does not parse: {e}") from None
    return "", None
