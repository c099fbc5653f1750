"""chunkattn server: a paged KV cache and chunked-local attention (Llama 4's RoPE layers) on CPU or CUDA."""

from chunkattn_server.config import CacheConfig, EngineConfig, KVGroup, LayerSpec, ModelShape
from chunkattn_server.engine.core import Engine, EngineStats
from chunkattn_server.kv.manager import SequenceInfo

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
