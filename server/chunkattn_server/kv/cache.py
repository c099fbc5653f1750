"""The K/V page tensors (writes go through the attention backend: Backend.write).

Layout: one K and one V tensor per storage slot, each [num_kv_heads, num_blocks, block_size, head_size].
Layer ``group.layers[r]`` of every KV group keeps its pages in slot r, so a block id is used by exactly one
group and no storage sits idle. Head-major pages make a run of consecutive blocks one strided view
[num_kv_heads, tokens, head_size] whose rows are contiguous per head, which the CPU attention kernel
reads at close to the speed of a contiguous tensor (a token-major layout is 1.2x slower in fp32 and
2.8x in bf16 on the dev machines).
"""

from __future__ import annotations

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

    @staticmethod
    def bytes_per_block(*, num_slots: int, block_size: int, num_kv_heads: int, head_size: int, itemsize: int) -> int:
        """Bytes of K and V pages one block id costs across all storage slots."""
        return 2 * num_slots * block_size * num_kv_heads * head_size * itemsize

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every slot (a copy-on-write of a shared block)."""
        for pages in (*self.k, *self.v):
            pages[:, dst].copy_(pages[:, src])

    def read(self, slot: int, token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies k, v [n, num_kv_heads, head_size] of the tokens at slots [n] int64."""
        heads, blocks, bs, dim = self.k[slot].shape
        k = self.k[slot].view(heads, blocks * bs, dim).index_select(1, token_slots)
        v = self.v[slot].view(heads, blocks * bs, dim).index_select(1, token_slots)
        return k.transpose(0, 1), v.transpose(0, 1)
