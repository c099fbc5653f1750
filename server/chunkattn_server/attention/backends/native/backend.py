"""The native backend: the torch backend with every decode of a step in one native call (decode.cpp).

A decode (a one-token span) is served by the kernel: it reads the block table directly, visits only the
current chunk's blocks, reads each K/V row once for all the query heads of its KV head, and dequantizes float8
pages in registers; the whole step's decodes are one call, their metadata built in numpy. A decode whose key
was not written (the block API's padding) reads the pages before its key, and its own key is folded in after,
from its call's k and v, by log-sum-exp. Prefill pieces stay on SDPA's CPU flash kernel through the torch
backend's path (a tiled native prefill is not built yet).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from chunkattn_server.attention.backends.base import AttentionBatch, physical
from chunkattn_server.attention.backends.native import build
from chunkattn_server.attention.backends.torch_backend import TorchBackend, _Views


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
        entries = [i for i, (_, _, n) in enumerate(batch.spans) if n == 1]
        if not entries:
            return set()
        bs, c = batch.block_size, batch.chunk_size
        rows = np.empty(len(entries), np.int64)
        starts = np.empty(len(entries), np.int64)
        ends = np.empty(len(entries), np.int64)
        # A decode whose key was not written (the block API's padding) reads the pages up to its key, and its
        # key is merged in from its call's k and v below (one call for every decode of the step, padded or not).
        own = np.array([e in batch.unwritten for e in entries])
        blocks: list[np.ndarray] = []
        for i, e in enumerate(entries):
            row, position, _ = batch.spans[e]
            start = position - position % c if c else 0
            end = position if own[i] else position + 1
            blocks.append(physical(batch.tables[e], start // bs, -(-end // bs)))
            rows[i], starts[i], ends[i] = row, start, end
        read = np.flatnonzero(ends > starts)  # a padded decode at its chunk's first position reads no pages
        everything = len(entries) == batch.q.shape[0]
        q = batch.q if everything else batch.q.index_select(0, torch.from_numpy(rows))
        q = q.float().contiguous()
        direct = everything and out.is_contiguous() and not own.any()
        answer = out if direct else torch.zeros(q.shape, dtype=out.dtype)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)
        if len(read):
            width = max(len(blocks[d]) for d in read.tolist())
            tables = np.zeros((len(read), width), np.int32)
            for j, d in enumerate(read.tolist()):
                tables[j, : len(blocks[d])] = blocks[d]
            every = len(read) == len(entries)
            part, part_lse = answer, lse
            if not every:
                part = torch.empty((len(read), *q.shape[1:]), dtype=out.dtype)
                part_lse = torch.empty((len(read), q.shape[1]), dtype=torch.float32)
            self._kernel.decode(
                q if every else q[torch.from_numpy(read)].contiguous(),
                batch.k_pages,
                batch.v_pages,
                torch.from_numpy(tables),
                torch.from_numpy(starts[read]),
                torch.from_numpy(ends[read]),
                part,
                part_lse,
                batch.scale,
                batch.k_scale,
                batch.v_scale,
                batch.alibi_slopes,
                self._kernel.split_for(len(read), batch.k_pages.shape[0], int((ends - starts)[read].max())),
            )
            if not every:
                answer[torch.from_numpy(read)] = part
                lse[torch.from_numpy(read)] = part_lse
        if own.any():
            _merge_own(batch, q, answer, lse, torch.from_numpy(np.flatnonzero(own)), torch.from_numpy(rows[own]))
        if answer is not out:
            out.index_copy_(0, torch.from_numpy(rows), answer)
        return set(entries)


def _merge_own(
    batch: AttentionBatch,
    q: torch.Tensor,
    answer: torch.Tensor,
    lse: torch.Tensor,
    at: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Fold each padded decode's own key into its answer, in place: ``at`` [P] its decodes (rows of ``q`` [S, H,
    D] float32, ``answer`` [S, H, D] over the pages' keys before it, ``lse`` [S, H] their log-sum-exp, -inf where
    none), ``rows`` [P] its rows of the call's k and v. The own key's score is scale * q.k (ALiBi adds 0 at
    distance 0); both parts weigh by exp(score - max), exactly as one softmax over all the keys."""
    kv_heads = batch.k.shape[1]
    heads, dim = q.shape[1], q.shape[2]
    g = heads // kv_heads
    qs = q[at].view(len(at), kv_heads, g, dim)
    k = batch.k[rows].float().unsqueeze(2)  # [P, Hkv, 1, D]
    v = batch.v[rows].float().unsqueeze(2).expand(-1, -1, g, -1).reshape(len(at), heads, dim)
    score = (qs * k).sum(-1).reshape(len(at), heads) * batch.scale  # [P, H]
    before = lse[at]
    if batch.alibi_slopes is not None:  # the kernel took the query for its last key's (position - 1): one step
        before = before - batch.alibi_slopes  # nearer each key, a bias of one slope too much on every score
    top = torch.maximum(before, score)
    w_before, w_own = torch.exp(before - top), torch.exp(score - top)  # exp(-inf) = 0 where no key came before
    total = (w_before + w_own).unsqueeze(-1)
    merged = (w_before.unsqueeze(-1) * answer[at].float() + w_own.unsqueeze(-1) * v) / total
    answer[at] = merged.to(answer.dtype)
