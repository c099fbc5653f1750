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

"Ours" is the engine on the torch backend; every row of 1.-3. also runs it on the native backend (the torch
backend with its decodes in a native kernel, backends/native/), in the same rounds, with native / torch
printed. Where the native kernels cannot be built here, the run says why and times torch only.
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
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from chunkattn_client import BatchEntry, dtypes
from chunkattn_client.reference import as_cached, chunked_attention
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.kv.scales import KVScales

import contenders  # benchmarks/contenders.py
from baselines import copy_bandwidth, flex_chunked  # benchmarks/baselines.py
from timing import cpu_name, publish, rounds  # benchmarks/timing.py

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max |difference| of two kernels' outputs, per compute dtype
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


def _engines(
    backends: tuple[str, ...],
    chunk: int,
    heads: tuple[int, int],
    head_size: int,
    num_blocks: int,
    dtype: str,
    block_size: int,
    cache_dtype: str = "auto",
) -> dict[str, Engine]:
    """One engine per backend, one layer each; ``dtype`` computes, ``cache_dtype`` ("auto": the same) is stored
    (float8: calibrated)."""
    scales = KVScales(calibrate=True) if "fp8" in cache_dtype else None
    return {
        name: contenders.engine(
            name, chunk=chunk, heads=heads, head_size=head_size, num_blocks=num_blocks, dtype=dtype,
            block_size=block_size, cache_dtype=cache_dtype, scales=scales,
        )
        for name in backends
    }  # fmt: skip


def _agree(what: str, dtype: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want|; exits saying so where it is past the dtype's tolerance (a benchmark of wrong answers
    is worth nothing)."""
    err = (got.float() - want.float()).abs().max().item()
    if err > TOLERANCE[dtype]:
        raise SystemExit(f"{what} {dtype}: differs by {err} (tolerance {TOLERANCE[dtype]})")
    return err


# -- prefill -----------------------------------------------------------------------------------------


def bench_prefill(
    dtype: str, s: Shapes, repeats: int, flex: bool, backends: tuple[str, ...]
) -> dict[str, float | None]:
    dt = DTYPES[dtype]
    n, c, (h, hkv), d = s.prefill_tokens, s.prefill_chunk, s.prefill_heads, s.head_size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, h, d, generator=g).to(dt)  # the API's packed layout [T, H, D]
    k = torch.randn(n, hkv, d, generator=g).to(dt)
    v = torch.randn(n, hkv, d, generator=g).to(dt)
    engines = _engines(backends, c, (h, hkv), d, n // s.block_size + 8, dtype, s.block_size)

    def ours(engine: Engine) -> torch.Tensor:
        engine.kv.release(["p"], missing_ok=True, tenant="")
        return engine.attend(0, [BatchEntry("p", 0, n)], q, k, v, tenant="")

    def ours_pieces(engine: Engine) -> None:
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
    # ours_*: the torch backend; native_*: the native one.
    close: dict[str, Callable[[], object]] = {}
    for name, engine in engines.items():
        prefix = "ours" if name == "torch" else name
        close[f"{prefix}_s"] = partial(ours, engine)
        close[f"{prefix}_pieces_s"] = partial(ours_pieces, engine)
    close["sdpa_per_chunk_s"] = lambda: sdpa(qc, kc, vc, is_causal=True, enable_gqa=True)
    # Far from their thresholds and slow: fewer rounds, to keep the whole run inside 5 minutes.
    far: dict[str, Callable[[], object]] = {
        "full_causal_s": lambda: sdpa(qf, kf, vf, is_causal=True, enable_gqa=True),
    }
    if flex:
        far["flex_s"] = flex_chunked(qf, kf, vf, c)

    # Correctness first: ours equals SDPA per chunk (a benchmark of wrong answers is worth nothing).
    want = sdpa(qc, kc, vc, is_causal=True, enable_gqa=True)
    for name, engine in engines.items():
        _agree(
            f"prefill ({name} backend) against SDPA per chunk",
            dtype,
            ours(engine).view(n // c, c, h, d).transpose(1, 2),
            want,
        )

    t: dict[str, float | None] = {"flex_s": None}
    medians = rounds(close, repeats)
    t.update(medians)
    t.update(rounds(far, max(1, repeats // 2)))
    if "native" in engines:
        t["native_vs_torch"] = medians["native_s"] / medians["ours_s"]
        t["native_pieces_vs_torch"] = medians["native_pieces_s"] / medians["ours_pieces_s"]
    return t


# -- decode ------------------------------------------------------------------------------------------


def bench_decode(dtype: str, s: Shapes, repeats: int, backends: tuple[str, ...]) -> dict[str, float]:
    dt = DTYPES[dtype]
    b, ctx, (h, hkv), d = s.decode_seqs, s.decode_context, s.decode_heads, s.head_size
    g = torch.Generator().manual_seed(1)
    # C = 2 * ctx keeps every decode of the run inside one chunk, with ctx (+ the step) keys of context.
    # Twice the blocks the sequences need: room for the scattered layout's interleaving.
    blocks_per_seq = ctx // s.block_size + repeats + 4
    engines = _engines(backends, 2 * ctx, (h, hkv), d, 2 * b * blocks_per_seq, dtype, s.block_size)

    kv_bytes = 2 * b * ctx * hkv * d * dt.itemsize  # K and V read by one decode step
    q1 = torch.randn(b, h, d, generator=g).to(dt)
    k1 = torch.randn(b, hkv, d, generator=g).to(dt)
    v1 = torch.randn(b, hkv, d, generator=g).to(dt)

    out: dict[str, float] = {"sdpa_contiguous_s": _contiguous(q1, hkv, ctx, g, repeats)}

    # The context before the first step, the same in every engine: [B, ctx - 1, Hkv, D].
    k_all = torch.randn(b, ctx - 1, hkv, d, generator=g).to(dt)
    v_all = torch.randn(b, ctx - 1, hkv, d, generator=g).to(dt)
    for layout in ("", "_scattered"):
        held: dict[str, list[int]] = {}
        for name, engine in engines.items():
            held[name] = []
            if layout:  # every other block taken: each sequence block lands alone
                taken = engine.pool.allocate(engine.pool.num_free, account="")
                engine.pool.free(taken[::2])
                held[name] = taken[1::2]
            contenders.prefill(engine, k_all, v_all, s.run_tokens)
        steps = {name: contenders.Decoder(engine, q1, k1, v1, ctx - 1) for name, engine in engines.items()}
        first = {name: step() for name, step in steps.items()}  # checked: native against torch
        if "native" in first:
            what = f"decode{layout.replace('_', ' ')} (native backend) against torch"
            out[f"native{layout}_max_diff"] = _agree(what, dtype, first["native"], first["torch"])
        medians = rounds(steps, repeats)
        out[f"ours{layout}_s"] = medians["torch"]
        if "native" in medians:
            out[f"native{layout}_s"] = medians["native"]
            out[f"native{layout}_vs_torch"] = medians["native"] / medians["torch"]
        for name, engine in engines.items():
            engine.kv.release(engine.kv.sequence_ids(tenant=""), tenant="")
            engine.pool.free(held[name])

    out["kv_gbps"] = kv_bytes / out["ours_s"] / 1e9
    if "native_s" in out:
        out["native_kv_gbps"] = kv_bytes / out["native_s"] / 1e9
    out["copy_gbps"] = copy_bandwidth(s.copy_bytes, torch.device("cpu"), lambda fns: rounds(fns, 5))
    return out


def _contiguous(q1: torch.Tensor, hkv: int, ctx: int, g: torch.Generator, repeats: int) -> float:
    """The contiguous, unpaged baseline: SDPA of q1 [B, H, D] over a cache [B, Hkv, ctx, D], the faster of
    enable_gqa and grouping query heads by reshape."""
    b, h, d = q1.shape
    kc = torch.randn(b, hkv, ctx, d, generator=g).to(q1.dtype)
    vc = torch.randn(b, hkv, ctx, d, generator=g).to(q1.dtype)
    q_gqa = q1.unsqueeze(2)  # [B, H, 1, D]
    q_grouped = q1.view(b, hkv, h // hkv, d)  # query heads of one KV head as rows: K/V read once
    baseline = rounds(
        {
            "gqa": lambda: sdpa(q_gqa, kc, vc, enable_gqa=True),
            "grouped": lambda: _cpu_flash(q_grouped, kc, vc),
        },
        repeats,
    )
    return min(baseline.values())


# -- fp8 -------------------------------------------------------------------------------------------


FP8_CACHES = ("bfloat16", "fp8_e4m3", "fp8_e5m2")


def bench_fp8(s: Shapes, repeats: int, backends: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The decode of bench_decode over each cache of FP8_CACHES, computing in bfloat16, on the same K/V; per
    backend (torch's keys plain, native's prefixed ``native_``)."""
    b, ctx, (h, hkv), d = s.decode_seqs, s.decode_context, s.decode_heads, s.head_size
    g = torch.Generator().manual_seed(3)
    k_all = torch.randn(b, ctx, hkv, d, generator=g).to(torch.bfloat16)  # the sent K/V, per sequence
    v_all = torch.randn(b, ctx, hkv, d, generator=g).to(torch.bfloat16)
    q1 = torch.randn(b, h, d, generator=g).to(torch.bfloat16)
    checked = min(b, 4)
    plain = _decode_reference(q1[:checked], k_all[:checked], v_all[:checked])
    num_blocks = b * (ctx // s.block_size + repeats + 4)
    steps: dict[str, Callable[[], torch.Tensor]] = {}  # "cache" (torch) or "cache native"
    out: dict[str, dict[str, float]] = {}
    last = (k_all[:, -1], v_all[:, -1])
    for cache in FP8_CACHES:
        out[cache] = {}
        for name, engine in _engines(
            backends, 2 * ctx, (h, hkv), d, num_blocks, "bfloat16", s.block_size, cache
        ).items():
            # The allocator's layout (interleaved prefill pieces); the first write calibrates the scales.
            contenders.prefill(engine, k_all[:, : ctx - 1], v_all[:, : ctx - 1], s.run_tokens)
            step = contenders.Decoder(engine, q1, *last, ctx - 1)
            # Correctness first: one step against float64, on K/V as sent and as this cache holds them.
            ours = step()[:checked].double().numpy()
            scales = engine.scales.of(0) or (1.0, 1.0)
            held = _decode_reference(q1[:checked], k_all[:checked], v_all[:checked], cache, scales)
            prefix = "" if name == "torch" else f"{name}_"
            out[cache][f"{prefix}error_vs_unquantized"] = float(np.abs(ours - plain).max())
            out[cache][f"{prefix}error_vs_cached"] = float(np.abs(ours - held).max())
            out[cache]["k_scale"], out[cache]["v_scale"] = scales
            steps[cache if name == "torch" else f"{cache} {name}"] = step  # timed on from position ctx
    medians = rounds(steps, repeats)
    for cache in FP8_CACHES:
        itemsize = 1 if "fp8" in cache else 2
        for name in backends:
            prefix, key = ("", cache) if name == "torch" else (f"{name}_", f"{cache} {name}")
            bf16 = "bfloat16" if name == "torch" else f"bfloat16 {name}"
            out[cache][f"{prefix}step_s"] = medians[key]
            out[cache][f"{prefix}kv_gbps"] = 2 * b * ctx * hkv * d * itemsize / medians[key] / 1e9
            out[cache][f"{prefix}time_vs_bf16"] = medians[key] / medians[bf16]
        if "native" in backends:
            out[cache]["native_vs_torch"] = medians[f"{cache} native"] / medians[cache]
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
    native = result["native"]["available"]
    lines = [
        f"chunkattn engine benchmark, {result['date']}, {result['machine']}",
        "ours: the torch backend; native: the native backend, in the same rounds (nat/torch: native / torch)"
        if native
        else f"ours: the torch backend; the native backend is unavailable here: {result['native']['reason']}",
        "",
        f"prefill (one sequence, C = {shapes['prefill_chunk']}, {shapes['prefill_tokens']} tokens)",
        f"{'dtype':<9} {'ours':>8} {'in pieces':>10} {'SDPA/chunk':>11} {'ours/ideal':>15}"
        f" {'full causal':>12} {'full/ours':>14} {'flex':>8} {'flex/ours':>14}"
        + (f" {'native':>8} {'nat/torch':>9} {'in pieces':>10} {'nat/torch':>9}" if native else ""),
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
            + (
                f" {p['native_s']:>7.3f}s {p['native_vs_torch']:>8.2f}x {p['native_pieces_s']:>9.3f}s"
                f" {p['native_pieces_vs_torch']:>8.2f}x"
                if native
                else ""
            )
        )
    lines += [
        "",
        f"decode ({shapes['decode_seqs']} sequences x 1 token, {shapes['decode_context']} tokens of context)",
        f"{'dtype':<9} {'ours':>8} {'contiguous':>11} {'ours/contig':>15} {'KV GB/s':>8} {'copy GB/s':>10}"
        f" {'KV/copy':>8} {'scattered':>10}"
        + (f" {'native':>8} {'nat/torch':>9} {'KV GB/s':>8} {'scattered':>10} {'nat/torch':>9}" if native else ""),
    ]
    for dtype, d in result["decode"].items():
        ratio = d["ours_s"] / d["sdpa_contiguous_s"]
        lines.append(
            f"{dtype:<9} {d['ours_s'] * 1e3:>6.1f}ms {d['sdpa_contiguous_s'] * 1e3:>9.1f}ms {ratio:>8.3f}"
            f" {_verdict(ratio <= 1.2):>6} {d['kv_gbps']:>8.1f} {d['copy_gbps']:>10.1f}"
            f" {d['kv_gbps'] / d['copy_gbps']:>7.0%} {d['ours_scattered_s'] / d['sdpa_contiguous_s']:>9.2f}x"
            + (
                f" {d['native_s'] * 1e3:>6.1f}ms {d['native_vs_torch']:>8.2f}x {d['native_kv_gbps']:>8.1f}"
                f" {d['native_scattered_s'] * 1e3:>8.1f}ms {d['native_scattered_vs_torch']:>8.2f}x"
                if native
                else ""
            )
        )
    if result.get("fp8"):
        lines += [
            "",
            "fp8 KV cache: the decode above (allocator's layout), computing in bfloat16, same K/V",
            f"{'cache':<9} {'step':>8} {'vs bf16':>8} {'KV GB/s':>8} {'err vs fp64':>12} {'vs fp64 (held)':>15}"
            f" {'k/v scale':>18}"
            + (f" {'native':>8} {'vs bf16':>8} {'nat/torch':>9} {'vs fp64 (held)':>15}" if native else ""),
        ]
        for cache, f in result["fp8"].items():
            lines.append(
                f"{cache:<9} {f['step_s'] * 1e3:>6.1f}ms {f['time_vs_bf16']:>7.2f}x {f['kv_gbps']:>8.1f}"
                f" {f['error_vs_unquantized']:>12.2e} {f['error_vs_cached']:>15.2e}"
                f" {f['k_scale']:>8.4f}/{f['v_scale']:<8.4f}"
                + (
                    f" {f['native_step_s'] * 1e3:>6.1f}ms {f['native_time_vs_bf16']:>7.2f}x"
                    f" {f['native_vs_torch']:>8.2f}x {f['native_error_vs_cached']:>15.2e}"
                    if native
                    else ""
                )
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
    backends, unavailable = contenders.backends()
    if unavailable:
        print(f"native backend unavailable, timing torch only: {unavailable}", flush=True)
    result: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads,"
        f" torch {torch.__version__}",
        "shapes": asdict(shapes),
        "native": {"available": unavailable is None, "reason": unavailable},
        "prefill": {dt: bench_prefill(dt, shapes, args.repeats, not args.no_flex, backends) for dt in dtypes},
        "decode": {dt: bench_decode(dt, shapes, args.repeats, backends) for dt in dtypes},
        "fp8": None if args.no_fp8 else bench_fp8(shapes, args.repeats, backends),
        "memory": bench_memory(shapes),
    }
    result["duration_s"] = time.perf_counter() - started
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
