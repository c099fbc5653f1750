from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT8_E4M3: DType
DTYPE_FLOAT8_E5M2: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SequenceEntry(_message.Message):
    __slots__ = ("seq_id", "position", "num_tokens", "end_of_sequence")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_OF_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    position: int
    num_tokens: int
    end_of_sequence: bool
    def __init__(self, seq_id: _Optional[str] = ..., position: _Optional[int] = ..., num_tokens: _Optional[int] = ..., end_of_sequence: _Optional[bool] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("layer", "entries", "q", "k", "v", "request_id", "blocks")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    entries: _containers.RepeatedCompositeFieldContainer[SequenceEntry]
    q: Tensor
    k: Tensor
    v: Tensor
    request_id: int
    blocks: BlockBatch
    def __init__(self, layer: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[SequenceEntry, _Mapping]]] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[int] = ..., blocks: _Optional[_Union[BlockBatch, _Mapping]] = ...) -> None: ...

class BlockBatch(_message.Message):
    __slots__ = ("space_id", "slot_mapping", "query_start_loc", "seq_lens", "block_table", "block_table_width")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    QUERY_START_LOC_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    slot_mapping: bytes
    query_start_loc: bytes
    seq_lens: bytes
    block_table: bytes
    block_table_width: int
    def __init__(self, space_id: _Optional[str] = ..., slot_mapping: _Optional[bytes] = ..., query_start_loc: _Optional[bytes] = ..., seq_lens: _Optional[bytes] = ..., block_table: _Optional[bytes] = ..., block_table_width: _Optional[int] = ...) -> None: ...

class OpenBlockSpaceRequest(_message.Message):
    __slots__ = ("num_blocks", "layer_planes", "lease_s")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYER_PLANES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    layer_planes: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    def __init__(self, num_blocks: _Optional[int] = ..., layer_planes: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class OpenBlockSpaceResponse(_message.Message):
    __slots__ = ("space_id", "num_blocks", "block_size", "num_planes", "pool_blocks", "lease_s")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANES_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    num_blocks: int
    block_size: int
    num_planes: int
    pool_blocks: int
    lease_s: float
    def __init__(self, space_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_planes: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class CloseBlockSpaceRequest(_message.Message):
    __slots__ = ("space_id",)
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    def __init__(self, space_id: _Optional[str] = ...) -> None: ...

class CloseBlockSpaceResponse(_message.Message):
    __slots__ = ("pool_blocks",)
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool_blocks: int
    def __init__(self, pool_blocks: _Optional[int] = ...) -> None: ...

class RenewBlockSpaceRequest(_message.Message):
    __slots__ = ("space_id",)
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    def __init__(self, space_id: _Optional[str] = ...) -> None: ...

class RenewBlockSpaceResponse(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class ListBlockSpacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockSpaceInfo(_message.Message):
    __slots__ = ("space_id", "num_blocks", "num_planes", "pool_blocks", "lease_s", "idle_s", "age_s")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANES_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    num_blocks: int
    num_planes: int
    pool_blocks: int
    lease_s: float
    idle_s: float
    age_s: float
    def __init__(self, space_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_planes: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., lease_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListBlockSpacesResponse(_message.Message):
    __slots__ = ("spaces",)
    SPACES_FIELD_NUMBER: _ClassVar[int]
    spaces: _containers.RepeatedCompositeFieldContainer[BlockSpaceInfo]
    def __init__(self, spaces: _Optional[_Iterable[_Union[BlockSpaceInfo, _Mapping]]] = ...) -> None: ...

class GrantBlocksRequest(_message.Message):
    __slots__ = ("space_id", "block_ids", "grant_id", "num_tokens", "ttl_s", "to_tenant", "target", "target_token", "whole", "tag")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    TO_TENANT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    grant_id: str
    num_tokens: int
    ttl_s: float
    to_tenant: str
    target: str
    target_token: str
    whole: bool
    tag: str
    def __init__(self, space_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., grant_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., ttl_s: _Optional[float] = ..., to_tenant: _Optional[str] = ..., target: _Optional[str] = ..., target_token: _Optional[str] = ..., whole: _Optional[bool] = ..., tag: _Optional[str] = ...) -> None: ...

class GrantBlocksResponse(_message.Message):
    __slots__ = ("blocks", "pool_blocks", "bytes", "ttl_s", "records", "network_bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    pool_blocks: int
    bytes: int
    ttl_s: float
    records: int
    network_bytes: int
    def __init__(self, blocks: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., ttl_s: _Optional[float] = ..., records: _Optional[int] = ..., network_bytes: _Optional[int] = ...) -> None: ...

class GrantHeader(_message.Message):
    __slots__ = ("grant_id", "model", "layer_planes", "num_planes", "num_blocks", "num_tokens", "ttl_s", "to_tenant", "num_records", "tag", "whole")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_PLANES_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    TO_TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    model: KVModel
    layer_planes: _containers.RepeatedScalarFieldContainer[int]
    num_planes: int
    num_blocks: int
    num_tokens: int
    ttl_s: float
    to_tenant: str
    num_records: int
    tag: str
    whole: bool
    def __init__(self, grant_id: _Optional[str] = ..., model: _Optional[_Union[KVModel, _Mapping]] = ..., layer_planes: _Optional[_Iterable[int]] = ..., num_planes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., ttl_s: _Optional[float] = ..., to_tenant: _Optional[str] = ..., num_records: _Optional[int] = ..., tag: _Optional[str] = ..., whole: _Optional[bool] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("space_id", "grant_id", "source_block_ids", "dest_space_id", "dest_block_ids", "expect_tag")
    SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEST_SPACE_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_TAG_FIELD_NUMBER: _ClassVar[int]
    space_id: str
    grant_id: str
    source_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dest_space_id: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    expect_tag: str
    def __init__(self, space_id: _Optional[str] = ..., grant_id: _Optional[str] = ..., source_block_ids: _Optional[_Iterable[int]] = ..., dest_space_id: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., expect_tag: _Optional[str] = ...) -> None: ...

class CopyBlocksResponse(_message.Message):
    __slots__ = ("blocks", "bytes", "num_tokens")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    num_tokens: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class OpenDataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneEndpoint(_message.Message):
    __slots__ = ("transport", "address")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    address: str
    def __init__(self, transport: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class OpenDataPlaneResponse(_message.Message):
    __slots__ = ("endpoints", "session_key", "expires_in_s", "host_id", "curve_server_key")
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CURVE_SERVER_KEY_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[DataPlaneEndpoint]
    session_key: bytes
    expires_in_s: float
    host_id: str
    curve_server_key: str
    def __init__(self, endpoints: _Optional[_Iterable[_Union[DataPlaneEndpoint, _Mapping]]] = ..., session_key: _Optional[bytes] = ..., expires_in_s: _Optional[float] = ..., host_id: _Optional[str] = ..., curve_server_key: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("output", "request_id", "status")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    request_id: int
    status: Status
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[int] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids", "missing_ok")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    missing_ok: bool
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("index", "chunk_size", "kv_group", "kv_source", "scale", "alibi", "alibi_slopes", "k_scale", "v_scale")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ALIBI_FIELD_NUMBER: _ClassVar[int]
    ALIBI_SLOPES_FIELD_NUMBER: _ClassVar[int]
    K_SCALE_FIELD_NUMBER: _ClassVar[int]
    V_SCALE_FIELD_NUMBER: _ClassVar[int]
    index: int
    chunk_size: int
    kv_group: int
    kv_source: int
    scale: float
    alibi: bool
    alibi_slopes: _containers.RepeatedScalarFieldContainer[float]
    k_scale: float
    v_scale: float
    def __init__(self, index: _Optional[int] = ..., chunk_size: _Optional[int] = ..., kv_group: _Optional[int] = ..., kv_source: _Optional[int] = ..., scale: _Optional[float] = ..., alibi: _Optional[bool] = ..., alibi_slopes: _Optional[_Iterable[float]] = ..., k_scale: _Optional[float] = ..., v_scale: _Optional[float] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "backend", "device", "num_heads", "num_kv_heads", "head_size", "layers", "block_size", "num_blocks", "free_blocks", "bytes_per_block", "cache_dtype", "dtypes", "active_sequences", "max_message_bytes", "compute_dtype", "spec_window", "planes_per_block", "block_spaces", "max_call_work")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPEC_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PLANES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SPACES_FIELD_NUMBER: _ClassVar[int]
    MAX_CALL_WORK_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: str
    device: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    block_size: int
    num_blocks: int
    free_blocks: int
    bytes_per_block: int
    cache_dtype: DType
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    active_sequences: int
    max_message_bytes: int
    compute_dtype: DType
    spec_window: int
    planes_per_block: int
    block_spaces: int
    max_call_work: int
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., cache_dtype: _Optional[_Union[DType, str]] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., active_sequences: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., compute_dtype: _Optional[_Union[DType, str]] = ..., spec_window: _Optional[int] = ..., planes_per_block: _Optional[int] = ..., block_spaces: _Optional[int] = ..., max_call_work: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("parent", "child")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHILD_FIELD_NUMBER: _ClassVar[int]
    parent: str
    child: str
    def __init__(self, parent: _Optional[str] = ..., child: _Optional[str] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("shared_blocks",)
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    shared_blocks: int
    def __init__(self, shared_blocks: _Optional[int] = ...) -> None: ...

class TruncateRequest(_message.Message):
    __slots__ = ("seq_id", "length")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    length: int
    def __init__(self, seq_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class TruncateResponse(_message.Message):
    __slots__ = ("released_blocks", "min_length")
    RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    released_blocks: int
    min_length: int
    def __init__(self, released_blocks: _Optional[int] = ..., min_length: _Optional[int] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("seq_id", "layers", "max_message_bytes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    max_message_bytes: int
    def __init__(self, seq_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class KVModel(_message.Message):
    __slots__ = ("num_heads", "num_kv_heads", "head_size", "block_size", "chunk_sizes", "kv_sources", "cache_dtype", "k_scales", "v_scales")
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZES_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCES_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    chunk_sizes: _containers.RepeatedScalarFieldContainer[int]
    kv_sources: _containers.RepeatedScalarFieldContainer[int]
    cache_dtype: DType
    k_scales: _containers.RepeatedScalarFieldContainer[float]
    v_scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., block_size: _Optional[int] = ..., chunk_sizes: _Optional[_Iterable[int]] = ..., kv_sources: _Optional[_Iterable[int]] = ..., cache_dtype: _Optional[_Union[DType, str]] = ..., k_scales: _Optional[_Iterable[float]] = ..., v_scales: _Optional[_Iterable[float]] = ...) -> None: ...

class KVGroupBlocks(_message.Message):
    __slots__ = ("logical",)
    LOGICAL_FIELD_NUMBER: _ClassVar[int]
    logical: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, logical: _Optional[_Iterable[int]] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("seq_id", "model", "lengths", "layers", "groups", "group_of", "num_records", "kept_from")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_OF_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FROM_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    model: KVModel
    lengths: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    groups: _containers.RepeatedCompositeFieldContainer[KVGroupBlocks]
    group_of: _containers.RepeatedScalarFieldContainer[int]
    num_records: int
    kept_from: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., model: _Optional[_Union[KVModel, _Mapping]] = ..., lengths: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[int]] = ..., groups: _Optional[_Iterable[_Union[KVGroupBlocks, _Mapping]]] = ..., group_of: _Optional[_Iterable[int]] = ..., num_records: _Optional[int] = ..., kept_from: _Optional[_Iterable[int]] = ...) -> None: ...

class KVBlock(_message.Message):
    __slots__ = ("layer", "logical", "k", "v", "checksum")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    layer: int
    logical: int
    k: bytes
    v: bytes
    checksum: int
    def __init__(self, layer: _Optional[int] = ..., logical: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KVBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[KVBlock, _Mapping]]] = ...) -> None: ...

class KVTrailer(_message.Message):
    __slots__ = ("num_records",)
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    num_records: int
    def __init__(self, num_records: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "blocks", "trailer", "grant")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    blocks: KVBlocks
    trailer: KVTrailer
    grant: GrantHeader
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., blocks: _Optional[_Union[KVBlocks, _Mapping]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ..., grant: _Optional[_Union[GrantHeader, _Mapping]] = ...) -> None: ...

class ImportKVResponse(_message.Message):
    __slots__ = ("seq_id", "blocks", "records", "bytes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    blocks: int
    records: int
    bytes: int
    def __init__(self, seq_id: _Optional[str] = ..., blocks: _Optional[int] = ..., records: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class TransferKVRequest(_message.Message):
    __slots__ = ("seq_id", "target", "new_seq_id", "release_after", "layers", "target_token")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_AFTER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    target: str
    new_seq_id: str
    release_after: bool
    layers: _containers.RepeatedScalarFieldContainer[int]
    target_token: str
    def __init__(self, seq_id: _Optional[str] = ..., target: _Optional[str] = ..., new_seq_id: _Optional[str] = ..., release_after: _Optional[bool] = ..., layers: _Optional[_Iterable[int]] = ..., target_token: _Optional[str] = ...) -> None: ...

class TransferKVResponse(_message.Message):
    __slots__ = ("blocks", "records", "bytes", "seconds", "released")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    records: int
    bytes: int
    seconds: float
    released: bool
    def __init__(self, blocks: _Optional[int] = ..., records: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., released: _Optional[bool] = ...) -> None: ...
