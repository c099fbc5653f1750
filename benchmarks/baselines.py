"""Baselines the benchmarks share: FlexAttention with the chunked-local mask, and the copy bandwidth."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def flex_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, *, compiled: bool = True
) -> Callable[[], object]:
    """FlexAttention over [1, heads, n, D] tensors with the chunked-local block mask, run once now (so a
    compile is not timed). ``compiled=False`` runs it eager (unfused: only for dry runs)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def chunked(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (q_idx // chunk == kv_idx // chunk)

    n = q.shape[2]
    mask = create_block_mask(chunked, None, None, n, n, device=q.device.type)
    if not compiled:  # eager FlexAttention warns that it is unfused, which is the point there
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    fn(q, k, v, block_mask=mask, enable_gqa=True)
    return lambda: fn(q, k, v, block_mask=mask, enable_gqa=True)


def copy_bandwidth(
    nbytes: int, device: torch.device, timed: Callable[[dict[str, Callable[[], object]]], dict[str, float]]
) -> float:
    """GB/s of copy_ between two buffers of ``nbytes`` on ``device``, counting bytes read plus written;
    ``timed`` is the benchmark's own timer ({name: fn} -> {name: seconds})."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.zeros(nbytes // 4, device=device)
    return 2 * nbytes / timed({"copy": lambda: dst.copy_(src)})["copy"] / 1e9
