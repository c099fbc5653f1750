"""The K/V page tensors, and the host block copies of KV transfer (attention writes go through Backend.write).

Layout: one K and one V tensor per storage slot, each [num_kv_heads, num_blocks, block_size, head_size].
Layer ``group.layers[r]`` of every KV group keeps its pages in slot r, so a block id is used by exactly one
group and no storage sits idle. Head-major pages make a run of consecutive blocks one strided view
[num_kv_heads, tokens, head_size] whose rows are contiguous per head, which the CPU attention kernel
reads at close to the speed of a contiguous tensor (a token-major layout is 1.2x slower in fp32 and
2.8x in bf16 on the dev machines).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class KVCache:
    """K/V pages for every storage slot, on one device, in one dtype."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_kv_heads, num_blocks, block_size, head_size)
        # Zero-filled so that the pages are really allocated now, not on first touch in a request.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        # Block copies for KV transfer go through numpy on the CPU: torch hands each ~100 KiB strided copy to
        # its intra-op thread pool, which on a busy 2-core machine costs milliseconds per copy instead of
        # microseconds (measured: 8 ms against 0.05 ms with one thread). Views made once: ~8 us each.
        self._host: list[tuple[Any, Any]] | None = None
        if device.type == "cpu":
            self._host = [(_bytes_of(k), _bytes_of(v)) for k, v in zip(self.k, self.v, strict=True)]

    @staticmethod
    def bytes_per_block(*, num_slots: int, block_size: int, num_kv_heads: int, head_size: int, itemsize: int) -> int:
        """Bytes of K and V pages one block id costs across all storage slots."""
        return 2 * num_slots * block_size * num_kv_heads * head_size * itemsize

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every slot (a copy-on-write of a shared block)."""
        for pages in (*self.k, *self.v):
            pages[:, dst].copy_(pages[:, src])

    def read_blocks(self, slot: int, blocks: list[int]) -> tuple[memoryview, memoryview]:
        """Host copies of K and V of ``blocks`` in ``slot``: bytes laid out [len(blocks), Hkv, bs, D] each."""
        if self._host is not None:
            return _gather(self._host[slot][0], blocks), _gather(self._host[slot][1], blocks)
        return _gather_device(self.k[slot], blocks), _gather_device(self.v[slot], blocks)

    def write_block(self, slot: int, block: int, k: bytes | memoryview, v: bytes | memoryview) -> None:
        """Write one block's K and V, bytes laid out [Hkv, bs, D] each, into ``slot``."""
        if self._host is not None:
            for pages, data in zip(self._host[slot], (k, v), strict=True):
                dst = pages[:, block]
                np.copyto(dst, np.frombuffer(data, dtype=np.uint8).reshape(dst.shape))
            return
        for pages, data in ((self.k[slot], k), (self.v[slot], v)):
            src = torch.frombuffer(data, dtype=torch.uint8).view(pages.dtype).view(pages[:, block].shape)
            pages[:, block] = src.to(pages.device)

    def read(self, slot: int, token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies k, v [n, num_kv_heads, head_size] of the tokens at slots [n] int64."""
        heads, blocks, bs, dim = self.k[slot].shape
        k = self.k[slot].view(heads, blocks * bs, dim).index_select(1, token_slots)
        v = self.v[slot].view(heads, blocks * bs, dim).index_select(1, token_slots)
        return k.transpose(0, 1), v.transpose(0, 1)


def _bytes_of(pages: torch.Tensor) -> Any:
    """A uint8 numpy view [Hkv, num_blocks, bs, D * itemsize] of CPU pages (any dtype, bfloat16 included)."""
    return pages.view(torch.uint8).numpy()


def _gather(pages: Any, blocks: list[int]) -> memoryview:
    """Bytes of CPU pages (a ``_bytes_of`` view) at ``blocks``, laid out [len(blocks), Hkv, bs, D]."""
    out: Any = np.empty((len(blocks), pages.shape[0], *pages.shape[2:]), dtype=np.uint8)
    for i, b in enumerate(blocks):
        np.copyto(out[i], pages[:, b])
    return memoryview(out).cast("B")


def _gather_device(pages: torch.Tensor, blocks: list[int]) -> memoryview:
    """Bytes of device pages [Hkv, num_blocks, bs, D] at ``blocks``, copied to the host as [len(blocks), Hkv, bs, D]."""
    gathered = torch.empty((len(blocks), *pages[:, 0].shape), dtype=pages.dtype, device=pages.device)
    for i, b in enumerate(blocks):
        gathered[i].copy_(pages[:, b])
    array: Any = gathered.cpu().view(torch.uint8).numpy()
    return memoryview(array).cast("B")
