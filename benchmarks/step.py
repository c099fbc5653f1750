"""One decode call's engine step, in-process: the per-call path (checks, reservation, K/V write, the kernel's
metadata, attention, commit), not attention over long contexts.

B sequences (1, 8, 32 by default) of the small Llama 4 layer of vllm_offload.py (8 query / 2 KV heads of 128,
C = 128, blocks of 16, float32) each get one new token per call, as a model runner's decode step sends them;
they start with ``--context`` tokens and run on across chunk boundaries (retention keeps their blocks
bounded). Contenders, in the same rounds:

- ``torch``: the engine on the torch backend;
- ``native``: the native backend, the fused path (K/V write, metadata and every decode in one native call);
- ``native_unfused``: the native backend with the fused path off (``NativeBackend(fused=False)``: the K/V
  written by torch, the kernel's metadata in numpy), the path before #37.

Per contender the median time of one ``Engine.attend`` call over rounds of ``--calls`` calls. ``--profile``
prints where one contender's time goes (cProfile of single-sequence calls).

    python benchmarks/step.py [--json PATH] [--batches 1,8,32] [--calls N] [--repeats N] [--profile NAME]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import os
import pstats
import sys
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import torch

from chunkattn_client import BatchEntry
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.attention.backends import Backend, TorchBackend
from chunkattn_server.attention.backends.native.backend import NativeBackend
from chunkattn_server.attention.backends.native.build import NativeUnavailable

from timing import cpu_name, publish, rounds  # benchmarks/timing.py

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_SIZE, CHUNK, BLOCK = 8, 2, 128, 128, 16


def _backend(name: str) -> Backend:
    if name == "torch":
        return TorchBackend(CPU)
    if name == "native_unfused":
        if "fused" not in inspect.signature(NativeBackend).parameters:  # the code before #37: one native path
            return NativeBackend(CPU)
        return NativeBackend(CPU, fused=False)  # type: ignore[call-arg,unused-ignore]
    return NativeBackend(CPU)


class Stepper:
    """B sequences, one decode each per call, their positions advancing."""

    def __init__(self, backend: str, batch: int, context: int, dtype: str) -> None:
        model = ModelShape(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, layers=(LayerSpec(CHUNK),))
        blocks = batch * (CHUNK // BLOCK + 4) + 8
        cache = CacheConfig(block_size=BLOCK, num_blocks=blocks)
        self.engine = Engine(EngineConfig(model, cache, device="cpu", dtype=dtype), backend=_backend(backend))
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(batch, HEADS, HEAD_SIZE, generator=g).to(dt)
        self.k = torch.randn(batch, KV_HEADS, HEAD_SIZE, generator=g).to(dt)
        self.v = torch.randn(batch, KV_HEADS, HEAD_SIZE, generator=g).to(dt)
        self.batch = batch
        kc = torch.randn(context, KV_HEADS, HEAD_SIZE, generator=g).to(dt)
        qc = torch.randn(context, HEADS, HEAD_SIZE, generator=g).to(dt)
        for i in range(batch):
            self.engine.attend(0, [BatchEntry(f"s{i}", 0, context)], qc, kc, kc, tenant="")
        self.position = context

    def __call__(self) -> torch.Tensor:
        entries = [BatchEntry(f"s{i}", self.position, 1) for i in range(self.batch)]
        self.position += 1
        return self.engine.attend(0, entries, self.q, self.k, self.v, tenant="")


def _loop(step: Stepper, calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            step()

    return run


def bench(
    batches: list[int], contenders: list[str], calls: int, repeats: int, context: int, dtype: str
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for b in batches:
        steps = {name: Stepper(name, b, context, dtype) for name in contenders}
        first = {name: s() for name, s in steps.items()}  # the same state in each: the answers must agree
        for name, got in first.items():
            err = (got.float() - first[contenders[0]].float()).abs().max().item()
            if err > (1e-4 if dtype == "float32" else 3e-2):
                raise SystemExit(f"batch {b}: {name} differs from {contenders[0]} by {err}")
        medians = rounds({n: _loop(s, calls) for n, s in steps.items()}, repeats)
        row = {f"{n}_us": t / calls * 1e6 for n, t in medians.items()}
        for n in contenders:
            if n != contenders[0]:
                row[f"{n}_vs_{contenders[0]}"] = medians[n] / medians[contenders[0]]
        out[str(b)] = row
    return out


def profile(name: str, calls: int, context: int, dtype: str, top: int = 25) -> str:
    step = Stepper(name, 1, context, dtype)
    for _ in range(200):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def report(result: dict[str, Any]) -> str:
    contenders = result["contenders"]
    lines = [
        f"chunkattn engine step benchmark, {result['date']}, {result['machine']}",
        f"one Engine.attend call of B decodes (8/2 heads of 128, C = 128, {result['dtype']}), us per call (median)",
        f"{'B':>4} " + " ".join(f"{n:>15}" for n in contenders) + "  ratios to " + contenders[0],
    ]
    for b, row in result["steps"].items():
        ratios = ", ".join(f"{n} {row[f'{n}_vs_{contenders[0]}']:.2f}x" for n in contenders[1:])
        lines.append(f"{b:>4} " + " ".join(f"{row[f'{n}_us']:>15.1f}" for n in contenders) + f"  {ratios}")
    if result.get("profile"):
        lines += ["", result["profile"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the medians as JSON")
    parser.add_argument("--batches", default="1,8,32", help="decodes per call, comma-separated (default 1,8,32)")
    parser.add_argument("--calls", type=int, default=300, help="calls per timed round (default 300)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per contender (default 7)")
    parser.add_argument("--context", type=int, default=64, help="tokens each sequence starts with (default 64)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--contenders", default="torch,native_unfused,native", help="comma-separated")
    parser.add_argument("--profile", metavar="NAME", help="also profile B = 1 calls of this contender")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small steps run on one torch thread in the server (engine/inline.py)
    contenders = args.contenders.split(",")
    try:
        NativeBackend(CPU)
    except NativeUnavailable as e:
        print(f"native backend unavailable, timing torch only: {e}", flush=True)
        contenders = ["torch"]
    started = time.perf_counter()
    with torch.no_grad():
        result: dict[str, Any] = {
            "date": date.today().isoformat(),
            "machine": f"{cpu_name()}, {os.cpu_count()} cores, 1 torch thread, torch {torch.__version__}",
            "dtype": args.dtype,
            "contenders": contenders,
            "steps": bench(
                [int(b) for b in args.batches.split(",")],
                contenders,
                args.calls,
                args.repeats,
                args.context,
                args.dtype,
            ),
        }
        if args.profile:
            result["profile"] = profile(args.profile, 3000, args.context, args.dtype)
    result["duration_s"] = time.perf_counter() - started
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
