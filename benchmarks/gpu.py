"""The triton backend on one CUDA device: correctness first, then timings, then one table. Under 5 minutes
on an H200.

1. check: the triton backend, through ``Engine.attend``, against the client's float64 reference at several
   shapes: Llama-4-Scout's heads (40 query / 8 KV, head size 128) in bf16, fp16 and fp32; head sizes 64,
   80, 96 and 256; ALiBi; a global layer. Each prefills across chunk boundaries, then decodes past one.
2. prefill: one 32,768-token sequence, C = 8192, Scout's heads, bf16: the triton backend, the torch
   backend, FlexAttention compiled with the chunked block mask, and SDPA per chunk on contiguous tensors
   (the ideal). TFLOP/s count the chunked work only (4 * D per visible query-key pair and head).
   Target: triton >= 1.2x faster than FlexAttention.
3. decode: 64 sequences x 8,192 keys of context (each at the last position of its chunk), Scout's heads,
   bf16, blocks of 16 scattered over the pool: the triton kernels (metadata prepared once, as a graph
   replay has it; the host-side prepare is timed apart), the same step replayed from a CUDA graph, the
   torch backend, and SDPA over a contiguous cache. KV GB/s (K and V bytes read) against the device's copy
   bandwidth measured in this run (read + write). Target: triton >= 80% of copy. The same pages stored as a
   float8 e4m3 cache (scales amax / 448, as vLLM calibrates them) are checked against SDPA in float32 on
   their dequantized values, then timed beside the bf16 cache (``triton_fp8_e4m3``: half the KV bytes).
   Skipped before sm_89 (no e4m3 in Triton there).
4. the CUDA graph's replay against the eager result.

    python benchmarks/gpu.py [--json PATH] [--repeats N] [--dry-run]

--dry-run runs the same code at tiny shapes on the CPU under TRITON_INTERPRET=1 (fp16 and fp32 only, as
the interpreter's bf16 math is wrong; FlexAttention eager instead of compiled; no CUDA graph), so that
tests/benchmarks/test_gpu_benchmark.py keeps this script from rotting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from typing import Any

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from chunkattn_client import BatchEntry, ReferenceModel
from chunkattn_client.reference import within_tolerance
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape, torchtypes
from chunkattn_server.attention.backends import AttentionBatch, TorchBackend
from chunkattn_server.attention.backends.triton_backend import TritonBackend

from baselines import copy_bandwidth, flex_chunked  # benchmarks/baselines.py
from timing import cpu_name, rounds  # benchmarks/timing.py

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8 = torch.float8_e4m3fn  # the float8 cache of the decode benchmark
FP8_MAX = torchtypes.OF_TORCH[FP8].max  # 448


@dataclass(frozen=True)
class Shapes:
    heads: tuple[int, int] = (40, 8)  # Llama-4-Scout
    head_size: int = 128
    block_size: int = 16
    check_chunk: int = 256
    check_prompt: int = 700  # crosses two boundaries of check_chunk
    check_decodes: int = 70  # crosses the next one
    check_head_sizes: tuple[int, ...] = (64, 80, 96, 256)
    prefill_tokens: int = 32_768
    prefill_chunk: int = 8192
    decode_seqs: int = 64
    decode_context: int = 8192
    copy_bytes: int = 2 << 30
    dtype: str = "bfloat16"  # of the timings; the checks run all three where the math is right
    check_dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")


DRY = Shapes(
    heads=(4, 2), head_size=16, block_size=4, check_chunk=8, check_prompt=19, check_decodes=6,
    check_head_sizes=(64,), prefill_tokens=48, prefill_chunk=16, decode_seqs=3, decode_context=16,
    copy_bytes=1 << 20, dtype="float16", check_dtypes=("float16", "float32"),  # the interpreter's bf16 is wrong
)  # fmt: skip


class Device:
    """Where the run happens, and how to wait for it."""

    def __init__(self, dry_run: bool) -> None:
        if not dry_run and not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu.py needs a CUDA device (or --dry-run on the CPU)")
        self.dev = torch.device("cpu" if dry_run else "cuda")
        self.cuda = self.dev.type == "cuda"
        self.name = torch.cuda.get_device_name(self.dev) if self.cuda else f"{cpu_name()} (dry run: interpreter)"

    def has_e4m3(self) -> bool:
        """Whether the triton kernels can read an e4m3 cache here (Triton's fp8e4nv needs sm_89+)."""
        return not self.cuda or torch.cuda.get_device_capability(self.dev) >= (8, 9)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def timed(self, fns: dict[str, Callable[[], object]], repeats: int, inner: int = 10) -> dict[str, float]:
        """Median seconds per call of each, in interleaved rounds. On CUDA a sample is ``inner`` back-to-back
        calls between two events (so launch latency overlaps, as in a model's forward pass); on the CPU one
        call."""
        if not self.cuda:
            return rounds(fns, repeats)

        def events(fn: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                samples[fn].append(start.elapsed_time(end) / 1000 / inner)

            return run

        samples: dict[Callable[[], object], list[float]] = {fn: [] for fn in fns.values()}
        rounds({name: events(fn) for name, fn in fns.items()}, repeats)
        return {name: statistics.median(samples[fn][1:] or samples[fn]) for name, fn in fns.items()}


# -- 1. correctness --------------------------------------------------------------------------------------


def check(dev: Device, s: Shapes) -> list[dict[str, Any]]:
    """The triton backend against the float64 reference; raises on the first mismatch."""
    c = s.check_chunk
    cases: list[tuple[str, ModelShape, str]] = []
    scout = (LayerSpec(c), LayerSpec(0))
    for dtype in s.check_dtypes:
        cases.append((f"scout heads, {dtype}", ModelShape(s.heads[0], s.heads[1], s.head_size, scout), dtype))
    for d in s.check_head_sizes:
        cases.append((f"head size {d}, GQA 4", ModelShape(8, 2, d, scout), s.check_dtypes[0]))
    slopes = tuple(2.0 ** -(i + 1) for i in range(8))
    alibi = (LayerSpec(c, alibi_slopes=slopes), LayerSpec(0, alibi_slopes=slopes))
    cases.append(("ALiBi, chunked and global", ModelShape(8, 2, s.head_size, alibi), "float16"))
    results = []
    for name, model, dtype in cases:
        worst = _check_one(dev, s, model, dtype)
        results.append({"case": name, "dtype": dtype, "max_error": worst})
        print(f"check  {name:<28} {dtype:<9} max error {worst:.2e}  ok", flush=True)
    return results


def _check_one(dev: Device, s: Shapes, model: ModelShape, dtype: str) -> float:
    config = EngineConfig(
        model, CacheConfig(block_size=s.block_size, num_blocks=4096, dtype=dtype), device=dev.dev.type
    )
    engine = Engine(config, backend=TritonBackend(dev.dev))
    ref = ReferenceModel(
        [x.chunk_size for x in model.layers], alibi_slopes=[x.alibi_slopes for x in model.layers]
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    worst = 0.0

    def call(layer: int, entries: list[BatchEntry]) -> None:
        nonlocal worst
        t = sum(e.num_tokens for e in entries)
        dt = DTYPES[dtype]
        q = torch.randn(t, model.num_heads, model.head_size, generator=g).to(dt)
        k = torch.randn(t, model.num_kv_heads, model.head_size, generator=g).to(dt)
        v = torch.randn(t, model.num_kv_heads, model.head_size, generator=g).to(dt)
        out = engine.attend(layer, entries, q.to(dev.dev), k.to(dev.dev), v.to(dev.dev), tenant="")
        want = ref.attend(layer, entries, *(x.double().numpy() for x in (q, k, v)))
        ok, err = within_tolerance(out.double().cpu().numpy(), want, dtype)
        worst = max(worst, err)
        if not ok:
            raise SystemExit(f"MISMATCH: layer {layer}, {entries}: error {err:.3g} over the {dtype} tolerance")

    p = s.check_prompt
    for layer in range(model.num_layers):
        call(layer, [BatchEntry("a", 0, p), BatchEntry("b", 0, 3)])
        for i in range(s.check_decodes):
            call(layer, [BatchEntry("a", p + i, 1), BatchEntry("b", 3 + i, 1)])
        call(layer, [BatchEntry("a", p + s.check_decodes, 5), BatchEntry("c", 0, 1)])
    return worst


# -- 2. prefill -------------------------------------------------------------------------------------------


def bench_prefill(dev: Device, s: Shapes, repeats: int) -> dict[str, Any]:
    n, c, (h, hkv), d = s.prefill_tokens, s.prefill_chunk, s.heads, s.head_size
    dt = DTYPES[s.dtype]
    g = torch.Generator(device=dev.dev).manual_seed(1)
    q = torch.randn(n, h, d, generator=g, device=dev.dev).to(dt)
    k = torch.randn(n, hkv, d, generator=g, device=dev.dev).to(dt)
    v = torch.randn(n, hkv, d, generator=g, device=dev.dev).to(dt)
    pages = torch.zeros(hkv, 1, s.block_size, d, dtype=dt, device=dev.dev)  # a new sequence: no cache yet
    batch = AttentionBatch(q, k, v, pages, pages, [(0, 0, n)], [{}], c, s.block_size, d**-0.5, None)
    out = torch.empty_like(q)
    triton_backend, torch_backend = TritonBackend(dev.dev), TorchBackend(dev.dev)
    # [chunks, heads, C, D] views for the per-chunk SDPA and [1, heads, n, D] for FlexAttention.
    qc, kc, vc = (x.view(n // c, c, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    qf, kf, vf = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    flex = flex_chunked(qf, kf, vf, c, compiled=dev.cuda)
    fns: dict[str, Callable[[], object]] = {
        "triton": lambda: triton_backend.attend(batch, out),
        "torch": lambda: torch_backend.attend(batch, out),
        "flex": flex,
        "sdpa_per_chunk": lambda: sdpa(qc, kc, vc, is_causal=True, enable_gqa=True),
    }
    times = dev.timed(fns, repeats)
    flops = 4 * d * h * (n // c) * c * (c + 1) / 2
    return {
        "shape": f"{n} tokens, C = {c}, {h}/{hkv} heads of {d}, {s.dtype}",
        "seconds": times,
        "tflops": {name: flops / t / 1e12 for name, t in times.items()},
        "flex_over_triton": times["flex"] / times["triton"],
    }


# -- 3. decode, 4. the CUDA graph -------------------------------------------------------------------------


def bench_decode(dev: Device, s: Shapes, repeats: int) -> dict[str, Any]:
    b, ctx, (h, hkv), d, bs = s.decode_seqs, s.decode_context, s.heads, s.head_size, s.block_size
    dt = DTYPES[s.dtype]
    per_seq = ctx // bs
    num_blocks = b * per_seq + 7
    g = torch.Generator(device=dev.dev).manual_seed(2)
    k_pages = torch.randn(hkv, num_blocks, bs, d, generator=g, device=dev.dev).to(dt)
    v_pages = torch.randn(hkv, num_blocks, bs, d, generator=g, device=dev.dev).to(dt)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()  # scattered blocks
    tables = [{i: order[j * per_seq + i] for i in range(per_seq)} for j in range(b)]
    pos = ctx - 1  # the last position of the first chunk: every query sees ctx keys
    q = torch.randn(b, h, d, generator=g, device=dev.dev).to(dt)
    # The new token's own key, as the engine passes it (also written into the cache: its last slot).
    last = torch.tensor([t[pos // bs] * bs + pos % bs for t in tables], device=dev.dev)
    k_new = k_pages.flatten(1, 2)[:, last].transpose(0, 1).contiguous()
    v_new = v_pages.flatten(1, 2)[:, last].transpose(0, 1).contiguous()
    spans = [(j, pos, 1) for j in range(b)]
    batch = AttentionBatch(q, k_new, v_new, k_pages, v_pages, spans, tables, ctx, bs, d**-0.5, None)
    out = torch.empty_like(q)
    triton_backend, torch_backend = TritonBackend(dev.dev), TorchBackend(dev.dev)
    launch = triton_backend.prepare(batch, out)
    triton_backend.run(launch)
    dev.sync()
    eager = out.clone()

    # The ideal: SDPA over a contiguous copy of the same keys, query heads grouped per KV head.
    index = torch.tensor([[t[i] for i in range(per_seq)] for t in tables], device=dev.dev)
    k_flat = k_pages[:, index].permute(1, 0, 2, 3, 4).reshape(b, hkv, ctx, d).contiguous()
    v_flat = v_pages[:, index].permute(1, 0, 2, 3, 4).reshape(b, hkv, ctx, d).contiguous()
    q_grouped = q.view(b, hkv, h // hkv, d)
    ideal = sdpa(q_grouped, k_flat, v_flat).reshape(b, h, d)
    ok, err = within_tolerance(eager.double().cpu().numpy(), ideal.double().cpu().numpy(), s.dtype)
    if not ok:
        raise SystemExit(f"MISMATCH: decode against SDPA on a contiguous cache: error {err:.3g}")

    fns: dict[str, Callable[[], object]] = {
        "triton": lambda: triton_backend.run(launch),
        "triton_prepare_and_run": lambda: triton_backend.attend(batch, out),
        "torch": lambda: torch_backend.attend(batch, out),
        "sdpa_contiguous": lambda: sdpa(q_grouped, k_flat, v_flat),
    }
    fp8: dict[str, Any] | None = None
    if dev.has_e4m3():
        fp8, run_fp8 = _fp8_decode(dev, s, triton_backend, batch, k_pages, v_pages, index, last)
        fns["triton_fp8_e4m3"] = run_fp8
    graph: dict[str, Any] = {"captured": False, "matches_eager": None}
    if dev.cuda:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            triton_backend.run(launch)
        out.zero_()
        cuda_graph.replay()
        dev.sync()
        graph = {"captured": True, "matches_eager": bool(torch.equal(out, eager))}
        if not graph["matches_eager"]:
            raise SystemExit("MISMATCH: the CUDA graph's replay differs from the eager result")
        fns["triton_graph"] = cuda_graph.replay
    times = dev.timed(fns, repeats)
    kv_bytes = 2 * b * hkv * ctx * d * dt.itemsize
    fp8_bytes = 2 * b * hkv * ctx * d * FP8.itemsize
    if fp8 is not None:
        fp8["speedup"] = times["triton"] / times["triton_fp8_e4m3"]  # over the compute-dtype cache
    copy = copy_bandwidth(s.copy_bytes, dev.dev, lambda fns: dev.timed(fns, 10))
    return {
        "shape": f"{b} sequences x {ctx} keys, {h}/{hkv} heads of {d}, {s.dtype}, blocks of {bs} scattered",
        "seconds": times,
        "kv_gbps": {name: (fp8_bytes if "fp8" in name else kv_bytes) / t / 1e9 for name, t in times.items()},
        "copy_gbps": copy,
        "triton_of_copy": kv_bytes / times["triton"] / 1e9 / copy,
        "max_error_vs_sdpa": err,
        "graph": graph,
        "fp8_e4m3": fp8,
    }


def _fp8_decode(
    dev: Device,
    s: Shapes,
    backend: TritonBackend,
    batch: AttentionBatch,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    index: torch.Tensor,
    last: torch.Tensor,
) -> tuple[dict[str, Any], Callable[[], object]]:
    """The decode step over the same pages [Hkv, num_blocks, bs, D] stored as an e4m3 cache: checked against
    SDPA in float32 on the dequantized contiguous cache (index [B, blocks per sequence] gathers it, last [B]
    are the new tokens' slots); returns the check's numbers and the prepared launch to time."""
    b, ctx, (h, hkv), d = s.decode_seqs, s.decode_context, s.heads, s.head_size
    dt = DTYPES[s.dtype]
    k_scale = float(k_pages.abs().amax()) / FP8_MAX
    v_scale = float(v_pages.abs().amax()) / FP8_MAX
    k8, v8 = torchtypes.store(k_pages, k_scale, FP8), torchtypes.store(v_pages, v_scale, FP8)

    def rows(pages: torch.Tensor, scale: float) -> torch.Tensor:
        """The new tokens' own keys/values [B, Hkv, D], read back in the compute dtype, as the engine passes them
        (float8 gathered as bytes: not every device indexes float8)."""
        stored = pages.view(torch.uint8).flatten(1, 2)[:, last].transpose(0, 1).contiguous().view(FP8)
        return torchtypes.load(stored, scale, dt)

    batch8 = AttentionBatch(
        batch.q, rows(k8, k_scale), rows(v8, v_scale), k8, v8, batch.spans, batch.tables, batch.chunk_size,
        batch.block_size, batch.scale, None, k_scale, v_scale,
    )  # fmt: skip
    out8 = torch.empty_like(batch.q)
    launch8 = backend.prepare(batch8, out8)
    backend.run(launch8)
    dev.sync()

    def dequantized(pages: torch.Tensor, scale: float) -> torch.Tensor:
        flat = pages.view(torch.uint8)[:, index].permute(1, 0, 2, 3, 4).reshape(b, hkv, ctx, d).view(FP8)
        return torchtypes.load(flat, scale, torch.float32)

    q32 = batch.q.float().view(b, hkv, h // hkv, d)
    ideal = sdpa(q32, dequantized(k8, k_scale), dequantized(v8, v_scale)).reshape(b, h, d)
    ok, err = within_tolerance(out8.double().cpu().numpy(), ideal.double().cpu().numpy(), s.dtype)
    if not ok:
        raise SystemExit(f"MISMATCH: e4m3 decode against SDPA on its dequantized cache: error {err:.3g}")
    del ideal, q32
    info = {"k_scale": k_scale, "v_scale": v_scale, "max_error_vs_dequantized": err}
    return info, lambda: backend.run(launch8)


# -- the table ------------------------------------------------------------------------------------------------


def report(r: dict[str, Any]) -> str:
    p, dcd = r["prefill"], r["decode"]
    flex_ratio = p["flex_over_triton"]
    of_copy = dcd["triton_of_copy"]

    def verdict(ok: bool) -> str:
        return "not measured: a dry run" if r["dry_run"] else "met" if ok else "MISSED"

    lines = [
        f"device: {r['device']}; {r['date']}; torch {r['torch']}",
        f"checks: {len(r['checks'])} shapes against the float64 reference, all within tolerance",
        "",
        f"prefill ({p['shape']})",
        *(f"  {name:<16} {1000 * t:9.2f} ms {p['tflops'][name]:7.1f} TFLOP/s" for name, t in p["seconds"].items()),
        f"  flex / triton: {flex_ratio:.2f}x (target >= 1.2x: {verdict(flex_ratio >= 1.2)})",
        "",
        f"decode ({dcd['shape']})",
        *(f"  {name:<24} {1000 * t:9.3f} ms {dcd['kv_gbps'][name]:8.0f} GB/s" for name, t in dcd["seconds"].items()),
        f"  copy bandwidth {dcd['copy_gbps']:.0f} GB/s; triton (kernels, metadata prepared) {100 * of_copy:.0f}% of it"
        f" (target >= 80%: {verdict(of_copy >= 0.8)})",
        f"  CUDA graph: captured {dcd['graph']['captured']}, replay matches eager: {dcd['graph']['matches_eager']}",
    ]
    fp8 = dcd["fp8_e4m3"]
    if fp8 is None:
        lines.append("  float8 e4m3 cache: not run (Triton reads e4m3 from sm_89 on)")
    else:
        lines.append(
            f"  float8 e4m3 cache (k_scale {fp8['k_scale']:.3g}, v_scale {fp8['v_scale']:.3g}): max error"
            f" {fp8['max_error_vs_dequantized']:.2e} against its dequantized values; {fp8['speedup']:.2f}x as fast"
            f" as the {r['shapes']['dtype']} cache"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under the interpreter")
    args = parser.parse_args(argv)
    if args.dry_run:  # before the kernels are first imported (triton_backend imports them on first use)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = Device(args.dry_run)
    shapes = DRY if args.dry_run else Shapes()
    repeats = 1 if args.dry_run else args.repeats
    start = time.perf_counter()
    result: dict[str, Any] = {
        "device": dev.name,
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "shapes": asdict(shapes),
        "checks": check(dev, shapes),
    }
    result["prefill"] = bench_prefill(dev, shapes, repeats)
    result["decode"] = bench_decode(dev, shapes, repeats)
    result["seconds_total"] = time.perf_counter() - start
    print()
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=_jsonable)
    return 0


def _jsonable(x: object) -> object:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x)} is not JSON-serializable")


if __name__ == "__main__":
    sys.exit(main())
