"""The native backend: the torch backend with every decode of a step in one native call (decode.cpp).

A decode (a one-token span) is served by the kernel: it reads the block table directly, visits only the
current chunk's blocks, reads each K/V row once for all the query heads of its KV head, and dequantizes float8
pages in registers. A decode whose key was not written (the block API's padding) reads the pages before its key
and its own key last, converted as the pages would hold it. Every other piece of a call (the prefill pieces) is
one native call too, ``prefill`` (prefill.cpp): a tiled flash loop per piece x KV head x query tile over the
piece's cached keys (read through its blocks, converted in the kernel) and its new ones (causal): bfloat16 on
the AMX tiles in the AMX build, everything else on BLAS's sgemm in float32. ``prefill=False`` keeps them on
SDPA's CPU flash kernel through the torch backend's path, for comparison. A piece whose keys the kernel would
pack into more than ``max_packed_bytes`` (a few queries over a long global context) takes that path too: it reads
long runs of the pages as views instead of copying them. So does a float16 compute: an offloaded float16 model
(tests/client/test_hf_offload.py) drifted 0.043 in one row's logits from transformers' own SDPA with the native
prefill (which keeps P in float32 where SDPA rounds it to float16), past that test's two float16 steps; not
understood yet, so float16 stays on the path it matched.

The fused path (the default): a step whose every span is a decode is one native call, ``store_and_decode``:
the K/V written at their slots (float8: quantized over the layer's scales, as torchtypes.store does), the
kernel's metadata built from the spans and the raw tables (each decode's chunk start, its key range, its table
row) and every decode computed, with no torch op and no numpy around it. In a mixed step the engine stores
through ``write`` and the decodes go through the same native entry without its store. ``fused=False`` keeps
the path before #37 (K/V written by torch, the kernel's metadata in numpy), for comparison
(benchmarks/step.py) and as the fused path's test oracle.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from chunkattn_server.attention.backends.base import AttentionBatch, Table, physical
from chunkattn_server.attention.backends.native import build
from chunkattn_server.attention.backends.torch_backend import TorchBackend, _Views


class NativeBackend(TorchBackend):
    """The torch backend, its decodes in the native kernel. Raises build.NativeUnavailable when the kernel
    cannot be built or loaded here."""

    name = "native"

    def __init__(
        self, device: torch.device, *, fused: bool = True, prefill: bool = True, max_packed_bytes: int = 64 << 20
    ) -> None:
        if device.type != "cpu":
            raise build.NativeUnavailable(f"the native kernels run on the CPU, not {device}")
        super().__init__(device)
        self._kernel: ModuleType = build.load()
        self.fused = fused  # the engine sends a step of decodes to store_and_decode (base.FusedDecodes)
        self.prefill = prefill  # the prefill pieces in the native kernel (else SDPA, the torch backend's path)
        # A piece whose keys the native prefill would pack into more than this goes to SDPA, which reads long runs
        # of the pages as views: a few queries over a long global context would otherwise copy it all per call
        # (and a 30,000-token global prefill of the demo model packed 245 MB).
        self.max_packed_bytes = max_packed_bytes

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        if not self.prefill or batch.q.dtype == torch.float16:
            super().attend(batch, out)
            return
        k_views, v_views = self._views(batch.k_pages), self._views(batch.v_pages)
        decodes = self._decodes(batch, k_views, v_views, out)
        if len(decodes) == len(batch.spans):
            return
        pieces = []
        hkv, _, _, dim = batch.k_pages.shape
        for p in batch.pieces:
            if p.entry in decodes:
                continue
            # the native prefill converts each of a piece's keys, K and V, into its GEMMs' layout (float32 at most)
            if (p.position + p.num_queries - p.key_start) * hkv * dim * 8 > self.max_packed_bytes:
                self._attend_piece(batch, (k_views.flat, v_views.flat), p, out)  # SDPA over views of the pages
            else:
                pieces.append(p)
        if not pieces:
            return
        meta = np.empty((len(pieces), 6), np.int64)
        first = 0
        for i, p in enumerate(pieces):
            meta[i] = p.row, p.num_queries, p.position, p.key_start, p.cache_end, first
            first += len(p.blocks)
        blocks = np.fromiter(itertools.chain.from_iterable(p.blocks for p in pieces), np.int64, count=first)
        direct = out.is_contiguous()
        answer = out if direct else torch.empty(out.shape, dtype=out.dtype)
        self._kernel.prefill(
            batch.q.contiguous(),
            batch.k.contiguous(),
            batch.v.contiguous(),
            batch.k_pages,
            batch.v_pages,
            torch.from_numpy(meta),
            torch.from_numpy(blocks),
            answer,
            batch.scale,
            batch.k_scale,
            batch.v_scale,
            batch.alibi_slopes,
        )
        if not direct:
            rows = torch.from_numpy(np.concatenate([np.arange(p.row, p.row + p.num_queries) for p in pieces]))
            out.index_copy_(0, rows, answer.index_select(0, rows))

    def store_and_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        slots: np.ndarray | None,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        spans: Sequence[tuple[int, int, int]],
        tables: Sequence[Table],
        unwritten: Sequence[int],
        chunk_size: int,
        scale: float,
        alibi_slopes: torch.Tensor | None,
        scales: tuple[float, float],
        out: torch.Tensor,
    ) -> None:
        """A step of decodes only (every span one token), in one native call: k, v [T, Hkv, D] (the compute
        dtype; None for a KV-sharing layer, which stores nothing) written at ``slots`` [T] int64 (-1: not
        written) into the pages [Hkv, num_blocks, bs, D] (a float8 cache over ``scales`` (k, v), which the
        kernel reads them back with too), then every span's attention over its chunk into ``out`` [T, H, D] (the
        compute dtype, contiguous). ``unwritten``: the spans (ascending) whose key is not in the pages, read
        from k and v. Raises RuntimeError (a slot or block outside the pages, a table lacking a block) before
        anything is written."""
        self._kernel.store_and_decode(
            q.contiguous(),
            None if k is None else k.contiguous(),
            None if v is None else v.contiguous(),
            None if slots is None else torch.from_numpy(np.ascontiguousarray(slots, np.int64)),
            k_pages,
            v_pages,
            spans,
            tables,
            None,
            unwritten,
            chunk_size,
            out,
            scale,
            scales[0],
            scales[1],
            alibi_slopes,
        )

    def _decodes(self, batch: AttentionBatch, k_views: _Views, v_views: _Views, out: torch.Tensor) -> set[int]:
        entries = [i for i, (_, _, n) in enumerate(batch.spans) if n == 1]
        if not entries:
            return set()
        if self.fused:  # the same native entry, its metadata built there; the engine stored the K/V already
            padded = sorted(batch.unwritten)
            self._kernel.store_and_decode(
                batch.q.contiguous(),
                batch.k.contiguous() if padded else None,
                batch.v.contiguous() if padded else None,
                None,
                batch.k_pages,
                batch.v_pages,
                batch.spans,
                batch.tables,
                entries,
                padded,
                batch.chunk_size,
                out,
                batch.scale,
                batch.k_scale,
                batch.v_scale,
                batch.alibi_slopes,
            )
            return set(entries)
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
