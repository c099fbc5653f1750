"""Attention backends: the torch (SDPA) backend runs on the CPU and CUDA."""

from chunkattn_server.attention.backends.base import AttentionBatch, Backend
from chunkattn_server.attention.backends.torch_backend import TorchBackend

__all__ = ["AttentionBatch", "Backend", "TorchBackend"]
