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
from chunkattn_server.kv.grant_transfer import GrantManifest
from chunkattn_server.kv.manifest import BlockRecord, BlockView, KVManifest, ModelFingerprint, record_bytes


def model_to_pb(f: ModelFingerprint, scales: Sequence[tuple[float, float]]) -> pb.KVModel:
    return pb.KVModel(
        num_heads=f.num_heads,
        num_kv_heads=f.num_kv_heads,
        head_size=f.head_size,
        block_size=f.block_size,
        chunk_sizes=f.chunk_sizes,
        kv_sources=[-1 if s is None else s for s in f.kv_sources],
        cache_dtype=dtypes.BY_NAME[f.cache_dtype].wire,  # type: ignore[arg-type]
        k_scales=[k for k, _ in scales],
        v_scales=[v for _, v in scales],
    )


def model_from_pb(m: pb.KVModel) -> tuple[ModelFingerprint, tuple[tuple[float, float], ...]]:
    """A stream's model and scales; IncompatibleKV when they cannot be read (a dtype this server does not
    know, scales that do not pair up)."""
    try:
        dtype = dtypes.of_wire(m.cache_dtype, dtypes.CACHE, "cache dtype").name
    except dtypes.DTypeError as e:
        raise IncompatibleKV(f"the KV stream's {e}") from None
    if len(m.k_scales) != len(m.v_scales):
        raise IncompatibleKV(
            f"the KV stream has {len(m.k_scales)} k scales and {len(m.v_scales)} v scales;"
            " expected one of each per layer"
        )
    model = ModelFingerprint(
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_size=m.head_size,
        block_size=m.block_size,
        chunk_sizes=tuple(m.chunk_sizes),
        kv_sources=tuple(None if s < 0 else s for s in m.kv_sources),
        cache_dtype=dtype,
    )
    return model, tuple(zip(m.k_scales, m.v_scales, strict=True))


def grant_to_pb(m: GrantManifest) -> bytes:
    """A serialized KVChunk holding a grant's header."""
    header = pb.GrantHeader(
        grant_id=m.grant_id,
        model=model_to_pb(m.model, m.scales),
        layer_planes=m.layer_planes,
        num_planes=m.num_planes,
        num_blocks=m.num_blocks,
        num_tokens=m.num_tokens,
        ttl_s=m.ttl_s,
        to_tenant=m.to_tenant,
        num_records=m.num_records,
        tag=m.tag,
        whole=m.whole,
    )
    return bytes(pb.KVChunk(grant=header).SerializeToString())


def grant_from_pb(h: pb.GrantHeader) -> GrantManifest:
    model, scales = model_from_pb(h.model)
    return GrantManifest(
        grant_id=h.grant_id,
        model=model,
        layer_planes=tuple(h.layer_planes),
        num_planes=h.num_planes,
        num_blocks=h.num_blocks,
        num_tokens=h.num_tokens,
        ttl_s=h.ttl_s,
        to_tenant=h.to_tenant,
        scales=scales,
        num_records=h.num_records,
        tag=h.tag,
        whole=h.whole,
    )


def manifest_to_pb(m: KVManifest) -> pb.KVHeader:
    return pb.KVHeader(
        seq_id=m.seq_id,
        model=model_to_pb(m.model, m.scales),
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
    model, scales = model_from_pb(h.model)
    manifest = KVManifest(
        seq_id=h.seq_id,
        model=model,
        lengths=tuple(h.lengths),
        layers=tuple(h.layers),
        blocks=tuple(tuple(g.logical) for g in h.groups),
        group_of=tuple(h.group_of),
        tenant=tenant,
        kept_from=tuple(h.kept_from),
        scales=scales,
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
) -> tuple[str, pb.KVHeader | pb.GrantHeader | list[BlockRecord] | int | None]:
    """A serialized KVChunk: ("header", its header: ``manifest_from_pb`` reads it), ("grant", a grant's
    header: ``grant_from_pb``), ("blocks", records viewing ``data``), ("trailer", count) or ("", None).
    IncompatibleKV when it does not parse, or (given the stream's ``model``) when a block has the wrong size:
    found before reading more blocks than the message's size can hold."""
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
        if part == "grant":
            return part, pb.GrantHeader.FromString(bytes(body))
        if part == "trailer":
            return part, int(pb.KVTrailer.FromString(bytes(body)).num_records)
    except (wire.WireError, DecodeError) as e:
        raise IncompatibleKV(f"a KV stream message does not parse: {e}") from None
    return "", None
