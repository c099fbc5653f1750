"""What an attention backend receives for one call, and the interface every backend implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from chunkattn_server.attention.plan import Piece


@dataclass(frozen=True)
class AttentionBatch:
    """One call's attention work, on the engine's device, in the cache's dtype.

    q: [T, num_heads, head_size] the call's queries, packed in entry order.
    k, v: [T, num_kv_heads, head_size] the call's new keys/values (for a KV-sharing layer: read back from
        its source's cache). Pieces read rows [row + cache_end - position, row + num_queries) of them.
    k_pages, v_pages: [num_kv_heads, num_blocks, block_size, head_size] the layer's paged cache.
    pieces: the chunk split of the batch (see attention.plan).
    scale: softmax scale.
    alibi_slopes: [num_heads] float32, or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    pieces: Sequence[Piece]
    scale: float
    alibi_slopes: torch.Tensor | None


class Backend(Protocol):
    """Computes chunked-local attention for a planned batch."""

    name: str

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        """Write the output [T, num_heads, head_size] (the cache's dtype) into ``out``."""
