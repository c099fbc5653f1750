"""The torch backend: chunked-local attention piece by piece with scaled-dot-product attention.

Each piece (one sequence's queries inside one chunk) is split by where its keys live:
- cache keys before the piece's first query, which every query sees (no mask). They are read as strided
  views of runs of consecutive blocks, no copy; runs too short to be worth a kernel launch are gathered
  together into a reused buffer;
- the call's own new keys, causal (a square lower-triangular mask).
Each part yields (output, log-sum-exp) and the parts are merged exactly, so the work is S*C for a
sequence of length S, never S*S, and nothing is masked that did not need a mask.

On the CPU the parts run on ``aten._scaled_dot_product_flash_attention_for_cpu`` (SDPA's CPU flash
kernel, which returns the log-sum-exp). Elsewhere, and for ALiBi (whose bias would lose too much
precision in bf16), they run on a float32 reference-style path that bounds memory by query blocks.

A cache in another dtype than the compute's (float8) is read through ``torchtypes.load``: each view or
gathered run is converted (and scaled) into a new tensor of the compute dtype before its kernel, so a
float8 cache halves the memory of a bf16 one here but not the bytes attention reads (the triton kernels
read float8 directly).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

from chunkattn_server import torchtypes
from chunkattn_server.attention.backends.base import AttentionBatch, physical
from chunkattn_server.attention.plan import Piece

Part = tuple[torch.Tensor, torch.Tensor]  # (output [nq, H, D], log-sum-exp [nq, H] float32)


_MAX_KNOWN = 256  # page tensors whose views are kept (an engine has two per plane)
# The scores _math holds at once for one block of queries ([heads, queries, keys] float32): 64 MiB at most,
# so a long piece on the explicit-mask path is worked through in blocks of rows instead of all at once.
MATH_BLOCK_SCORES = 1 << 24


class _Views(NamedTuple):
    """Views of one page tensor [Hkv, num_blocks, block_size, D]: ``flat`` [Hkv, num_blocks * block_size, D]
    (a run of blocks is one slice), ``flat4`` the same with a batch dimension in front (as SDPA takes it),
    ``tokens`` [num_blocks * block_size, Hkv, D] (a cache slot per row, for writes)."""

    flat: torch.Tensor
    flat4: torch.Tensor
    tokens: torch.Tensor


_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class TorchBackend:
    """Attention with torch ops; runs wherever torch does.

    impl: "auto" uses the CPU flash kernel on the CPU and the float32 path elsewhere; "math" forces the
        float32 path (the one ALiBi and non-CPU devices take; tests pin it with this).
    min_view_tokens: cache runs shorter than this are gathered rather than read as views.
    max_views: more long runs than this and the whole context is gathered in one copy.
    """

    name = "torch"

    def __init__(
        self,
        device: torch.device,
        *,
        impl: Literal["auto", "math"] = "auto",
        min_view_tokens: int = 64,
        max_views: int = 32,
    ) -> None:
        self.device = device
        self.flash = impl == "auto" and device.type == "cpu"
        self.min_view_tokens = min_view_tokens
        self.max_views = max_views
        # Reused gather buffers (flat); a fresh allocation costs more than the copy on the CPU.
        self._buf_k = torch.empty(0, device=device)
        self._buf_v = torch.empty(0, device=device)
        self._known: dict[int, tuple[torch.Tensor, _Views]] = {}  # id(pages): (pages, their views), see _views

    def write(
        self, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if k_pages.dtype.itemsize == 1:  # float8: torch has no index_copy_ of it on the CPU; its bytes are the same
            k_pages, v_pages, k, v = (x.view(torch.uint8) for x in (k_pages, v_pages, k, v))
        self._views(k_pages).tokens.index_copy_(0, slots, k)
        self._views(v_pages).tokens.index_copy_(0, slots, v)

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        k_views, v_views = self._views(batch.k_pages), self._views(batch.v_pages)
        pages = k_views.flat, v_views.flat
        decodes = self._decodes(batch, k_views, v_views, out)
        if len(decodes) == len(batch.spans):
            return
        for piece in batch.pieces:
            if piece.entry not in decodes:
                self._attend_piece(batch, pages, piece, out)

    def _attend_piece(
        self, batch: AttentionBatch, pages: tuple[torch.Tensor, torch.Tensor], piece: Piece, out: torch.Tensor
    ) -> None:
        """One piece's rows of ``out``: its cache part and its own new keys (causal), merged."""
        parts = self._cache_parts(batch, pages, piece)
        first_new = piece.row + piece.cache_end - piece.position
        last = piece.row + piece.num_queries
        if first_new < last:
            q = batch.q[piece.row : last]
            k = batch.k[first_new:last].transpose(0, 1)
            v = batch.v[first_new:last].transpose(0, 1)
            keys = np.arange(piece.cache_end, piece.position + piece.num_queries)
            parts.append(self._part(batch, q, k, v, piece.position, keys, causal=True))
        out[piece.row : last] = _merge(parts)

    def _views(self, pages: torch.Tensor) -> _Views:
        """The views of a page tensor the hot paths use, made once per page tensor (the engine passes the same
        ones every call, and each view costs microseconds)."""
        known = self._known.get(id(pages))
        if known is not None and known[0] is pages:  # (the entry holds the tensor, so its id is not reused)
            return known[1]
        flat = pages.flatten(1, 2)
        views = _Views(flat, flat.unsqueeze(0), flat.transpose(0, 1))
        if len(self._known) >= _MAX_KNOWN:
            self._known.clear()
        self._known[id(pages)] = (pages, views)
        return views

    def _decodes(self, batch: AttentionBatch, k_views: _Views, v_views: _Views, out: torch.Tensor) -> set[int]:
        """The hot path: every decode (one query, its own key already in the cache) whose chunk lies in one run
        of consecutive blocks, one kernel each over a view of the pages and nothing else. Returns the entries
        done; the rest go piece by piece."""
        if not self.flash or batch.alibi_slopes is not None:
            return set()
        bs, c = batch.block_size, batch.chunk_size
        total, heads, dim = batch.q.shape
        kv_heads = k_views.flat.shape[0]
        # [T, Hkv, G, D]: per token, the query heads of one KV head as rows of one problem (K/V read once).
        q = batch.q.view(total, kv_heads, heads // kv_heads, dim)
        done: dict[int, tuple[int, torch.Tensor]] = {}
        for entry, (row, position, n) in enumerate(batch.spans):
            if n != 1 or entry in batch.unwritten:
                continue
            key_start = position - position % c if c else 0
            run = physical(batch.tables[entry], key_start // bs, position // bs + 1)
            first = int(run[0])
            if len(run) > 1 and (np.diff(run) != 1).any():
                continue  # scattered blocks: piece by piece
            keys = position + 1 - key_start
            k = _values(batch, k_views.flat4.narrow(2, first * bs, keys), batch.k_scale)
            v = _values(batch, v_views.flat4.narrow(2, first * bs, keys), batch.v_scale)
            done[entry] = row, _cpu_flash(q if total == 1 else q.narrow(0, row, 1), k, v, scale=batch.scale)[0]
        if total == 1 and done:
            out.view(q.shape).copy_(done[0][1])
        elif len(done) == total:  # only decodes (then rows are entries): one copy out
            torch.cat([o for _, o in done.values()], out=out.view(q.shape))
        else:
            for row, o in done.values():
                out[row] = o.reshape(heads, dim)
        return set(done)

    # -- the cache part ------------------------------------------------------------------------------

    def _cache_parts(self, batch: AttentionBatch, pages: tuple[torch.Tensor, torch.Tensor], piece: Piece) -> list[Part]:
        """Parts for keys [key_start, cache_end) read from the paged cache; all visible to every query. Runs of
        consecutive blocks long enough are read as views; the rest are gathered into one copy. numpy over the
        piece's blocks, no per-block Python: a block row may name millions of them."""
        if piece.cache_end <= piece.key_start:
            return []
        q = batch.q[piece.row : piece.row + piece.num_queries]
        bs = batch.k_pages.shape[2]
        ids = np.asarray(piece.blocks, dtype=np.int64)
        starts, counts = _runs(ids)  # each run of consecutive block ids: its first index in ids, its length
        token_end = piece.cache_end - piece.key_start
        tokens = np.minimum((starts + counts) * bs, token_end) - starts * bs  # [runs] keys each run holds
        long = np.flatnonzero(tokens >= self.min_view_tokens)
        if len(long) > self.max_views:
            long = long[:0]
        positions = not (self.flash and batch.alibi_slopes is None)  # only the float32 path needs them
        parts = []
        for r in long.tolist():
            start, n = int(starts[r]), int(tokens[r])
            first = int(ids[start]) * bs
            k = _values(batch, pages[0][:, first : first + n], batch.k_scale)
            v = _values(batch, pages[1][:, first : first + n], batch.v_scale)
            key = piece.key_start + start * bs
            parts.append(self._part(batch, q, k, v, piece.position, np.arange(key, key + n) if positions else None))
        if len(long) < len(starts):
            short = np.ones(len(starts), dtype=bool)
            short[long] = False
            index = np.flatnonzero(np.repeat(short, counts))  # the short runs' blocks, by index in the piece
            n = int(tokens[short].sum())
            k, v = self._gather(batch, ids[index])
            keys = None
            if positions:  # each gathered block's keys; the last block of the piece may be partly held
                keys = (piece.key_start + index[:, None] * bs + np.arange(bs)).reshape(-1)[:n]
            parts.append(self._part(batch, q, k[:, :n], v[:, :n], piece.position, keys))
        return parts

    def _gather(self, batch: AttentionBatch, blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the given blocks (int64), [num_kv_heads, len(blocks) * block_size, head_size], in the
        compute dtype."""
        pages_k, pages_v = batch.k_pages, batch.v_pages
        heads, _, bs, dim = pages_k.shape
        size = heads * len(blocks) * bs * dim
        if self._buf_k.numel() < size or self._buf_k.dtype != pages_k.dtype:
            self._buf_k = torch.empty(size, dtype=pages_k.dtype, device=self.device)
            self._buf_v = torch.empty(size, dtype=pages_k.dtype, device=self.device)
        shape = (heads, len(blocks), bs, dim)
        index = torch.from_numpy(blocks).to(self.device)
        k = torch.index_select(pages_k, 1, index, out=self._buf_k[:size].view(shape))
        v = torch.index_select(pages_v, 1, index, out=self._buf_v[:size].view(shape))
        return _values(batch, k.flatten(1, 2), batch.k_scale), _values(batch, v.flatten(1, 2), batch.v_scale)

    # -- one part ------------------------------------------------------------------------------------

    def _part(
        self,
        batch: AttentionBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_start: int,
        k_positions: np.ndarray | None,
        *,
        causal: bool = False,
    ) -> Part:
        """Attention of q [nq, H, D] (positions q_start...) over k, v [Hkv, S, D].

        k_positions: the keys' positions [S] int64 (the float32 path's ALiBi and masks need them; the flash
        path does not, and may be given None).

        causal=False: every query sees every key. causal=True: the keys are the queries' own tokens
        (S == nq) and query t sees keys 0..t.
        """
        if self.flash and batch.alibi_slopes is None:
            return _flash_causal(q, k, v, batch.scale) if causal else _flash_full(q, k, v, batch.scale)
        assert k_positions is not None, "the float32 path needs the keys' positions"
        q_pos = torch.arange(q_start, q_start + q.shape[0], device=self.device)
        k_pos = torch.from_numpy(k_positions).to(self.device)
        return _math(q, k, v, q_pos, k_pos, batch.scale, batch.alibi_slopes, causal)


def _values(batch: AttentionBatch, pages: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache contents (a view or a gathered copy) as values in the compute dtype: themselves when the cache
    is in it, else a converted copy (see the module docstring)."""
    return torchtypes.load(pages, scale, batch.q.dtype)


def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of consecutive block ids in ``ids`` [n] int64: each run's first index and its length."""
    if len(ids) < 2:
        return np.zeros(len(ids), np.int64), np.ones(len(ids), np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ids) != 1) + 1])
    return starts, np.diff(np.append(starts, len(ids)))


def _flash_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Part:
    """No mask: the query heads of one KV head become rows of one problem, so K/V are read once."""
    nq, heads, dim = q.shape
    kv_heads = k.shape[0]
    q_per_kv = heads // kv_heads
    if nq == 1:  # a decode: a plain view (the hot path; every op here costs ~5 us)
        o, lse = _cpu_flash(q.view(1, kv_heads, q_per_kv, dim), k.unsqueeze(0), v.unsqueeze(0), scale=scale)
        return o.reshape(1, heads, dim), lse.reshape(1, heads)
    # [nq, H, D] -> [1, Hkv, nq * q_per_kv, D]: rows (token, query head of the KV head) per KV head.
    qg = q.view(nq, kv_heads, q_per_kv, dim).transpose(0, 1).reshape(1, kv_heads, nq * q_per_kv, dim)
    o, lse = _cpu_flash(qg, k.unsqueeze(0), v.unsqueeze(0), scale=scale)
    o = o.view(kv_heads, nq, q_per_kv, dim).transpose(0, 1).reshape(nq, heads, dim)
    lse = lse.view(kv_heads, nq, q_per_kv).transpose(0, 1).reshape(nq, heads)
    return o, lse


def _flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Part:
    """Square causal; the kernel maps query head h to KV head h // G itself (native GQA)."""
    # Contiguous copies: strided q/k/v slow the CPU kernel down (2-3x in bf16), the copies are O(nq).
    qh = q.transpose(0, 1).contiguous().unsqueeze(0)  # [1, H, nq, D]
    o, lse = _cpu_flash(qh, k.contiguous().unsqueeze(0), v.contiguous().unsqueeze(0), is_causal=True, scale=scale)
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)


def _math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    slopes: torch.Tensor | None,
    causal: bool,
) -> Part:
    """Float32 attention with an explicit bias/mask, in blocks of queries so scores stay <= 64 MiB
    (MATH_BLOCK_SCORES)."""
    nq, heads, dim = q.shape
    kv_heads, s, _ = k.shape
    q_per_kv = heads // kv_heads
    k32, v32 = k.float(), v.float()
    rows = max(1, MATH_BLOCK_SCORES // max(1, heads * s))
    outs, lses = [], []
    for r0 in range(0, nq, rows):
        qb = q[r0 : r0 + rows].float().view(-1, kv_heads, q_per_kv, dim)
        qp = q_pos[r0 : r0 + rows]
        scores = torch.einsum("nhgd,hsd->hgns", qb, k32) * scale  # [Hkv, G, n, S]
        rel = (k_pos.view(1, -1) - qp.view(-1, 1)).float()  # [n, S]: j - i
        if slopes is not None:
            scores = scores + slopes.view(kv_heads, q_per_kv, 1, 1) * rel
        if causal:
            scores = scores.masked_fill(rel > 0, float("-inf"))
        # exp(s - max) / sum, as a flash kernel does: the weights sum to 1 however large the scores (with
        # exp(s - logsumexp), a large score absorbs the log of the sum and the weights add up to the key count).
        top = scores.amax(dim=-1, keepdim=True)  # [Hkv, G, n, 1]
        weights = torch.exp(scores - top)
        total = weights.sum(dim=-1, keepdim=True)
        outs.append(torch.einsum("hgns,hsd->nhgd", weights / total, v32).reshape(-1, heads, dim))
        lse = (top + torch.log(total)).squeeze(-1)  # [Hkv, G, n]
        lses.append(lse.permute(2, 0, 1).reshape(-1, heads))
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def _merge(parts: list[Part]) -> torch.Tensor:
    """Exact softmax merge of parts over disjoint key sets, weighting each by exp(lse - max lse)."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.stack([p[1] for p in parts])  # [P, nq, H]
    weights = torch.exp(lse - lse.amax(dim=0, keepdim=True))
    weights = weights / weights.sum(dim=0, keepdim=True)
    outs = torch.stack([o.float() for o, _ in parts])  # [P, nq, H, D]
    return (weights.unsqueeze(-1) * outs).sum(dim=0).to(parts[0][0].dtype)
