"""chunkattn client: the thin side of chunkattn (numpy, grpcio, protobuf; never torch or triton).

- ``ChunkAttnClient`` / ``AsyncChunkAttnClient``: the sync and asyncio gRPC clients (same methods).
- ``ChunkAttnError``: every failure, with its gRPC status code.
- ``BatchEntry``: one sequence's part of a call; ``BlockRows``: a block-addressed call's rows (the block API);
  ``BlockSpace`` and ``OpenSpace``: an opened block space, and one as ListBlockSpaces reports it; ``Grant`` and
  ``Copied``: what GrantBlocks parked and CopyBlocks copied (block handoff between spaces).
- ``reference``: the float64 numpy reference of the semantics; ``codec``: tensors <-> messages.

The names are imported on first use (PEP 562), so that ``import chunkattn_client`` and the modules the server's
core shares (``dtypes``, ``limits``, ``batch``, ``work``) load no grpc or protobuf (tests/server/test_layers.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkattn_client._types import BlockSpace, Copied, Grant, OpenSpace
    from chunkattn_client.aio import AsyncAttendStream, AsyncChunkAttnClient
    from chunkattn_client.batch import BatchEntry, BlockRows
    from chunkattn_client.client import AttendStream, ChunkAttnClient, ChunkAttnError, LayerInfo, ServerInfo
    from chunkattn_client.reference import ReferenceModel, chunked_attention, visible

__version__ = "0.1.0"

# Each public name and the module that defines it.
_WHERE = {
    "AsyncAttendStream": "aio",
    "AsyncChunkAttnClient": "aio",
    "AttendStream": "client",
    "BatchEntry": "batch",
    "BlockRows": "batch",
    "BlockSpace": "_types",
    "ChunkAttnClient": "client",
    "ChunkAttnError": "client",
    "Copied": "_types",
    "Grant": "_types",
    "LayerInfo": "client",
    "OpenSpace": "_types",
    "ReferenceModel": "reference",
    "ServerInfo": "client",
    "chunked_attention": "reference",
    "visible": "reference",
}

__all__ = [
    "AsyncAttendStream",
    "AsyncChunkAttnClient",
    "AttendStream",
    "BatchEntry",
    "BlockRows",
    "BlockSpace",
    "ChunkAttnClient",
    "ChunkAttnError",
    "Copied",
    "Grant",
    "LayerInfo",
    "OpenSpace",
    "ReferenceModel",
    "ServerInfo",
    "__version__",
    "chunked_attention",
    "visible",
]

if not TYPE_CHECKING:  # mypy sees the imports above, and no __getattr__ that would make every name Any

    def __getattr__(name: str) -> Any:
        """``name`` from its module, imported now (and kept in this module's namespace)."""
        module = _WHERE.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
