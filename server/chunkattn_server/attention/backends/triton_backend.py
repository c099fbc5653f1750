"""The triton backend: paged chunked-local attention in one kernel launch per call (two for mixed batches).

``prepare`` checks the batch (shapes, strides, dtypes, devices: a clear ``TritonLaunchError`` before
anything runs) and builds int32 metadata on the device: per sequence its first row, query count, first
position and block-table base; per tile of queries its sequence and first query; the block tables.
``run`` only launches kernels, so a prepared step can be captured in a CUDA graph and replayed
(benchmarks/gpu.py does, and checks the replay against eager). Replaying a *later* step is not built yet:
the table width, the split count and the scratch buffers change as contexts grow, so that needs
fixed-width tables (C / block_size columns), splits fixed at capture and an in-place update of the
metadata. ``attend`` is prepare + run.

Decodes (single-token entries) and prefill pieces are launched apart, each with its own tile height:
a decode tile is one token with its query heads (rows padded to 16 for tl.dot), and long contexts over
few sequences are split across programs (flash-decoding) and merged by ``combine_splits``.

A float8 KV cache (pages of torch.float8_e4m3fn or torch.float8_e5m2, with the layer's k_scale and
v_scale) is read by the same kernel compiled with KV_FP8 (see triton_kernels for how it dequantizes);
q, the call's k/v and out stay in the compute dtype. ``write`` copies already-quantized float8 rows as
bytes. An e4m3 cache needs an sm_89+ GPU (Triton has no fp8e4nv before that); e5m2 runs on any.

The kernels run on CUDA, and on the CPU under TRITON_INTERPRET=1 (tests only: slow, and bf16 math is
wrong there).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from chunkattn_client import dtypes
from chunkattn_server import torchtypes
from chunkattn_server.attention.backends.base import AttentionBatch, Table, physical
from chunkattn_server.errors import ConfigError

LOG2E = 1.4426950408889634
HEAD_SIZES = (64, 80, 96, 128, 256)  # what the issue promises; any size up to 256 runs
_DTYPES = tuple(torchtypes.TORCH[d.name] for d in dtypes.COMPUTE)  # compute dtypes
_FP8 = tuple(t for t, d in torchtypes.OF_TORCH.items() if d.fp8)  # float8 cache dtypes (e4m3fn, e5m2)


class TritonLaunchError(ValueError):
    """A batch the kernels cannot take (a bug in the caller, not a client error)."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(device: torch.device) -> None:
    """The triton backend needs CUDA, or the interpreter (TRITON_INTERPRET=1) on the CPU."""
    if device.type != "cuda" and not interpreting():
        raise ConfigError(
            f"the triton backend runs on CUDA, not {device.type} (on the CPU only under TRITON_INTERPRET=1,"
            " for tests); use --backend torch or --backend auto"
        )


@dataclass
class _Part:
    """One kernel launch's metadata and scratch, all on the device."""

    tile_seq: torch.Tensor  # [tiles] int32
    tile_start: torch.Tensor  # [tiles] int32
    rows: int  # ROWS: a power of two >= 16
    block_m: int  # tokens per tile: rows // Q_PER_KV
    num_splits: int
    part_acc: torch.Tensor  # [tiles, Hkv, splits, R, BLOCK_D] float32 (empty when num_splits == 1)
    part_ml: torch.Tensor  # [tiles, Hkv, splits, 2, R] float32


@dataclass
class Launch:
    """Everything ``run`` needs; built by ``prepare``."""

    batch: AttentionBatch
    out: torch.Tensor
    seq_row: torch.Tensor  # [B] int32: first row of each sequence in q/k/v/out
    seq_len: torch.Tensor  # [B] int32: its new tokens
    seq_pos: torch.Tensor  # [B] int32: the position of its first new token
    seq_base: torch.Tensor  # [B] int32: the logical block of column 0 of its table row
    tables: torch.Tensor  # [B, W] int32: physical blocks
    slopes: torch.Tensor  # [H] float32 (a dummy when there is no ALiBi)
    parts: list[_Part]


class TritonBackend:
    """Chunked-local attention and KV writes with the kernels of ``triton_kernels``.

    block_n: keys per inner-loop step. num_splits: "auto" (split long decodes when there are fewer
    programs than twice the SMs) or a fixed count for decode launches. num_warps: per program.
    """

    name = "triton"

    def __init__(
        self,
        device: torch.device,
        *,
        block_n: int = 64,
        num_splits: int | str = "auto",
        prefill_rows: int = 64,
        num_warps: int = 4,
    ) -> None:
        check_device(device)
        for name, value in (("block_n", block_n), ("prefill_rows", prefill_rows)):
            if value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")
        if isinstance(num_splits, int) and num_splits < 1:
            raise ConfigError(f"num_splits must be 'auto' or >= 1, got {num_splits}")
        self.device = device
        self.block_n = block_n
        self.num_splits = num_splits
        self.prefill_rows = prefill_rows
        self.num_warps = num_warps
        props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
        self._sms = props.multi_processor_count if props is not None else 1
        self._capability = (props.major, props.minor) if props is not None else None

    # -- KV writes -----------------------------------------------------------------------------------

    def write(
        self, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k/v [n, Hkv, D] at cache slots [n] int64 (block * block_size + offset) of pages [Hkv, NB, BS, D].

        k/v are in the pages' dtype: for a float8 cache the engine has quantized them already, and they are
        copied as bytes (uint8 views, so that an e4m3 cache is written on any GPU)."""
        from chunkattn_server.attention.backends import triton_kernels as kern

        heads, _, block_size, head_size = k_pages.shape
        _check(
            k_pages.stride() == v_pages.stride() and k_pages.stride(3) == 1, "pages must share strides, D contiguous"
        )
        _check(
            k.shape == v.shape == (slots.numel(), heads, head_size), f"k/v {tuple(k.shape)} for {slots.numel()} slots"
        )
        _check(
            k.dtype == v.dtype == k_pages.dtype == v_pages.dtype,
            f"k/v {k.dtype}/{v.dtype} into pages of {k_pages.dtype}/{v_pages.dtype}: k, v and the pages must"
            " share the cache dtype (a float8 cache's rows come quantized)",
        )
        _check(k.stride(2) == 1 and v.stride(2) == 1, "k/v need a contiguous last dimension")
        if not slots.numel():
            return
        if k_pages.dtype in _FP8:
            k, v, k_pages, v_pages = (t.view(torch.uint8) for t in (k, v, k_pages, v_pages))
        kern.write_kv[(slots.numel(), heads)](
            k, v, k_pages, v_pages, slots,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            BLOCK_SIZE=block_size, HEAD_D=head_size, BLOCK_D=_pow2(head_size),
        )  # fmt: skip

    # -- attention -----------------------------------------------------------------------------------

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        self.run(self.prepare(batch, out))

    def prepare(self, batch: AttentionBatch, out: torch.Tensor) -> Launch:
        """Check the batch and build the launch metadata on the device."""
        q, k, v, kp, vp = batch.q, batch.k, batch.v, batch.k_pages, batch.v_pages
        _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be [T, heads, D]")
        total, heads, head_size = q.shape
        kv_heads, _, block_size, page_d = kp.shape
        _check(k.shape == v.shape == (total, kv_heads, head_size), f"k/v {tuple(k.shape)} against q {tuple(q.shape)}")
        _check(heads % kv_heads == 0, f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        _check(page_d == head_size and vp.shape == kp.shape, f"pages {tuple(kp.shape)} for head size {head_size}")
        _check(1 <= head_size <= 256, f"head size {head_size}: the kernels take 1..256 ({HEAD_SIZES} are tested)")
        _check(block_size == batch.block_size, f"pages of {block_size} tokens, batch says {batch.block_size}")
        _check(out.shape == q.shape, f"out {tuple(out.shape)} must be q's shape {tuple(q.shape)}")
        _check(
            q.dtype == k.dtype == v.dtype == out.dtype and q.dtype in _DTYPES,
            f"q, k, v and out must share one of {_DTYPES} (the compute dtype; a float8 cache's new rows come"
            f" dequantized): got q {q.dtype}, k {k.dtype}, v {v.dtype}, out {out.dtype}",
        )
        _check(
            kp.dtype == vp.dtype and kp.dtype in (q.dtype, *_FP8),
            f"pages of {kp.dtype} (K) and {vp.dtype} (V): both must be the compute dtype {q.dtype} or one of"
            f" the float8 cache dtypes {_FP8}",
        )
        if kp.dtype in _FP8:
            scales = (batch.k_scale, batch.v_scale)
            _check(
                all(math.isfinite(x) and x > 0 for x in scales),
                f"k_scale {batch.k_scale} and v_scale {batch.v_scale} of a float8 cache must be finite and > 0",
            )
            _check(
                kp.dtype != torch.float8_e4m3fn or self._capability is None or self._capability >= (8, 9),
                f"a float8_e4m3fn cache needs an sm_89+ GPU in the triton kernels (this one is sm_"
                f"{''.join(map(str, self._capability or ()))}); use a float8_e5m2 cache or --backend torch",
            )
        else:
            _check(
                batch.k_scale == batch.v_scale == 1.0,
                f"k_scale {batch.k_scale} and v_scale {batch.v_scale} with pages of {kp.dtype}: scales other"
                " than 1.0 are for a float8 cache only",
            )
        for name, t in (("q", q), ("k", k), ("v", v), ("k_pages", kp), ("v_pages", vp), ("out", out)):
            _check(t.device == self.device, f"{name} is on {t.device}, the backend on {self.device}")
            _check(t.stride(-1) == 1, f"{name} needs a contiguous last dimension")
        _check(kp.stride() == vp.stride(), "k_pages and v_pages must have the same strides")
        slopes = batch.alibi_slopes
        if slopes is not None:
            _check(slopes.shape == (heads,) and slopes.dtype == torch.float32, "alibi_slopes must be [H] float32")

        spans = batch.spans
        chunk = batch.chunk_size
        meta = np.array([(row, n, pos) for row, pos, n in spans], dtype=np.int64).reshape(-1, 3)
        rows, lens, poss = meta[:, 0], meta[:, 1], meta[:, 2]
        starts = poss - poss % chunk if chunk else np.zeros_like(poss)  # each sequence's chunk start
        bases = starts // block_size
        needed = np.maximum(-(-poss // block_size) - bases, 0)  # cache blocks of keys [chunk start, pos)
        tables = np.zeros((len(spans), max(1, int(needed.max(initial=0)))), dtype=np.int32)
        for i, table in enumerate(batch.tables):
            base = int(bases[i])
            tables[i, : needed[i]] = _blocks(table, base, base + int(needed[i]))
        q_per_kv = heads // kv_heads
        counts = lens.tolist()
        decodes = [i for i, n in enumerate(counts) if n == 1]
        prefills = [i for i, n in enumerate(counts) if n > 1]
        parts = []
        if decodes:
            ctx = int(max(poss[i] - starts[i] + 1 for i in decodes))
            splits = self._splits(len(decodes) * kv_heads, ctx)
            parts.append(self._part(decodes, counts, _pow2(max(16, q_per_kv)), splits, q_per_kv, kv_heads, head_size))
        if prefills:
            prefill_rows = _pow2(max(self.prefill_rows, q_per_kv))
            parts.append(self._part(prefills, counts, prefill_rows, 1, q_per_kv, kv_heads, head_size))
        seq = torch.from_numpy(np.concatenate([rows, lens, poss, bases]).astype(np.int32)).to(self.device)
        return Launch(
            batch=batch,
            out=out,
            seq_row=seq[0 : len(spans)],
            seq_len=seq[len(spans) : 2 * len(spans)],
            seq_pos=seq[2 * len(spans) : 3 * len(spans)],
            seq_base=seq[3 * len(spans) :],
            tables=torch.from_numpy(tables).to(self.device),
            slopes=slopes if slopes is not None else torch.zeros(1, dtype=torch.float32, device=self.device),
            parts=parts,
        )

    def run(self, launch: Launch) -> None:
        """Launch the kernels (nothing else: capturable in a CUDA graph)."""
        from chunkattn_server.attention.backends import triton_kernels as kern

        b, out = launch.batch, launch.out
        q, k, v, kp, vp = b.q, b.k, b.v, b.k_pages, b.v_pages
        heads, head_size = q.shape[1], q.shape[2]
        kv_heads, block_size = kp.shape[0], kp.shape[2]
        q_per_kv = heads // kv_heads
        meta = {"Q_PER_KV": q_per_kv, "HEAD_D": head_size, "BLOCK_D": max(16, _pow2(head_size))}
        for part in launch.parts:
            tiles = part.tile_seq.numel()
            kern.chunked_paged_attention[(tiles, kv_heads, part.num_splits)](
                out, part.part_acc, part.part_ml,
                q, k, v, kp, vp, launch.tables,
                part.tile_seq, part.tile_start, launch.seq_row, launch.seq_len, launch.seq_pos, launch.seq_base,
                launch.slopes,
                b.chunk_size, b.scale * LOG2E, float(b.k_scale), float(b.v_scale),
                out.stride(0), out.stride(1), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                v.stride(0), v.stride(1), kp.stride(0), kp.stride(1), kp.stride(2), launch.tables.stride(0),
                **attention_config(
                    q.dtype, head_size, q_per_kv, block_size, part.rows, part.num_splits, b.alibi_slopes is not None,
                    self.block_n, self.num_warps, kv_fp8=kp.dtype in _FP8,
                ),
            )  # fmt: skip
            if part.num_splits > 1:
                kern.combine_splits[(tiles, kv_heads)](
                    out, part.part_acc, part.part_ml, part.tile_seq, part.tile_start, launch.seq_row,
                    launch.seq_len, out.stride(0), out.stride(1),
                    ROWS=part.rows, BLOCK_M=part.block_m, NUM_SPLITS=part.num_splits, num_warps=self.num_warps,
                    **meta,
                )  # fmt: skip

    # -- helpers -------------------------------------------------------------------------------------

    def _splits(self, programs: int, context: int) -> int:
        """Decode splits: enough programs to fill the GPU (2 per SM), each with >= 4 key blocks to read."""
        if isinstance(self.num_splits, int):
            return self.num_splits
        if self.device.type != "cuda":
            return 1
        want = math.ceil(2 * self._sms / max(programs, 1))
        return _pow2(max(1, min(want, 16, context // (4 * self.block_n))))  # powers of two: few compiled variants

    def _part(
        self, seqs: Sequence[int], lens: Sequence[int], rows: int, splits: int, q_per_kv: int, kv_heads: int, d: int
    ) -> _Part:
        block_m = rows // q_per_kv
        tile_seq = [i for i in seqs for _ in range(0, lens[i], block_m)]
        tile_start = [s for i in seqs for s in range(0, lens[i], block_m)]
        block_d = max(16, _pow2(d))
        n = len(tile_seq) * kv_heads * splits if splits > 1 else 0
        dev = self.device
        return _Part(
            tile_seq=torch.tensor(tile_seq, dtype=torch.int32).to(dev),
            tile_start=torch.tensor(tile_start, dtype=torch.int32).to(dev),
            rows=rows,
            block_m=block_m,
            num_splits=splits,
            part_acc=torch.empty(max(n, 1) * rows * block_d, dtype=torch.float32, device=dev),
            part_ml=torch.empty(max(n, 1) * 2 * rows, dtype=torch.float32, device=dev),
        )


def attention_config(
    dtype: torch.dtype,
    head_size: int,
    q_per_kv: int,
    block_size: int,
    rows: int,
    splits: int,
    alibi: bool,
    block_n: int,
    num_warps: int,
    *,
    kv_fp8: bool = False,
) -> dict[str, int | bool]:
    """The compile-time constants and launch options of one ``chunked_paged_attention`` launch.

    dtype: the compute dtype (q's); kv_fp8: the pages are a float8 cache (dequantized in the kernel).

    fp32 tiles and head sizes over 128 get fewer pipeline stages (and fp32 narrower key blocks) to fit in
    shared memory: fp32 with head size 256 would need 344 KB on sm_90 otherwise (an H200 has 227 KiB).
    tests/attention/test_triton_compile.py compiles these for sm_90 ahead of time and checks the shared memory.
    """
    fp32 = dtype == torch.float32
    config: dict[str, int | bool] = {
        "Q_PER_KV": q_per_kv,
        "ROWS": rows,
        "BLOCK_M": rows // q_per_kv,
        "BLOCK_N": min(block_n, 32) if fp32 else block_n,
        "BLOCK_SIZE": block_size,
        "HEAD_D": head_size,
        "BLOCK_D": max(16, _pow2(head_size)),
        "NUM_SPLITS": splits,
        "HAS_ALIBI": alibi,
        "IEEE": fp32,
        "KV_FP8": kv_fp8,
        "num_warps": num_warps,
    }
    if fp32 or head_size > 128:
        config["num_stages"] = 2
    return config


def _blocks(table: Table, first: int, last: int) -> np.ndarray:
    try:
        return physical(table, first, last)
    except KeyError as e:
        raise TritonLaunchError(f"logical block {e.args[0]} is needed but not in the sequence's table") from None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise TritonLaunchError(message)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


__all__ = [
    "HEAD_SIZES",
    "Launch",
    "TritonBackend",
    "TritonLaunchError",
    "attention_config",
    "check_device",
    "interpreting",
]
