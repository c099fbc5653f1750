"""The engine against the SDPA baselines on the CPU, side by side in one run, in float32 and bfloat16.

1. prefill: one 16,384-token sequence, C = 4096, 8 query / 2 KV heads, head size 128, through
   ``Engine.attend`` (K/V written into the paged cache, context read back from it), against
   (a) SDPA per chunk on contiguous tensors, the ideal (target: ours / ideal <= 1.15);
   (b) full causal SDPA over the whole sequence (target: >= 3x our time);
   (c) FlexAttention with the chunked block mask, compiled, compile time excluded (target: ours faster).
   Also: the same prompt sent in pieces of 2,048 tokens, so every piece reads its context from the cache.
2. decode: 32 sequences x 1 token with 4,096 tokens of context inside one chunk, 32 query / 8 KV heads,
   head size 128: KV bytes read per second against the copy bandwidth measured in this run, and against
   SDPA over a contiguous, unpaged cache (the faster of enable_gqa and grouping query heads by reshape;
   target: ours / contiguous <= 1.2). Two block layouts: the allocator's own (the 32 prompts prefilled
   interleaved, in 256-token pieces, as a server sees them), and scattered: a pool where every other
   block is held by someone else, so no two blocks of a sequence touch and every read is a gather.
3. fp8: the decode of 2. (allocator's layout) over a float8 KV cache (e4m3 and e5m2, scales calibrated by the
   first write, as vLLM's calculate_kv_scales) against a bfloat16 cache on the same data, both computing in
   bfloat16: time per step, KV bytes read per second (a float8 cache has half the bytes), and the error of
   one step against the float64 reference on the unquantized K/V and on K/V as the cache holds them
   (first 4 sequences).
4. memory: blocks held by one sequence after 200,000 tokens with C = 4096 and blocks of 16.

Timings are medians over rounds that run every contender in turn, so drift hits all alike.

    python benchmarks/engine.py [--json PATH] [--repeats N] [--dtypes float32,bfloat16] [--no-flex] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from typing import Any

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from chunkattn_client import BatchEntry, dtypes
from chunkattn_client.reference import as_cached, chunked_attention
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.attention.backends import AttentionBatch, TorchBackend
from chunkattn_server.kv.scales import KVScales

from baselines import copy_bandwidth, flex_chunked  # benchmarks/baselines.py
from timing import cpu_name, publish, rounds  # benchmarks/timing.py

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class Shapes:
    prefill_tokens: int = 16_384
    prefill_chunk: int = 4096
    prefill_heads: tuple[int, int] = (8, 2)
    prefill_piece: int = 2048
    decode_seqs: int = 32
    decode_context: int = 4096
    decode_heads: tuple[int, int] = (32, 8)
    head_size: int = 128
    memory_tokens: int = 200_000
    memory_chunk: int = 4096
    memory_piece: int = 5000
    block_size: int = 16
    copy_bytes: int = 1 << 30
    run_tokens: int = 256


SMOKE = Shapes(
    prefill_tokens=256,
    prefill_chunk=64,
    prefill_heads=(4, 2),
    prefill_piece=48,
    decode_seqs=4,
    decode_context=128,
    decode_heads=(4, 2),
    head_size=16,
    memory_tokens=2000,
    memory_chunk=64,
    memory_piece=100,
    copy_bytes=1 << 20,
    run_tokens=64,
)


def _engine(
    chunk: int,
    heads: tuple[int, int],
    head_size: int,
    num_blocks: int,
    dtype: str,
    block_size: int,
    cache_dtype: str = "auto",
) -> Engine:
    """One layer; ``dtype`` computes, ``cache_dtype`` ("auto": the same) is stored (float8: calibrated)."""
    model = ModelShape(num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, layers=(LayerSpec(chunk),))
    scales = KVScales(calibrate=True) if "fp8" in cache_dtype else None
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, dtype=cache_dtype, scales=scales)
    return Engine(EngineConfig(model, cache, device="cpu", dtype=dtype))


# -- prefill -----------------------------------------------------------------------------------------


def bench_prefill(dtype: str, s: Shapes, repeats: int, flex: bool) -> dict[str, float | None]:
    dt = DTYPES[dtype]
    n, c, (h, hkv), d = s.prefill_tokens, s.prefill_chunk, s.prefill_heads, s.head_size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, h, d, generator=g).to(dt)  # the API's packed layout [T, H, D]
    k = torch.randn(n, hkv, d, generator=g).to(dt)
    v = torch.randn(n, hkv, d, generator=g).to(dt)
    engine = _engine(c, (h, hkv), d, n // s.block_size + 8, dtype, s.block_size)

    def ours() -> torch.Tensor:
        engine.kv.release(["p"], missing_ok=True, tenant="")
        return engine.attend(0, [BatchEntry("p", 0, n)], q, k, v, tenant="")

    def ours_pieces() -> None:
        engine.kv.release(["p"], missing_ok=True, tenant="")
        for start in range(0, n, s.prefill_piece):
            rows = slice(start, min(n, start + s.prefill_piece))
            engine.attend(0, [BatchEntry("p", start, rows.stop - start)], q[rows], k[rows], v[rows], tenant="")

    # Baselines get their ideal layout up front: [chunks, heads, C, D] contiguous, or [1, heads, S, D].
    qc = q.view(n // c, c, h, d).transpose(1, 2).contiguous()
    kc = k.view(n // c, c, hkv, d).transpose(1, 2).contiguous()
    vc = v.view(n // c, c, hkv, d).transpose(1, 2).contiguous()
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))

    # SDPA's CPU flash kernel takes GQA natively (enable_gqa); expanding K/V to all heads measured the same.
    close = {
        "ours_s": ours,
        "ours_pieces_s": ours_pieces,
        "sdpa_per_chunk_s": lambda: sdpa(qc, kc, vc, is_causal=True, enable_gqa=True),
    }
    # Far from their thresholds and slow: fewer rounds, to keep the whole run inside 5 minutes.
    far: dict[str, Callable[[], object]] = {
        "full_causal_s": lambda: sdpa(qf, kf, vf, is_causal=True, enable_gqa=True),
    }
    if flex:
        far["flex_s"] = flex_chunked(qf, kf, vf, c)

    # Correctness first: ours equals SDPA per chunk (a benchmark of wrong answers is worth nothing).
    want = sdpa(qc, kc, vc, is_causal=True, enable_gqa=True)
    got = ours().view(n // c, c, h, d).transpose(1, 2)
    err = (got.float() - want.float()).abs().max().item()
    if err > (1e-4 if dtype == "float32" else 3e-2):
        raise SystemExit(f"prefill {dtype}: ours differs from SDPA per chunk by {err}")

    t: dict[str, float | None] = {"flex_s": None}
    t.update(rounds(close, repeats))
    t.update(rounds(far, max(1, repeats // 2)))
    return t


# -- decode ------------------------------------------------------------------------------------------


class _WriteOnly(TorchBackend):
    """Set-up only: lets the engine write a long context's K/V without computing attention nobody times."""

    name = "write-only"

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        out.zero_()


def bench_decode(dtype: str, s: Shapes, repeats: int) -> dict[str, float]:
    dt = DTYPES[dtype]
    b, ctx, (h, hkv), d = s.decode_seqs, s.decode_context, s.decode_heads, s.head_size
    g = torch.Generator().manual_seed(1)
    # C = 2 * ctx keeps every decode of the run inside one chunk, with ctx (+ the step) keys of context.
    # Twice the blocks the sequences need: room for the scattered layout's interleaving.
    blocks_per_seq = ctx // s.block_size + repeats + 4
    engine = _engine(2 * ctx, (h, hkv), d, 2 * b * blocks_per_seq, dtype, s.block_size)

    kv_bytes = 2 * b * ctx * hkv * d * dt.itemsize  # K and V read by one decode step
    q1 = torch.randn(b, h, d, generator=g).to(dt)
    k1 = torch.randn(b, hkv, d, generator=g).to(dt)
    v1 = torch.randn(b, hkv, d, generator=g).to(dt)

    # The contiguous, unpaged baseline: [B, Hkv, ctx, D].
    kc = torch.randn(b, hkv, ctx, d, generator=g).to(dt)
    vc = torch.randn(b, hkv, ctx, d, generator=g).to(dt)
    q_gqa = q1.unsqueeze(2)  # [B, H, 1, D]
    q_grouped = q1.view(b, hkv, h // hkv, d)  # query heads of one KV head as rows: K/V read once
    baseline = rounds(
        {
            "gqa": lambda: sdpa(q_gqa, kc, vc, enable_gqa=True),
            "grouped": lambda: _cpu_flash(q_grouped, kc, vc),
        },
        repeats,
    )
    out: dict[str, float] = {"sdpa_contiguous_s": min(baseline.values())}

    for layout in ("", "_scattered"):
        held = []
        if layout:  # every other block taken: each sequence block lands alone
            held = engine.pool.allocate(engine.pool.num_free, account="")
            engine.pool.free(held[::2])
            held = held[1::2]
        _fill(engine, b, ctx - 1, s.run_tokens, (h, hkv), d, dt)
        pos = [ctx - 1]

        def step(pos: list[int] = pos) -> torch.Tensor:
            entries = [BatchEntry(f"s{i}", pos[0], 1) for i in range(b)]
            pos[0] += 1
            return engine.attend(0, entries, q1, k1, v1, tenant="")

        out[f"ours{layout}_s"] = rounds({"ours": step}, repeats)["ours"]
        engine.kv.release(engine.kv.sequence_ids(tenant=""), tenant="")
        engine.pool.free(held)

    out["kv_gbps"] = kv_bytes / out["ours_s"] / 1e9
    out["copy_gbps"] = copy_bandwidth(s.copy_bytes, torch.device("cpu"), lambda fns: rounds(fns, 5))
    return out


def _fill(engine: Engine, seqs: int, tokens: int, piece: int, heads: tuple[int, int], d: int, dt: torch.dtype) -> None:
    """Prefill `seqs` sequences to `tokens` tokens, interleaved in pieces of `piece` tokens (the layout)."""
    backend = engine.backend
    engine.backend = _WriteOnly(engine.device)
    g = torch.Generator().manual_seed(2)
    try:
        for start in range(0, tokens, piece):
            n = min(piece, tokens - start)
            for i in range(seqs):
                q = torch.randn(n, heads[0], d, generator=g).to(dt)
                kv = torch.randn(n, heads[1], d, generator=g).to(dt)
                engine.attend(0, [BatchEntry(f"s{i}", start, n)], q, kv, kv, tenant="")
    finally:
        engine.backend = backend


# -- fp8 -------------------------------------------------------------------------------------------


FP8_CACHES = ("bfloat16", "fp8_e4m3", "fp8_e5m2")


def bench_fp8(s: Shapes, repeats: int) -> dict[str, dict[str, float]]:
    """The decode of bench_decode over each cache of FP8_CACHES, computing in bfloat16, on the same K/V."""
    b, ctx, (h, hkv), d = s.decode_seqs, s.decode_context, s.decode_heads, s.head_size
    g = torch.Generator().manual_seed(3)
    k_all = torch.randn(b, ctx, hkv, d, generator=g).to(torch.bfloat16)  # the sent K/V, per sequence
    v_all = torch.randn(b, ctx, hkv, d, generator=g).to(torch.bfloat16)
    q1 = torch.randn(b, h, d, generator=g).to(torch.bfloat16)
    checked = min(b, 4)
    plain = _decode_reference(q1[:checked], k_all[:checked], v_all[:checked])
    engines = {}
    for cache in FP8_CACHES:
        engine = _engine(2 * ctx, (h, hkv), d, b * (ctx // s.block_size + repeats + 4), "bfloat16", s.block_size, cache)
        backend = engine.backend
        engine.backend = _WriteOnly(engine.device)
        for start in range(0, ctx - 1, s.run_tokens):  # interleaved prefill pieces: the allocator's layout
            n = min(s.run_tokens, ctx - 1 - start)
            for i in range(b):
                rows = slice(start, start + n)
                q = torch.zeros(n, h, d, dtype=torch.bfloat16)
                engine.attend(0, [BatchEntry(f"s{i}", start, n)], q, k_all[i, rows], v_all[i, rows], tenant="")
        engine.backend = backend
        engines[cache] = engine
    out: dict[str, dict[str, float]] = {}
    last = (k_all[:, -1], v_all[:, -1])
    for cache, engine in engines.items():
        # Correctness first: one step against float64, on K/V as sent and as this cache holds them.
        got = engine.attend(0, [BatchEntry(f"s{i}", ctx - 1, 1) for i in range(b)], q1, *last, tenant="")
        engine.kv.release(engine.kv.sequence_ids(tenant=""), tenant="")
        scales = engine.scales.of(0) or (1.0, 1.0)
        held = _decode_reference(q1[:checked], k_all[:checked], v_all[:checked], cache, scales)
        ours = got[:checked].double().numpy()
        out[cache] = {
            "error_vs_unquantized": float(np.abs(ours - plain).max()),
            "error_vs_cached": float(np.abs(ours - held).max()),
            "k_scale": scales[0],
            "v_scale": scales[1],
        }
    times = {}
    for cache, engine in engines.items():  # the timed steps: each cache prefilled again, decoded in rounds
        _fill(engine, b, ctx - 1, s.run_tokens, (h, hkv), d, torch.bfloat16)
        pos = [ctx - 1]

        def step(engine: Engine = engine, pos: list[int] = pos) -> torch.Tensor:
            entries = [BatchEntry(f"s{i}", pos[0], 1) for i in range(b)]
            pos[0] += 1
            return engine.attend(0, entries, q1, *last, tenant="")

        times[cache] = step
    medians = rounds(times, repeats)
    for cache, seconds in medians.items():
        itemsize = 1 if "fp8" in cache else 2
        out[cache]["step_s"] = seconds
        out[cache]["kv_gbps"] = 2 * b * ctx * hkv * d * itemsize / seconds / 1e9
        out[cache]["time_vs_bf16"] = seconds / medians["bfloat16"]
    return out


def _decode_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: str = "float32", scales: tuple[float, float] = (1, 1)
) -> np.ndarray:
    """float64 decode outputs [B, H, D] of q [B, H, D] over k, v [B, ctx, Hkv, D] as a cache of ``cache`` (over
    ``scales``) holds them (float32: as they are); the query is the last position, whose K/V are the last
    rows."""
    b, ctx = k.shape[:2]
    outs = []
    for i in range(b):
        ki, vi = (
            as_cached(x[i].double().numpy(), dtypes.lookup(cache).name, s) for x, s in ((k, scales[0]), (v, scales[1]))
        )
        outs.append(chunked_attention(q[i : i + 1].double().numpy(), ki, vi, [ctx - 1], chunk_size=0))
    return np.stack(outs)[:, 0]


# -- memory ------------------------------------------------------------------------------------------


def bench_memory(s: Shapes) -> dict[str, int]:
    model = ModelShape(num_heads=1, num_kv_heads=1, head_size=4, layers=(LayerSpec(s.memory_chunk),))
    cache = CacheConfig(
        block_size=s.block_size, num_blocks=s.memory_piece // s.block_size + s.memory_chunk // s.block_size + 4
    )
    engine = Engine(EngineConfig(model, cache, device="cpu"))
    peak = 0
    for start in range(0, s.memory_tokens, s.memory_piece):
        n = min(s.memory_piece, s.memory_tokens - start)
        x = torch.randn(n, 1, 4)
        engine.attend(0, [BatchEntry("long", start, n)], x, x, x, tenant="")
        peak = max(peak, engine.kv.sequence("long", tenant="").num_blocks)
    return {
        "blocks_held": engine.kv.sequence("long", tenant="").num_blocks,
        "peak_blocks": peak,
        "bound": s.memory_chunk // s.block_size,
    }


# -- report ------------------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISS"


def report(result: dict[str, Any]) -> str:
    """The human-readable table: times, ratios and each target's verdict."""
    shapes, memory = result["shapes"], result["memory"]
    lines = [
        f"chunkattn engine benchmark, {result['date']}, {result['machine']}",
        "",
        f"prefill (one sequence, C = {shapes['prefill_chunk']}, {shapes['prefill_tokens']} tokens)",
        f"{'dtype':<9} {'ours':>8} {'in pieces':>10} {'SDPA/chunk':>11} {'ours/ideal':>15}"
        f" {'full causal':>12} {'full/ours':>14} {'flex':>8} {'flex/ours':>14}",
    ]
    for dtype, p in result["prefill"].items():
        ratio = p["ours_s"] / p["sdpa_per_chunk_s"]
        full = p["full_causal_s"] / p["ours_s"]
        flex, flex_ratio = "-", "-"
        if p["flex_s"] is not None:
            flex = f"{p['flex_s']:.3f}s"
            flex_ratio = f"{p['flex_s'] / p['ours_s']:.2f}x {_verdict(p['flex_s'] > p['ours_s'])}"
        lines.append(
            f"{dtype:<9} {p['ours_s']:>7.3f}s {p['ours_pieces_s']:>9.3f}s {p['sdpa_per_chunk_s']:>10.3f}s"
            f" {ratio:>8.3f} {_verdict(ratio <= 1.15):>6} {p['full_causal_s']:>11.3f}s"
            f" {full:>8.2f}x {_verdict(full >= 3):>5} {flex:>8} {flex_ratio:>14}"
        )
    lines += [
        "",
        f"decode ({shapes['decode_seqs']} sequences x 1 token, {shapes['decode_context']} tokens of context)",
        f"{'dtype':<9} {'ours':>8} {'contiguous':>11} {'ours/contig':>15} {'KV GB/s':>8} {'copy GB/s':>10}"
        f" {'KV/copy':>8} {'scattered':>10}",
    ]
    for dtype, d in result["decode"].items():
        ratio = d["ours_s"] / d["sdpa_contiguous_s"]
        lines.append(
            f"{dtype:<9} {d['ours_s'] * 1e3:>6.1f}ms {d['sdpa_contiguous_s'] * 1e3:>9.1f}ms {ratio:>8.3f}"
            f" {_verdict(ratio <= 1.2):>6} {d['kv_gbps']:>8.1f} {d['copy_gbps']:>10.1f}"
            f" {d['kv_gbps'] / d['copy_gbps']:>7.0%} {d['ours_scattered_s'] / d['sdpa_contiguous_s']:>9.2f}x"
        )
    if result.get("fp8"):
        lines += [
            "",
            "fp8 KV cache: the decode above (allocator's layout), computing in bfloat16, same K/V",
            f"{'cache':<9} {'step':>8} {'vs bf16':>8} {'KV GB/s':>8} {'err vs fp64':>12} {'vs fp64 (held)':>15}"
            f" {'k/v scale':>18}",
        ]
        for cache, f in result["fp8"].items():
            lines.append(
                f"{cache:<9} {f['step_s'] * 1e3:>6.1f}ms {f['time_vs_bf16']:>7.2f}x {f['kv_gbps']:>8.1f}"
                f" {f['error_vs_unquantized']:>12.2e} {f['error_vs_cached']:>15.2e}"
                f" {f['k_scale']:>8.4f}/{f['v_scale']:<8.4f}"
            )
    lines += [
        "",
        f"memory: one sequence of {shapes['memory_tokens']} tokens, C = {shapes['memory_chunk']}, blocks of"
        f" {shapes['block_size']}: holds {memory['blocks_held']} blocks (peak {memory['peak_blocks']}),"
        f" bound {memory['bound']} {_verdict(memory['peak_blocks'] <= memory['bound'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the medians as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per contender (default 5)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes ~30 s)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the code paths in seconds")
    parser.add_argument("--no-fp8", action="store_true", help="skip the float8 cache rows")
    args = parser.parse_args(argv)
    shapes = SMOKE if args.smoke else Shapes()
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtypes {unknown}; choose from {sorted(DTYPES)}")

    started = time.perf_counter()
    result: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads,"
        f" torch {torch.__version__}",
        "shapes": asdict(shapes),
        "prefill": {dt: bench_prefill(dt, shapes, args.repeats, flex=not args.no_flex) for dt in dtypes},
        "decode": {dt: bench_decode(dt, shapes, args.repeats) for dt in dtypes},
        "fp8": None if args.no_fp8 else bench_fp8(shapes, args.repeats),
        "memory": bench_memory(shapes),
    }
    result["duration_s"] = time.perf_counter() - started
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
