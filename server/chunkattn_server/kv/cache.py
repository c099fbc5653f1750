"""The K/V page tensors: a call's K/V stored and read back in the cache's dtype, and the byte views KV transfer
reads and writes.

Layout: one K and one V tensor per plane (a layer's storage within its KV group), each
[num_kv_heads, num_blocks, block_size, head_size]. Layer ``group.layers[r]`` of every KV group keeps its
pages in plane r, so a block id is used by exactly one group and no storage sits idle. Head-major pages
make a run of consecutive blocks one strided view [num_kv_heads, tokens, head_size] whose rows are
contiguous per head, which the CPU attention kernel reads at close to the speed of a contiguous tensor (a
token-major layout is 1.2x slower in fp32 and 2.8x in bf16 on the dev machines).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from chunkattn_server import torchtypes
from chunkattn_server.config import CacheConfig
from chunkattn_server.errors import ConfigError

# Stores k, v [n, Hkv, D] (the pages' dtype) into K and V pages at token slots [n] int64 (Backend.write).
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class KVCache:
    """K/V pages for every plane, on one device, in one dtype; ``writer`` stores a call's K/V into pages (the
    backend's kernel)."""

    def __init__(
        self,
        *,
        num_planes: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
        writer: Writer,
    ) -> None:
        self.num_blocks = num_blocks
        self.dtype = dtype
        self._writer = writer
        self.block_size = block_size
        shape = (num_kv_heads, num_blocks, block_size, head_size)
        # Zero-filled so that the pages are really allocated now, not on first touch in a request.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_planes)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_planes)]
        # KV transfer reads and writes CPU pages through numpy: torch hands each ~100 KiB strided copy to its
        # intra-op thread pool, which on a busy machine costs milliseconds per copy instead of microseconds.
        # The views are made once, not per copy.
        self._host: list[tuple[Any, Any]] | None = None  # per plane: K and V bytes [Hkv, num_blocks, bs * D * itemsize]
        self._heads: list[tuple[list[memoryview], list[memoryview]]] = []  # per plane: K and V, per head
        if device.type == "cpu":
            self._host = [(_bytes_of(k), _bytes_of(v)) for k, v in zip(self.k, self.v, strict=True)]
            self._heads = [(_rows(k), _rows(v)) for k, v in self._host]

    @staticmethod
    def bytes_per_block(*, num_planes: int, block_size: int, num_kv_heads: int, head_size: int, itemsize: int) -> int:
        """Bytes of K and V pages one block id costs across all planes."""
        return 2 * num_planes * block_size * num_kv_heads * head_size * itemsize

    @staticmethod
    def blocks_for(cache: CacheConfig, bytes_per_block: int) -> int:
        """The pool's block count: the one given, or as many blocks as the memory budget holds (ConfigError
        when it holds none)."""
        if cache.num_blocks is not None:
            return cache.num_blocks
        assert cache.memory_bytes is not None  # CacheConfig guarantees one of the two
        if cache.memory_bytes < bytes_per_block:
            raise ConfigError(
                f"a KV memory budget of {cache.memory_bytes} bytes holds no block of {bytes_per_block} bytes;"
                " raise the budget or lower block_size"
            )
        return cache.memory_bytes // bytes_per_block

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every plane (a copy-on-write of a shared block)."""
        self.copy_blocks([src], [dst])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` into ``dst[i]`` in every plane, as if all at once (a block both read and
        written reads its old bytes); ``dst`` holds each block once."""
        if not src:
            return
        device = self.k[0].device
        s = torch.tensor(src, dtype=torch.int64, device=device)
        d = torch.tensor(dst, dtype=torch.int64, device=device)
        for pages in (*self.k, *self.v):
            raw = pages.view(torch.uint8)  # as bytes: index_copy_ has no float8 kernel
            raw.index_copy_(1, d, raw.index_select(1, s))

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero ``blocks`` in every plane (blocks granted to a block space: no previous owner's K/V shows)."""
        if not blocks:
            return
        index = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)
        for pages in (*self.k, *self.v):
            pages.view(torch.uint8).index_fill_(1, index, 0)  # as bytes: index_fill_ has no float8 kernel

    def block_views(self, plane: int, blocks: list[int]) -> list[tuple[list[memoryview], list[memoryview]]]:
        """K and V of each of ``blocks`` in ``plane``, each as pieces whose concatenation is its bytes
        [Hkv, bs, D]. On the CPU: one piece per head, views of the pages (they show later writes); on a
        device: one piece, a view of a host copy of the blocks."""
        if not blocks:
            return []
        if self._host is not None:
            k_heads, v_heads = self._heads[plane]
            n = self._host[plane][0].shape[2]  # bytes of one head's rows of one block
            return [
                ([h[b * n : (b + 1) * n] for h in k_heads], [h[b * n : (b + 1) * n] for h in v_heads]) for b in blocks
            ]
        k, v = _gather_device(self.k[plane], blocks), _gather_device(self.v[plane], blocks)
        size = len(k) // len(blocks)
        return [([k[i * size : (i + 1) * size]], [v[i * size : (i + 1) * size]]) for i in range(len(blocks))]

    def write_block(self, plane: int, block: int, k: bytes | memoryview, v: bytes | memoryview) -> None:
        """Write one block's K and V, bytes laid out [Hkv, bs, D] each, into ``plane``."""
        if self._host is not None:
            for pages, data in zip(self._host[plane], (k, v), strict=True):
                dst = pages[:, block]
                np.copyto(dst, np.frombuffer(data, dtype=np.uint8).reshape(dst.shape))
            return
        for pages, data in ((self.k[plane], k), (self.v[plane], v)):
            src = torch.frombuffer(data, dtype=torch.uint8).view(pages.dtype).view(pages[:, block].shape)
            pages[:, block] = src.to(pages.device)

    def write(
        self,
        plane: int,
        token_slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scales: tuple[float, float],
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, num_kv_heads, head_size] (the compute dtype) in the cache's dtype (a float8 cache:
        over ``scales`` (k, v)): their ``rows`` [n] int64 (every row when None) at ``token_slots`` [n] int64.
        Returns all T rows as the cache holds them, in the compute dtype: what the call attends over, as later
        calls will."""
        compute = k.dtype
        if self.dtype != compute:
            k, v = torchtypes.store(k, scales[0], self.dtype), torchtypes.store(v, scales[1], self.dtype)
        if token_slots.numel():
            k_rows, v_rows = (k, v) if rows is None else (k.index_select(0, rows), v.index_select(0, rows))
            self._writer(self.k[plane], self.v[plane], token_slots, k_rows, v_rows)
        if self.dtype != compute:
            k, v = torchtypes.load(k, scales[0], compute), torchtypes.load(v, scales[1], compute)
        return k, v

    def read(
        self, plane: int, token_slots: torch.Tensor, scales: tuple[float, float], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies k, v [n, num_kv_heads, head_size] in ``dtype`` of the tokens at cache slots ``token_slots``
        [n] int64 (a float8 cache's values times ``scales`` (k, v))."""
        heads, blocks, bs, dim = self.k[plane].shape
        k = self.k[plane].view(heads, blocks * bs, dim).index_select(1, token_slots).transpose(0, 1)
        v = self.v[plane].view(heads, blocks * bs, dim).index_select(1, token_slots).transpose(0, 1)
        return torchtypes.load(k, scales[0], dtype), torchtypes.load(v, scales[1], dtype)


def token_slots(table: dict[int, int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots (physical block * block_size + offset) [end - start] int64 of positions start..end-1 of a
    sequence whose block table (logical -> physical block) is ``table``."""
    if end - start <= 2 * block_size:  # a decode or a few tokens: plain Python beats numpy's call overhead
        return np.array([table[p // block_size] * block_size + p % block_size for p in range(start, end)], np.int64)
    first, last = start // block_size, (end - 1) // block_size
    physical = np.fromiter((table[b] for b in range(first, last + 1)), dtype=np.int64, count=last - first + 1)
    positions = np.arange(start, end, dtype=np.int64)
    return physical[positions // block_size - first] * block_size + positions % block_size


def _bytes_of(pages: torch.Tensor) -> Any:
    """A uint8 numpy view [Hkv, num_blocks, bs * D * itemsize] of CPU pages (any dtype, bfloat16 included)."""
    heads, blocks = pages.shape[:2]
    return pages.view(torch.uint8).numpy().reshape(heads, blocks, -1)


def _rows(pages: Any) -> list[memoryview]:
    """Per head, a flat byte view of a ``_bytes_of`` view's rows: block b's bytes are [b * n, (b + 1) * n)."""
    return [memoryview(head).cast("B") for head in pages]


def _gather_device(pages: torch.Tensor, blocks: list[int]) -> memoryview:
    """Bytes of device pages [Hkv, num_blocks, bs, D] at ``blocks``, copied to the host as [len(blocks), Hkv, bs, D]."""
    gathered = torch.empty((len(blocks), *pages[:, 0].shape), dtype=pages.dtype, device=pages.device)
    for i, b in enumerate(blocks):
        gathered[i].copy_(pages[:, b])
    array: Any = gathered.cpu().view(torch.uint8).numpy()
    return memoryview(array).cast("B")
