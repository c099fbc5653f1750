"""The native backend: the torch backend with every decode of a step in one native call (decode.cpp).

A decode (a one-token span whose own key is in the cache) is served by the kernel: it reads the block table
directly, visits only the current chunk's blocks, reads each K/V row once for all the query heads of its KV
head, and dequantizes float8 pages in registers; the whole step's decodes are one call, their metadata built
in numpy. Prefill pieces stay on SDPA's CPU flash kernel through the torch backend's path (a tiled native
prefill is not built yet).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from chunkattn_server.attention.backends.base import AttentionBatch
from chunkattn_server.attention.backends.native import build
from chunkattn_server.attention.backends.sdpa import TorchBackend, _Views


class NativeBackend(TorchBackend):
    """The torch backend, its decodes in the native kernel. Raises build.NativeUnavailable when the kernel
    cannot be built or loaded here."""

    name = "native"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise build.NativeUnavailable(f"the native kernels run on the CPU, not {device}")
        super().__init__(device)
        self._kernel: ModuleType = build.load()

    def _decodes(self, batch: AttentionBatch, k_views: _Views, v_views: _Views, out: torch.Tensor) -> set[int]:
        if not batch.decodes_cached:
            return super()._decodes(batch, k_views, v_views, out)
        entries = [i for i, (_, _, n) in enumerate(batch.spans) if n == 1]
        if not entries:
            return set()
        bs, c = batch.block_size, batch.chunk_size
        rows = np.empty(len(entries), np.int64)
        starts = np.empty(len(entries), np.int64)
        ends = np.empty(len(entries), np.int64)
        blocks: list[list[int]] = []
        for i, e in enumerate(entries):
            row, position, _ = batch.spans[e]
            start = position - position % c if c else 0
            table = batch.tables[e]
            blocks.append([table[b] for b in range(start // bs, position // bs + 1)])
            rows[i], starts[i], ends[i] = row, start, position + 1
        width = max(len(b) for b in blocks)
        tables = np.zeros((len(entries), width), np.int32)
        for i, b in enumerate(blocks):
            tables[i, : len(b)] = b
        everything = len(entries) == batch.q.shape[0]
        q = batch.q if everything else batch.q.index_select(0, torch.from_numpy(rows))
        q = q.float().contiguous()
        answer = out if everything and out.is_contiguous() else torch.empty(q.shape, dtype=out.dtype)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        self._kernel.decode(
            q,
            batch.k_pages,
            batch.v_pages,
            torch.from_numpy(tables),
            torch.from_numpy(starts),
            torch.from_numpy(ends),
            answer,
            lse,
            batch.scale,
            batch.k_scale,
            batch.v_scale,
            batch.alibi_slopes,
            self._kernel.split_for(len(entries), batch.k_pages.shape[0], int((ends - starts).max())),
        )
        if answer is not out:
            out.index_copy_(0, torch.from_numpy(rows), answer)
        return set(entries)
