"""chunkattn client: the thin side of chunkattn (numpy, grpcio, protobuf; never torch or triton).

- ``ChunkAttnClient`` / ``AsyncChunkAttnClient``: the sync and asyncio gRPC clients (same methods).
- ``ChunkAttnError``: every failure, with its gRPC status code.
- ``BatchEntry``: one sequence's part of a call; ``BlockRows``: a block-addressed call's rows (the block API);
  ``BlockSpace`` and ``OpenSpace``: an opened block space, and one as ListBlockSpaces reports it.
- ``reference``: the float64 numpy reference of the semantics; ``codec``: tensors <-> messages.
"""

from chunkattn_client._types import BlockSpace, OpenSpace
from chunkattn_client.aio import AsyncAttendStream, AsyncChunkAttnClient
from chunkattn_client.batch import BatchEntry, BlockRows
from chunkattn_client.client import AttendStream, ChunkAttnClient, ChunkAttnError, LayerInfo, ServerInfo
from chunkattn_client.reference import ReferenceModel, chunked_attention, visible

__all__ = [
    "AsyncAttendStream",
    "AsyncChunkAttnClient",
    "AttendStream",
    "BatchEntry",
    "BlockRows",
    "BlockSpace",
    "ChunkAttnClient",
    "ChunkAttnError",
    "LayerInfo",
    "OpenSpace",
    "ReferenceModel",
    "ServerInfo",
    "__version__",
    "chunked_attention",
    "visible",
]

__version__ = "0.1.0"
