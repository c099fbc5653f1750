"""chunkattn server: a paged KV cache and chunked-local attention (Llama 4's RoPE layers) on CPU or CUDA.

The names below are imported on first use, so that importing one plain-Python part (``chunkattn_server.kv.
block_pool``, say) does not import torch through this package."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkattn_server.config import CacheConfig, EngineConfig, KVGroup, LayerSpec, ModelShape
    from chunkattn_server.engine.core import Engine
    from chunkattn_server.engine.types import EngineStats
    from chunkattn_server.kv.records import SequenceInfo

__all__ = [
    "CacheConfig",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "KVGroup",
    "LayerSpec",
    "ModelShape",
    "SequenceInfo",
    "__version__",
]

__version__ = "0.1.0"

_HOMES = {
    "CacheConfig": "chunkattn_server.config",
    "EngineConfig": "chunkattn_server.config",
    "KVGroup": "chunkattn_server.config",
    "LayerSpec": "chunkattn_server.config",
    "ModelShape": "chunkattn_server.config",
    "Engine": "chunkattn_server.engine.core",
    "EngineStats": "chunkattn_server.engine.types",
    "SequenceInfo": "chunkattn_server.kv.records",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'chunkattn_server' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
