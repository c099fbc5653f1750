"""What the calls return: the server's Info, and the results of Truncate, ImportKV and TransferKV."""

from __future__ import annotations

from dataclasses import dataclass

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.dtypes import wire_name


@dataclass(frozen=True)
class LayerInfo:
    index: int
    chunk_size: int
    kv_group: int
    kv_source: int | None
    scale: float
    alibi: bool
    alibi_slopes: tuple[float, ...] = ()  # one per query head when alibi
    # A float8 cache holds K / k_scale and V / v_scale (1 for other cache dtypes; 0 while the server
    # calibrates them and the layer has had no write).
    k_scale: float = 1.0
    v_scale: float = 1.0

    @classmethod
    def from_pb(cls, x: pb.LayerInfo) -> LayerInfo:
        return cls(
            index=x.index,
            chunk_size=x.chunk_size,
            kv_group=x.kv_group,
            kv_source=x.kv_source if x.HasField("kv_source") else None,
            scale=x.scale,
            alibi=x.alibi,
            alibi_slopes=tuple(x.alibi_slopes),
            k_scale=x.k_scale,
            v_scale=x.v_scale,
        )


@dataclass(frozen=True)
class ServerInfo:
    """What Info returns: the model's shape and the server's state."""

    version: str
    backend: str
    device: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    layers: tuple[LayerInfo, ...]
    block_size: int
    num_blocks: int
    free_blocks: int
    bytes_per_block: int
    cache_dtype: str
    dtypes: tuple[str, ...]
    active_sequences: int
    max_message_bytes: int
    compute_dtype: str = ""  # "" from a server older than the field
    # Tokens a chunked layer keeps before its current chunk: how far Truncate may go back across a chunk
    # boundary (chunkattn-server --spec-window; 0 from a server older than the field).
    spec_window: int = 0
    # The block API: layers' K/V one pool block holds, and the caller's open block spaces (0 from an older server).
    planes_per_block: int = 0
    block_spaces: int = 0
    # The most query-key pairs one Attend call may compute (0: no bound, or a server older than the field).
    max_call_work: int = 0

    def pool_blocks_per_space_block(self, planes: int) -> int:
        """Pool blocks one block of a block space of ``planes`` planes takes: ceil(planes / planes_per_block)."""
        return max(1, -(-planes // max(1, self.planes_per_block)))

    @classmethod
    def from_pb(cls, r: pb.InfoResponse) -> ServerInfo:
        """A newer server's dtype this client does not know is reported ("unknown(N)"), not fatal."""
        return cls(
            version=r.version,
            backend=r.backend,
            device=r.device,
            num_heads=r.num_heads,
            num_kv_heads=r.num_kv_heads,
            head_size=r.head_size,
            layers=tuple(LayerInfo.from_pb(x) for x in r.layers),
            block_size=r.block_size,
            num_blocks=r.num_blocks,
            free_blocks=r.free_blocks,
            bytes_per_block=r.bytes_per_block,
            cache_dtype=wire_name(r.cache_dtype),
            dtypes=tuple(wire_name(d) for d in r.dtypes),
            active_sequences=r.active_sequences,
            max_message_bytes=r.max_message_bytes,
            compute_dtype=wire_name(r.compute_dtype) if r.compute_dtype else "",
            spec_window=r.spec_window,
            planes_per_block=r.planes_per_block,
            block_spaces=r.block_spaces,
            max_call_work=r.max_call_work,
        )


@dataclass(frozen=True)
class Truncated:
    """What Truncate did: the blocks the sequence no longer holds (a block still shared with a fork stays
    with it), and how far back it may now be truncated: any length from ``min_length`` on (and a chunk
    boundary of every chunked layer, where none reads older keys)."""

    released_blocks: int
    min_length: int

    @classmethod
    def from_pb(cls, r: pb.TruncateResponse) -> Truncated:
        return cls(int(r.released_blocks), int(r.min_length))


@dataclass(frozen=True)
class BlockSpace:
    """An open block space (OpenBlockSpace): its id, its blocks (ids 0 .. num_blocks - 1) of block_size
    tokens, its planes per block, the server's pool blocks it holds, and its lease: seconds it may go unused
    (no call, no renewal) before the server closes it (0: never)."""

    space_id: str
    num_blocks: int
    block_size: int
    num_planes: int
    pool_blocks: int
    lease_s: float = 0.0

    @classmethod
    def from_pb(cls, r: pb.OpenBlockSpaceResponse) -> BlockSpace:
        return cls(r.space_id, r.num_blocks, r.block_size, r.num_planes, r.pool_blocks, r.lease_s)


@dataclass(frozen=True)
class OpenSpace:
    """One of the caller's open block spaces, as ListBlockSpaces reports it: as BlockSpace, plus seconds since
    its last use (a call or a renewal) and since it opened."""

    space_id: str
    num_blocks: int
    num_planes: int
    pool_blocks: int
    lease_s: float
    idle_s: float
    age_s: float

    @classmethod
    def from_pb(cls, r: pb.BlockSpaceInfo) -> OpenSpace:
        return cls(r.space_id, r.num_blocks, r.num_planes, r.pool_blocks, r.lease_s, r.idle_s, r.age_s)


@dataclass(frozen=True)
class Grant:
    """What GrantBlocks parked: the blocks granted, the server's pool blocks holding them, their K/V bytes, and
    the seconds the grant waits to be taken (CopyBlocks) before it ends; sent to another server (a target):
    the records it took and their bytes on the network."""

    blocks: int
    pool_blocks: int
    bytes: int
    ttl_s: float
    records: int = 0
    network_bytes: int = 0

    @classmethod
    def from_pb(cls, r: pb.GrantBlocksResponse) -> Grant:
        return cls(r.blocks, r.pool_blocks, r.bytes, r.ttl_s, r.records, r.network_bytes)


@dataclass(frozen=True)
class Copied:
    """What CopyBlocks copied: blocks, their K/V bytes, and the grant's num_tokens (0 from a space)."""

    blocks: int
    bytes: int
    num_tokens: int

    @classmethod
    def from_pb(cls, r: pb.CopyBlocksResponse) -> Copied:
        return cls(r.blocks, r.bytes, r.num_tokens)


@dataclass(frozen=True)
class KVImport:
    """What ImportKV created: the sequence, its blocks, and the blocks (records) and bytes received."""

    seq_id: str
    blocks: int
    records: int
    bytes: int

    @classmethod
    def from_pb(cls, r: pb.ImportKVResponse) -> KVImport:
        return cls(r.seq_id, r.blocks, r.records, r.bytes)


@dataclass(frozen=True)
class KVTransfer:
    """What TransferKV moved, how long it took, and whether the source released the sequence."""

    blocks: int
    records: int
    bytes: int
    seconds: float
    released: bool

    @classmethod
    def from_pb(cls, r: pb.TransferKVResponse) -> KVTransfer:
        return cls(r.blocks, r.records, r.bytes, r.seconds, r.released)
