"""Float64 numpy reference for chunked-local attention, written straight from the predicate.

It is deliberately naive (a dense [queries, keys] mask, no paging, no chunk split) so that it can be
trusted by reading it, and a client can use it to verify what a server returns.

The predicate, for a layer of chunk size C: the query at absolute position i sees the key at absolute
position j iff ``j <= i and (C == 0 or j // C == i // C)``. C == 0 is a global (plain causal) layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from chunkattn_client import dtypes
from chunkattn_client.batch import BatchEntry, BlockRows
from chunkattn_client.client import ServerInfo

__all__ = ["BlockReference", "ReferenceModel", "as_cached", "chunked_attention", "visible", "within_tolerance"]

FloatArray = npt.NDArray[np.float64]


def visible(q_pos: npt.ArrayLike, k_pos: npt.ArrayLike, chunk_size: int) -> npt.NDArray[np.bool_]:
    """The mask [len(q_pos), len(k_pos)]: True where the query may attend to the key."""
    i = np.asarray(q_pos, dtype=np.int64)[:, None]
    j = np.asarray(k_pos, dtype=np.int64)[None, :]
    mask = j <= i
    if chunk_size:
        mask &= (j // chunk_size) == (i // chunk_size)
    return mask


def chunked_attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    q_positions: npt.ArrayLike,
    *,
    chunk_size: int,
    scale: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
) -> FloatArray:
    """Attention of queries over a sequence's keys under the chunked-local predicate, in float64.

    Args:
        q: [n, num_heads, head_size] queries, any float dtype.
        k, v: [S, num_kv_heads, head_size] the sequence's keys and values at positions 0..S-1.
        q_positions: [n] absolute positions of the queries (each < S).
        chunk_size: C; 0 for a global causal layer.
        scale: softmax scale; default 1 / sqrt(head_size).
        alibi_slopes: optional [num_heads] slopes; adds ``slope * (j - i)`` to each score.

    Returns:
        [n, num_heads, head_size] float64.
    """
    q64 = np.asarray(q, dtype=np.float64)
    k64 = np.asarray(k, dtype=np.float64)
    v64 = np.asarray(v, dtype=np.float64)
    qp = np.asarray(q_positions, dtype=np.int64)
    n, num_heads, head_size = q64.shape
    seq_len, num_kv_heads, _ = k64.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if qp.shape != (n,) or (n and (qp.min() < 0 or qp.max() >= seq_len)):
        raise ValueError(f"q_positions must be {n} positions in [0, {seq_len}), got {qp.tolist()}")
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale

    kh = np.repeat(k64, group, axis=1)  # [S, H, D]: query head h reads KV head h // group
    vh = np.repeat(v64, group, axis=1)
    scores = np.einsum("nhd,shd->hns", q64, kh) * scale  # [H, n, S]
    kp = np.arange(seq_len)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64).reshape(num_heads, 1, 1)
        scores = scores + slopes * (kp[None, None, :] - qp[None, :, None])
    mask = visible(qp, kp, chunk_size)
    scores = np.where(mask[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out: FloatArray = np.einsum("hns,shd->nhd", weights, vh)
    return out


def as_cached(x: npt.ArrayLike, cache_dtype: str, scale: float) -> FloatArray:
    """K or V values (float64 of float32 or narrower values, as sent) as a server's cache of ``cache_dtype``
    gives them back: a float8 cache holds x / scale (divided in float32, rounded to nearest even, saturated)
    and reads stored * scale; any other cache as the values were sent (the client sends the compute dtype).

    ``scale``: the layer's k_scale or v_scale from Info (``LayerInfo``)."""
    values = np.asarray(x, dtype=np.float64)
    d = dtypes.BY_NAME.get(cache_dtype)
    if d is None or not d.fp8:
        return values
    if not scale > 0:
        raise ValueError(f"a float8 cache's scale must be positive, got {scale} (0: not calibrated yet)")
    s = np.float32(scale)
    return dtypes.fp8_round(values.astype(np.float32) / s, d.name) * np.float64(s)


def within_tolerance(out: npt.ArrayLike, expected: npt.ArrayLike, dtype: str) -> tuple[bool, float]:
    """Whether a server's output matches the reference, and the error that was judged.

    float32: max abs error <= 1e-5. float16/bfloat16 (outputs rounded to 11 or 8 mantissa bits):
    max abs error <= 2e-2 of the output's scale (max |expected|); the error returned is then relative.
    """
    want = np.asarray(expected, dtype=np.float64)
    err = float(np.abs(np.asarray(out, dtype=np.float64) - want).max(initial=0.0))
    if dtype == "float32":
        return err <= 1e-5, err
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-6)
    return err <= 2e-2 * scale, err / scale


class ReferenceModel:
    """Keeps every sequence's full K/V history per layer and answers calls as the server should.

    Follows the server's call semantics: one call is one layer and one batch; tensors are packed in the
    order of ``entries``; a KV-sharing layer (``kv_sources[layer]`` set) attends over its source layer's
    keys and takes no k/v of its own.
    """

    def __init__(
        self,
        chunk_sizes: Sequence[int],
        *,
        kv_sources: Sequence[int | None] | None = None,
        scales: Sequence[float | None] | None = None,
        alibi_slopes: Sequence[npt.ArrayLike | None] | None = None,
    ) -> None:
        self.chunk_sizes = list(chunk_sizes)
        n = len(self.chunk_sizes)
        self.kv_sources = list(kv_sources) if kv_sources is not None else [None] * n
        self.scales = list(scales) if scales is not None else [None] * n
        self.alibi_slopes = list(alibi_slopes) if alibi_slopes is not None else [None] * n
        # (seq_id, layer) -> (k [S, Hkv, D], v [S, Hkv, D]) float64 history.
        self._kv: dict[tuple[str, int], tuple[FloatArray, FloatArray]] = {}

    @classmethod
    def for_server(cls, info: ServerInfo) -> ReferenceModel:
        """The reference of the model a server reports in Info: chunk sizes, KV sources, scales and slopes."""
        return cls(
            [x.chunk_size for x in info.layers],
            kv_sources=[x.kv_source for x in info.layers],
            scales=[x.scale for x in info.layers],
            alibi_slopes=[x.alibi_slopes if x.alibi else None for x in info.layers],
        )

    def length(self, seq_id: str, layer: int) -> int:
        """Tokens of K/V the sequence has written in ``layer`` (0 for a KV-sharing layer, which writes none)."""
        kv = self._kv.get((seq_id, layer))
        return 0 if kv is None else kv[0].shape[0]

    def attend(
        self,
        layer: int,
        entries: Sequence[BatchEntry],
        q: npt.ArrayLike,
        k: npt.ArrayLike | None = None,
        v: npt.ArrayLike | None = None,
    ) -> FloatArray:
        """Expected output [T, num_heads, head_size] float64 of one call; records the new k/v.

        Raises ValueError, recording nothing, when a writing layer's position is not the sequence's
        length there, a KV-sharing layer's source has not reached the call's last position, or a
        writing layer gets no k/v. (It does not track a sharer's own progress: the server does.)
        """
        q64 = np.asarray(q, dtype=np.float64)
        source = self.kv_sources[layer]
        owner = layer if source is None else source
        for e in entries:
            have = self.length(e.seq_id, owner)
            if source is None and have != e.position:
                raise ValueError(f"sequence {e.seq_id!r} has {have} tokens in layer {layer}, not {e.position}")
            if source is not None and have < e.position + e.num_tokens:
                raise ValueError(f"layer {source} holds {have} tokens of {e.seq_id!r}; layer {layer} needs more")
        if source is None and (k is None or v is None):
            raise ValueError(f"layer {layer} writes its own KV: k and v are required")
        outs = []
        row = 0
        for e in entries:
            rows = slice(row, row + e.num_tokens)
            row += e.num_tokens
            if source is None:
                self._append(e.seq_id, layer, np.asarray(k)[rows], np.asarray(v)[rows])
            hist_k, hist_v = self._kv[(e.seq_id, owner)]
            positions = np.arange(e.position, e.position + e.num_tokens)
            outs.append(
                chunked_attention(
                    q64[rows],
                    hist_k[: e.position + e.num_tokens],
                    hist_v[: e.position + e.num_tokens],
                    positions,
                    chunk_size=self.chunk_sizes[layer],
                    scale=self.scales[layer],
                    alibi_slopes=self.alibi_slopes[layer],
                )
            )
        return np.concatenate(outs, axis=0)

    def fork(self, parent: str, child: str) -> None:
        """``child`` starts with ``parent``'s history in every layer (the server's Fork)."""
        for (seq_id, layer), kv in list(self._kv.items()):
            if seq_id == parent:
                self._kv[(child, layer)] = kv  # arrays are never modified in place: sharing them is safe

    def truncate(self, seq_id: str, length: int) -> None:
        """Keep the sequence's first ``length`` tokens in every layer (the server's Truncate; the reference
        holds every position, so it has no window to refuse)."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        for key, (k, v) in list(self._kv.items()):
            if key[0] == seq_id:
                self._kv[key] = (k[:length], v[:length])  # views: the arrays are never modified in place

    def release(self, seq_id: str) -> None:
        """Forget a sequence in every layer."""
        for key in [key for key in self._kv if key[0] == seq_id]:
            del self._kv[key]

    def _append(self, seq_id: str, layer: int, k: npt.ArrayLike, v: npt.ArrayLike) -> None:
        k64 = np.asarray(k, dtype=np.float64)
        v64 = np.asarray(v, dtype=np.float64)
        old = self._kv.get((seq_id, layer))
        if old is not None:
            k64 = np.concatenate([old[0], k64])
            v64 = np.concatenate([old[1], v64])
        self._kv[(seq_id, layer)] = (k64, v64)


class BlockReference:
    """The block API's reference: keeps the K/V each writing layer stored at each slot of one block space and
    answers a block call as the server should (each row: causal attention of its new tokens over the keys its
    block table gives, its first ``seq_len - q_len`` keys before them; a chunked layer's caller windows the rows).

    A KV-sharing layer reads its source layer's slots and stores none.
    """

    def __init__(self, info: ServerInfo) -> None:
        self.block_size = info.block_size
        self._model = ReferenceModel.for_server(info)
        self._kv: dict[tuple[int, int], tuple[FloatArray, FloatArray]] = {}  # (layer, slot) -> (k, v) [Hkv, D]

    def attend(
        self,
        layer: int,
        rows: BlockRows,
        q: npt.ArrayLike,
        k: npt.ArrayLike | None = None,
        v: npt.ArrayLike | None = None,
    ) -> FloatArray:
        """Expected output [T, num_heads, head_size] float64 of one block call; stores the new k/v at their slots
        (a negative slot: not stored). KeyError when a row reads a slot no call has written."""
        m = self._model
        source = m.kv_sources[layer]
        owner = layer if source is None else source
        slots = np.asarray(rows.slot_mapping, dtype=np.int64)
        if source is None:
            if k is None or v is None:
                raise ValueError(f"layer {layer} writes its own KV: k and v are required")
            k64, v64 = np.asarray(k, dtype=np.float64), np.asarray(v, dtype=np.float64)
            for t, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    self._kv[(owner, slot)] = (k64[t], v64[t])
        q64 = np.asarray(q, dtype=np.float64)
        starts = np.asarray(rows.query_start_loc, dtype=np.int64)
        seq_lens = np.asarray(rows.seq_lens, dtype=np.int64)
        tables = np.asarray(rows.block_table, dtype=np.int64).reshape(len(seq_lens), -1)
        out = np.zeros(q64.shape, dtype=np.float64)
        bs = self.block_size
        for r, seq_len in enumerate(seq_lens.tolist()):
            first, last = int(starts[r]), int(starts[r + 1])
            if last == first:
                continue
            keys = [self._kv[(owner, int(tables[r, j // bs]) * bs + j % bs)] for j in range(seq_len)]
            out[first:last] = chunked_attention(
                q64[first:last],
                np.stack([kv[0] for kv in keys]),
                np.stack([kv[1] for kv in keys]),
                np.arange(seq_len - (last - first), seq_len),
                chunk_size=0,
                scale=m.scales[layer],
                alibi_slopes=m.alibi_slopes[layer],
            )
        return out
