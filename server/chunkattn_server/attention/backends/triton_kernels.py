"""Triton kernels of the triton backend; only ``@triton.jit`` code lives here (launch code: triton_backend.py).

Layouts (every stride is passed, so views work):
- q [T, H, D], k/v [T, Hkv, D]: the call's rows, packed in entry order.
- pages [Hkv, num_blocks, block_size, D]: one layer's paged K or V cache.
- tables [B, W] int32: sequence b's physical block of logical block ``base[b] + i`` in column i.

``chunked_paged_attention`` serves a mixed batch (prefill pieces and decodes) with no host-side chunk
split. A program owns BLOCK_M queries of one sequence and one KV head, with all Q_PER_KV query heads of that
KV head packed as rows (BLOCK_M * Q_PER_KV of ROWS, a power of two >= 16 for tl.dot), so each K/V block is
loaded once for all of its query heads. From its queries' positions it derives the chunk start (``p - p % C``;
0 when C == 0) and visits only keys in [chunk start of its first query, its last query]: keys before the
sequence's first new position from the paged cache through the block table, later ones from the call's
rows. Softmax is online, in float32 (base 2). With NUM_SPLITS > 1 (flash-decoding), the key range is
split across programs that write partial results, and ``combine_splits`` merges them exactly.

A float8 cache (KV_FP8: pages of torch.float8_e4m3fn or float8_e5m2, i.e. Triton's fp8e4nv / fp8e5
pointers; a page value means ``stored * k_scale`` or ``stored * v_scale``) is dequantized in the
paged-cache loop only: the call's own rows (k_ptr/v_ptr) come already dequantized in the compute dtype.
Each stored element is loaded as one byte and converted to float32 then to q's dtype, which is exact
(every e4m3 and e5m2 value is a float16 and a bfloat16 value), and no element is multiplied by a scale:
- K: ``q . (stored * k_scale) * scale == (q . stored) * (scale * k_scale)``, so the cache loop uses
  ``scale_log2 * k_scale`` as its score scale (one scalar multiply per program). ALiBi's bias is added
  after it, unscaled.
- V: the accumulator of the cache loop holds ``sum p * stored``; it is multiplied by ``v_scale`` once,
  before the loop over the call's own rows adds theirs (so split partials are in value units and
  ``combine_splits`` needs no scale).
This is exact up to float32 rounding of two scalar products, and closer to the real values than
dequantizing per element in a 16-bit compute dtype would be: that rounds ``stored * scale`` to 8 or 11
mantissa bits and can overflow (an e5m2 value of 57344 times a scale > 1.14 is no float16 value).
With KV_FP8 False the kernel compiles exactly as without float8 support; k_scale and v_scale are unused.

Under TRITON_INTERPRET=1 float8 pointers load as uint8 codes and ``.to(tl.float32)`` decodes them with
the interpreter's bit-level conversion: exact for every finite code (checked against torch for all 256
codes of both formats in tests/attention/test_triton_fp8.py). Only the non-finite codes differ (e4m3's NaN and
e5m2's infinities and NaNs read as large finite values), and a saturating cache write never stores them.
So the kernel has no interpreter-only path. On a GPU, Triton compiles fp8e4nv (e4m3) only for sm_89 and
later; triton_backend refuses an e4m3 cache on older GPUs, and fp8e5 (e5m2) compiles everywhere.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv(
    k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ph, stride_pb, stride_ps,
    BLOCK_SIZE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (tokens, Hkv): row t of k/v [n, Hkv, D] goes to cache slot slots[t] (block * BLOCK_SIZE + offset)
    of pages [Hkv, num_blocks, BLOCK_SIZE, D]; k/v and pages share one element type (a plain copy: a float8
    cache is written through uint8 views, see TritonBackend.write)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_D
    dst = h.to(tl.int64) * stride_ph + (slot // BLOCK_SIZE) * stride_pb + (slot % BLOCK_SIZE) * stride_ps + d
    tl.store(k_pages_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm), mask=dm)
    tl.store(v_pages_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm), mask=dm)


@triton.jit
def _update(
    acc, m_i, l_i, q, k, v, j, jm, pos_r, cs_r, slope_r, scale_log2,
    HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One block of keys j [BLOCK_N] into the running (acc [R, BLOCK_D], max m_i [R], sum l_i [R])."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    if HAS_ALIBI:
        s += slope_r[:, None] * (j[None, :] - pos_r[:, None]).to(tl.float32) * 1.4426950408889634
    visible = (j[None, :] <= pos_r[:, None]) & (j[None, :] >= cs_r[:, None]) & jm[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _tile_rows(
    tile, h, tile_seq_ptr, tile_start_ptr, seq_row_ptr, seq_len_ptr,
    Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """A tile's R rows (BLOCK_M tokens x Q_PER_KV heads, then padding up to R, a power of two): sequence, first
    query, and per row the token's index in its sequence, its row in q/out, the query head and whether the
    row is real."""
    b = tl.load(tile_seq_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    n = tl.load(seq_len_ptr + b)
    r = tl.arange(0, R)
    tok = start + r // Q_PER_KV
    g = r % Q_PER_KV
    row = (tl.load(seq_row_ptr + b) + tok).to(tl.int64)
    return b, start, n, tok, row, h * Q_PER_KV + g, (r < BLOCK_M * Q_PER_KV) & (tok < n)


@triton.jit
def _store_rows(out_ptr, o, row, head, valid, stride_ot, stride_oh, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    dst = row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + dst, o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (d < HEAD_D)[None, :])


@triton.jit(do_not_specialize=["chunk_size", "stride_tb"])  # they vary call to call: no recompiles
def chunked_paged_attention(
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, tables_ptr,
    tile_seq_ptr, tile_start_ptr, seq_row_ptr, seq_len_ptr, seq_pos_ptr, seq_base_ptr, slopes_ptr,
    chunk_size, scale_log2, k_scale, v_scale,
    stride_ot, stride_oh, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ph, stride_pb, stride_ps, stride_tb,
    Q_PER_KV: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Grid (tiles, Hkv, NUM_SPLITS). Tile i holds queries tile_start[i].. of sequence tile_seq[i].

    scale_log2: the softmax scale times log2(e). k_scale, v_scale: float8 cache scales (used only when
    KV_FP8: the pages are float8 and the call's rows, q and out are in the compute dtype).
    """
    R: tl.constexpr = ROWS
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    b, start, n, tok, row, head, valid = _tile_rows(
        tile, h, tile_seq_ptr, tile_start_ptr, seq_row_ptr, seq_len_ptr, Q_PER_KV, BLOCK_M, R
    )
    row0 = tl.load(seq_row_ptr + b)
    pos0 = tl.load(seq_pos_ptr + b)
    base = tl.load(seq_base_ptr + b)
    r = tl.arange(0, R)
    pos_r = pos0 + tok
    if chunk_size > 0:
        cs_r = pos_r - pos_r % chunk_size
    else:
        cs_r = pos_r * 0
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_D
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & dm[None, :],
        other=0.0,
    )
    if IEEE:
        q = q.to(tl.float32)
    if HAS_ALIBI:
        slope_r = tl.load(slopes_ptr + head, mask=valid, other=0.0)
    else:
        slope_r = tl.zeros([R], tl.float32)

    # The keys this tile may see: [chunk start of its first query, its last query].
    first = pos0 + start
    last = pos0 + tl.minimum(start + BLOCK_M, n) - 1
    lo = first * 0
    if chunk_size > 0:
        lo = first - first % chunk_size
    hi = last + 1
    per = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * per
    s_hi = tl.minimum(hi, s_lo + per)

    acc = tl.zeros([R, BLOCK_D], tl.float32)
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    jj = tl.arange(0, BLOCK_N)

    # Keys before the sequence's first new position: the paged cache, through the block table.
    if KV_FP8:
        cache_scale_log2 = scale_log2 * k_scale  # q . (stored * k_scale) == (q . stored) * k_scale
    else:
        cache_scale_log2 = scale_log2
    c_hi = tl.minimum(s_hi, pos0)
    for j0 in range(s_lo, c_hi, BLOCK_N):
        j = j0 + jj
        jm = j < c_hi
        block = tl.load(tables_ptr + b * stride_tb + (j // BLOCK_SIZE - base), mask=jm, other=0).to(tl.int64)
        at = h.to(tl.int64) * stride_ph + block * stride_pb + (j % BLOCK_SIZE) * stride_ps
        kv_mask = jm[:, None] & dm[None, :]
        k = tl.load(k_pages_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_pages_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # stored values, exact in q's dtype; the scales are applied outside the loop
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
        if IEEE:
            k = k.to(tl.float32)
        acc, m_i, l_i = _update(acc, m_i, l_i, q, k, v, j, jm, pos_r, cs_r, slope_r, cache_scale_log2, HAS_ALIBI, IEEE)
    if KV_FP8:
        acc = acc * v_scale  # sum p * stored -> sum p * value, before the call's own (dequantized) rows

    # The call's own keys: rows row0 + (j - pos0).
    r_lo = tl.maximum(s_lo, pos0)
    for j0 in range(r_lo, s_hi, BLOCK_N):
        j = j0 + jj
        jm = j < s_hi
        rows = (row0 + j - pos0).to(tl.int64)
        kv_mask = jm[:, None] & dm[None, :]
        k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            k = k.to(tl.float32)
        acc, m_i, l_i = _update(acc, m_i, l_i, q, k, v, j, jm, pos_r, cs_r, slope_r, scale_log2, HAS_ALIBI, IEEE)

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        _store_rows(out_ptr, o, row, head, valid, stride_ot, stride_oh, HEAD_D, BLOCK_D)
    else:
        # Partials [tiles, Hkv, NUM_SPLITS, R, BLOCK_D] and (max, sum) [tiles, Hkv, NUM_SPLITS, 2, R], float32.
        unit = (tile * tl.num_programs(1) + h) * NUM_SPLITS + split
        tl.store(part_acc_ptr + unit.to(tl.int64) * R * BLOCK_D + r[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(part_ml_ptr + unit.to(tl.int64) * 2 * R + r, m_i)
        tl.store(part_ml_ptr + unit.to(tl.int64) * 2 * R + R + r, l_i)


@triton.jit
def combine_splits(
    out_ptr, part_acc_ptr, part_ml_ptr, tile_seq_ptr, tile_start_ptr, seq_row_ptr, seq_len_ptr,
    stride_ot, stride_oh,
    Q_PER_KV: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Grid (tiles, Hkv): merge the splits' partial results by their maxima (exact, like log-sum-exp)."""
    R: tl.constexpr = ROWS
    tile = tl.program_id(0)
    h = tl.program_id(1)
    _, _, _, _, row, head, valid = _tile_rows(
        tile, h, tile_seq_ptr, tile_start_ptr, seq_row_ptr, seq_len_ptr, Q_PER_KV, BLOCK_M, R
    )
    r = tl.arange(0, R)
    d = tl.arange(0, BLOCK_D)

    first = (tile * tl.num_programs(1) + h) * NUM_SPLITS
    m = tl.full([R], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_ml_ptr + (first + s).to(tl.int64) * 2 * R + r))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    l_sum = tl.zeros([R], tl.float32)
    for s in range(NUM_SPLITS):
        unit = (first + s).to(tl.int64)
        w = tl.exp2(tl.load(part_ml_ptr + unit * 2 * R + r) - m_safe)
        l_sum += w * tl.load(part_ml_ptr + unit * 2 * R + R + r)
        acc += w[:, None] * tl.load(part_acc_ptr + unit * R * BLOCK_D + r[:, None] * BLOCK_D + d[None, :])
    o = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    _store_rows(out_ptr, o, row, head, valid, stride_ot, stride_oh, HEAD_D, BLOCK_D)


__all__ = ["chunked_paged_attention", "combine_splits", "write_kv"]
