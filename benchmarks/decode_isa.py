"""The native decode kernel's two paths in the build this CPU loads, side by side in one run: the vector units
(AVX-512 FMAs in float32, every page type converted in registers) and, in the AMX build, the AMX tiles (a
bfloat16 compute over bfloat16 and float8 pages). Per page type and query heads per KV head, each path's time in
the same rounds, their ratio, the bytes of K/V read per second, and the path the kernel takes by default (the
tiles from ``amx_min_heads`` query heads per KV head): the measurements behind that threshold.

Shape (benchmarks/vllm_kernel.py's decode): 32 decodes, each over 4,096 keys in one chunk, 8 KV heads of 128,
blocks of 32 as a fresh pool gives them (each sequence's blocks consecutive); 4, 8 and 16 query heads per KV head.
The call is the fused entry the engine uses (``store_and_decode``, nothing to store). Outputs of the two paths
are compared (max |tiles - vector|).

    PYTHONPATH=server .venv/bin/python benchmarks/decode_isa.py [--json PATH] [--repeats N] [--smoke]
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

from chunkattn_server.attention.backends.native.build import NativeUnavailable, isa, load

from timing import cpu_name, publish, rounds  # benchmarks/timing.py

PAGES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Shapes:
    seqs: int = 32
    keys: int = 4096
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 32
    groups: tuple[int, ...] = (4, 8, 16)


SMOKE = Shapes(seqs=2, keys=96, kv_heads=2, head_size=64, block_size=16, groups=(4, 16))


def bench(kernel: Any, shapes: Shapes, page: str, group: int, repeats: int) -> dict[str, Any]:
    """One row: the vector units (and the tiles, where the build has them) over the same pages and queries."""
    s = shapes
    dtype = PAGES[page]
    compute = torch.float32 if dtype == torch.float32 else torch.bfloat16
    blocks = s.seqs * s.keys // s.block_size
    gen = torch.Generator().manual_seed(0)
    k_pages = (torch.randn(s.kv_heads, blocks, s.block_size, s.head_size, generator=gen) * 0.5).to(dtype)
    v_pages = (torch.randn(s.kv_heads, blocks, s.block_size, s.head_size, generator=gen) * 0.5).to(dtype)
    per_seq = s.keys // s.block_size
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int64) for i in range(s.seqs)]
    spans = [(i, s.keys - 1, 1) for i in range(s.seqs)]
    heads = group * s.kv_heads
    q = torch.randn(s.seqs, heads, s.head_size, generator=gen).to(compute)
    outs = {path: torch.empty(s.seqs, heads, s.head_size, dtype=compute) for path in ("vector", "tiles")}
    scale = s.head_size**-0.5

    def run(path: str) -> Callable[[], None]:
        def call() -> None:
            kernel.use_tiles("always" if path == "tiles" else "never")
            kernel.store_and_decode(
                q, None, None, None, k_pages, v_pages, spans, tables, None, [], 0, outs[path], scale, 1.0, 1.0, None
            )

        return call

    takes = kernel.amx and compute == torch.bfloat16 and group >= kernel.amx_min_heads[str(dtype)[6:]]
    contenders = {"vector": run("vector")}
    if kernel.amx and compute == torch.bfloat16:
        contenders["tiles"] = run("tiles")
    try:
        times = rounds(contenders, repeats)
    finally:
        kernel.use_tiles("auto")
    read = 2 * k_pages.numel() * k_pages.element_size()
    row: dict[str, Any] = {
        "page": page,
        "heads_per_kv": group,
        "default": "tiles" if takes else "vector",
        "vector_s": times["vector"],
        "tiles_s": times.get("tiles"),
        "vector_gbps": read / times["vector"] / 1e9,
        "tiles_gbps": read / times["tiles"] / 1e9 if "tiles" in times else None,
        "tiles_vs_vector": times["tiles"] / times["vector"] if "tiles" in times else None,
        "max_diff": (outs["tiles"].float() - outs["vector"].float()).abs().max().item() if "tiles" in times else None,
    }
    return row


def report(result: dict[str, Any]) -> str:
    lines = [
        f"The native decode's paths, {result['date']}, {result['machine']}",
        f"build {result['build']} (AMX tiles {'on' if result['amx'] else 'off: ' + result['why_no_tiles']});"
        f" medians, {result['shapes']['seqs']} decodes x {result['shapes']['keys']:,} keys,"
        f" {result['shapes']['kv_heads']} KV heads of {result['shapes']['head_size']}",
        "",
        f"{'page':<9} {'heads/KV':>8} {'vector':>9} {'tiles':>9} {'tiles/vec':>9} {'vec GB/s':>8} {'tile GB/s':>9}"
        f" {'default':<7} max |tiles - vector|",
    ]
    for r in result["rows"]:
        tiles = f"{r['tiles_s'] * 1e3:>7.1f}ms" if r["tiles_s"] else f"{'-':>9}"
        ratio = f"{r['tiles_vs_vector']:>8.2f}x" if r["tiles_vs_vector"] else f"{'-':>9}"
        gbps = f"{r['tiles_gbps']:>9.1f}" if r["tiles_gbps"] else f"{'-':>9}"
        diff = f"{r['max_diff']:.1e}" if r["max_diff"] is not None else "-"
        lines.append(
            f"{r['page']:<9} {r['heads_per_kv']:>8} {r['vector_s'] * 1e3:>7.1f}ms {tiles} {ratio}"
            f" {r['vector_gbps']:>8.1f} {gbps} {r['default']:<7} {diff}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per path (default 7)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the code paths in seconds")
    args = parser.parse_args(argv)
    shapes = SMOKE if args.smoke else Shapes()
    started = time.perf_counter()
    try:
        kernel = load()
    except NativeUnavailable as e:
        print(f"the native kernels are unavailable here: {e}")
        return 1
    why = "" if kernel.amx else f"this CPU loads the {isa()} build" if isa() != "AMX" else "Linux refused the tiles"
    rows = [bench(kernel, shapes, page, group, args.repeats) for page in PAGES for group in shapes.groups]
    result: dict[str, Any] = {
        "benchmark": "decode_isa",
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads,"
        f" torch {torch.__version__}",
        "build": isa(),
        "amx": bool(kernel.amx),
        "why_no_tiles": why,
        "amx_min_heads": dict(kernel.amx_min_heads),
        "shapes": asdict(shapes),
        "rows": rows,
        "duration_s": time.perf_counter() - started,
    }
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
