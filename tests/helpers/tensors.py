"""Random attention inputs, written once for every test that sends some: numpy for a client, torch for an
engine."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

F32 = npt.NDArray[np.float32]

# SMALL's shape (tests/helpers/server_process.py): 4 query heads, 2 KV heads of 16.
SMALL_HEADS, SMALL_KV_HEADS, SMALL_HEAD_SIZE = 4, 2, 16


def qkv(
    rng: np.random.Generator,
    n: int,
    *,
    heads: int = SMALL_HEADS,
    kv_heads: int = SMALL_KV_HEADS,
    head_size: int = SMALL_HEAD_SIZE,
    scale: float = 1.0,
) -> tuple[F32, F32, F32]:
    """Standard normal q [n, heads, head_size] and k, v [n, kv_heads, head_size], float32, times ``scale``;
    drawn from ``rng`` in that order (a test that seeds it gets the same tensors every run)."""
    q, k, v = (rng.standard_normal((n, h, head_size), np.float32) for h in (heads, kv_heads, kv_heads))
    if scale != 1.0:
        q, k, v = (x * np.float32(scale) for x in (q, k, v))
    return q, k, v


def torch_qkv(rng: np.random.Generator, n: int, **shape: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv``'s tensors (``shape``: its keyword arguments) as torch float32 tensors sharing their memory, for an
    engine's ``attend``."""
    q, k, v = qkv(rng, n, **shape)
    return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)
