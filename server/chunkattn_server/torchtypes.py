"""The torch side of the dtype table (chunkattn_client.dtypes): each entry's torch dtype, and the two
conversions a cache in another dtype than the compute needs, one on the way in and one on the way out.

A float8 cache holds ``x / scale`` (computed in float32, saturated to the format's largest finite value,
rounded to nearest even: what ``dtypes.fp8_round`` computes in numpy, bit for bit) and gives back
``stored * scale``. Any other cache dtype is a plain conversion (scale 1).
"""

from __future__ import annotations

import math

import torch

from chunkattn_client import dtypes
from chunkattn_client.dtypes import DType

TORCH: dict[str, torch.dtype] = {d.name: getattr(torch, d.torch) for d in dtypes.TABLE}
OF_TORCH: dict[torch.dtype, DType] = {TORCH[d.name]: d for d in dtypes.TABLE}
WIRE: dict[int, torch.dtype] = {d.wire: TORCH[d.name] for d in dtypes.WIRE}  # wire enum -> dtype of tensors sent
WIRE_TORCH = frozenset(WIRE.values())


def of(name: str) -> torch.dtype:
    """The torch dtype of a table name or alias ("fp8" -> torch.float8_e4m3fn)."""
    return TORCH[dtypes.BY_NAME[name].name]


def store(x: torch.Tensor, scale: float, cache: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of dtype ``cache`` holds it (see the module docstring): a new tensor, or ``x`` itself
    when it is in that dtype already."""
    if x.dtype == cache:
        return x
    d = OF_TORCH[cache]
    if not d.fp8:
        return x.to(cache)
    y = x.float() / scale if scale != 1.0 else x.float()
    return y.clamp_(-d.max, d.max).to(cache)  # saturate: float8 e4m3 has no infinity and e5m2's is no value


def load(x: torch.Tensor, scale: float, compute: torch.dtype) -> torch.Tensor:
    """Values of cache contents ``x`` in dtype ``compute``: ``x * scale`` in float32 for float8, else ``x``
    converted (itself when it is in ``compute`` already)."""
    if x.dtype == compute:
        return x
    if not OF_TORCH[x.dtype].fp8:
        return x.to(compute)
    y = x.float()
    if scale != 1.0:
        y.mul_(scale)
    return y if compute == torch.float32 else y.to(compute)


def storable(cache: torch.dtype, compute: torch.dtype) -> float:
    """The largest |k| and |v| a cache of ``cache`` stores and gives back finite in ``compute``: no bound for
    float8 (it saturates, over scales that read back finite); the compute dtype's largest where the cache holds
    every compute value (the compute dtype itself, float32: what it gives back is within the compute dtype only
    if what went in was, which an import does not promise); else the largest power of two both hold (a float16
    cache of float32 K/V: 2^15, since 1e5 would be stored as inf; a bfloat16 cache in float16 compute: 2^15,
    since 65504 would be stored as 65536)."""
    if cache.itemsize == 1:
        return math.inf
    c, x = torch.finfo(cache), torch.finfo(compute)
    if c.max >= x.max and c.eps <= x.eps:
        return float(x.max)
    return 2.0 ** math.floor(math.log2(min(c.max, x.max)))
