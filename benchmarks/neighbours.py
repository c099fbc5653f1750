"""What one tenant's heaviest allowed requests cost another tenant's decodes, side by side in one run.

One server (``python -m chunkattn_server``, the demo model on the CPU: 4 layers, C = 1024 with a global 4th,
8 query / 2 KV heads of 64, the default 1 GiB pool) with two tenants. Tenant "victim" decodes one token at a
time on layer 0, back to back, and every call's latency is kept. Tenant "noisy", in turn:

- quiet: sends nothing (the baseline);
- open/close: loops OpenBlockSpace of a space of the whole free pool (but the victim's few blocks) and
  CloseBlockSpace (issue 35.2: each open zeroed all of it on the engine thread); refused opens (the per-tenant
  opening rate) are counted;
- block work: loops the heaviest block call the server admits (issue 35.4): decode rows each reading a whole
  space of scattered blocks, rows x keys at Info's max_call_work, every row's slot where its table puts it;
- prefill work: loops the heaviest global-layer prefill the server admits, a fresh sequence each time.

Phases run ``--seconds`` each, round after round (``--repeats``), so drift hits them alike. Per phase: the
victim's calls, p50, p99 and worst latency, each as a ratio to quiet's; noisy's requests done and refused and
their own median time (what one such request holds the engine for).

Beside it, in this process: the heaviest calls of several shapes that the default bound admits
(EngineConfig.max_call_work = the CPU's default, chunkattn_client.work counting them), each timed on an engine
of its model (the median of ``--repeats``), so that what the bound lets one call cost is measured shape by
shape: a global prefill, written decode rows over a whole space, padding decode rows, 2-token entries (a piece
each), and a prefill of many small chunks (C = 16: a piece per chunk).

    python benchmarks/neighbours.py [--json PATH] [--repeats N] [--seconds S] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import numpy as np

from chunkattn_client import BatchEntry, BlockRows, ChunkAttnClient, ChunkAttnError
from chunkattn_client.work import entry_work

from timing import cpu_name, publish, rounds  # benchmarks/timing.py
from transport import START_TIMEOUT_S, Child  # benchmarks/transport.py

PHASES = ("quiet", "open/close", "block work", "prefill work")
TOKENS = {"victim": "neighbours-victim-token-0123456789", "noisy": "neighbours-noisy-token-0123456789"}
SMOKE_ARGS = ["--layers", "4", "--chunk-size", "16", "--global-every", "4", "--heads", "4", "--kv-heads", "2",
              "--head-size", "16", "--block-size", "4", "--num-blocks", "4096"]  # fmt: skip


def start(extra: list[str], folder: str) -> Child:
    from chunkattn_server.service.auth import token_digest

    path = os.path.join(folder, "tokens.json")
    with open(path, "w") as f:
        json.dump({"tenants": {n: {"tokens_sha256": [token_digest(t)]} for n, t in TOKENS.items()}}, f)
    os.chmod(path, 0o600)
    argv = [sys.executable, "-m", "chunkattn_server", "--host=127.0.0.1", "--port=0", "--metrics-port=0",
            "--idle-timeout-s=0", "--grace-s=2", f"--auth-tokens={path}", *extra]  # fmt: skip
    return Child("chunkattn server", argv, re.compile(r"serving chunkattn\.v1\.ChunkAttn on 127\.0\.0\.1:(\d+)"))


class Noisy:
    """Tenant noisy's loops, one per phase; each call's own seconds, and the refusals."""

    def __init__(self, client: ChunkAttnClient, rng: np.random.Generator) -> None:
        self.c = client
        self.info = client.info()
        self.rng = rng
        self.seconds: list[float] = []
        self.refused = 0
        info = self.info
        self.per_block = -(-len(info.layers) // max(1, info.planes_per_block))  # pool blocks per space block
        self.made = 0

    def qkv(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i = self.info
        return tuple(  # type: ignore[return-value]
            self.rng.standard_normal((n, h, i.head_size), np.float32)
            for h in (i.num_heads, i.num_kv_heads, i.num_kv_heads)
        )

    def _timed(self, fn: Callable[[], object]) -> None:
        started = time.perf_counter()
        try:
            fn()
        except ChunkAttnError as e:
            if e.code.name != "RESOURCE_EXHAUSTED":
                raise
            self.refused += 1
            return
        self.seconds.append(time.perf_counter() - started)

    def open_close(self) -> None:
        """A space of every free pool block but 64 (the victim's; the block work's space holds the rest), opened
        and closed."""
        free = self.c.info().free_blocks - 64

        def cycle() -> None:
            space = self.c.open_block_space(free // self.per_block)
            self.c.close_block_space(space.space_id)

        self._timed(cycle)

    def block_work(self, space_id: str, blocks: int) -> None:
        """Rows of one decode each over a whole space (its blocks in a random order), as many rows as the bound
        admits; every row's last key in its own block."""
        bs, bound = self.info.block_size, self.info.max_call_work or (1 << 22)
        keys = (blocks - 64) * bs  # the rows' last blocks are the space's last 64
        rows = max(1, min(64, bound // keys))
        order = self.rng.permutation(blocks - 64)
        table = np.tile(order, (rows, 1))
        last = np.arange(blocks - 64, blocks - 64 + rows)[:, None]
        table = np.concatenate([table, last], axis=1).astype(np.int32)
        seq_lens = np.full(rows, keys + 1)
        slots = last[:, 0] * bs
        self._timed(
            lambda: self.c.attend_blocks(
                0, BlockRows(space_id, slots, np.arange(rows + 1), seq_lens, table), *self.qkv(rows)
            )
        )

    def prefill_work(self) -> None:
        layer = next(x.index for x in self.info.layers if x.chunk_size == 0)
        bound, n = self.info.max_call_work or (1 << 22), 1
        while entry_work(0, n + 1, 0) <= bound:
            n += 1
        self.made += 1
        seq = f"p{self.made}"
        self._timed(lambda: self.c.attend(layer, [BatchEntry(seq, 0, n)], *self.qkv(n), end_of_sequence=[seq]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        child = start(SMOKE_ARGS if args.smoke else [], folder)
        try:
            target = f"127.0.0.1:{child.wait_ready(START_TIMEOUT_S)}"
            victim = ChunkAttnClient(target, token=TOKENS["victim"], timeout_s=120)
            noisy = Noisy(ChunkAttnClient(target, token=TOKENS["noisy"], timeout_s=120), rng)
            info = victim.info()
            space_blocks = min(
                info.num_blocks // noisy.per_block // 2, (info.max_call_work or (1 << 22)) // info.block_size + 64
            )
            space = noisy.c.open_block_space(space_blocks)
            q, k, v = noisy.qkv(1)
            position = [0]
            latencies: dict[str, list[float]] = {p: [] for p in PHASES}
            noisy_stats: dict[str, dict[str, Any]] = {p: {"done": 0, "refused": 0, "seconds": []} for p in PHASES}
            loops: dict[str, Callable[[], None]] = {
                "open/close": noisy.open_close,
                "block work": lambda: noisy.block_work(space.space_id, space_blocks),
                "prefill work": noisy.prefill_work,
            }
            for _ in range(args.repeats):
                for phase in PHASES:
                    stop = threading.Event()
                    noisy.seconds, noisy.refused = [], 0
                    thread = None
                    if phase in loops:
                        loop = loops[phase]

                        def hammer(loop: Callable[[], None] = loop, stop: threading.Event = stop) -> None:
                            while not stop.is_set():
                                loop()

                        thread = threading.Thread(target=hammer, daemon=True)
                        thread.start()
                    deadline = time.perf_counter() + args.seconds
                    while time.perf_counter() < deadline:
                        t0 = time.perf_counter()
                        victim.attend(0, [BatchEntry("victim", position[0], 1)], q, k, v)
                        latencies[phase].append(time.perf_counter() - t0)
                        position[0] += 1
                    stop.set()
                    if thread is not None:
                        thread.join()
                    noisy_stats[phase]["done"] += len(noisy.seconds)
                    noisy_stats[phase]["refused"] += noisy.refused
                    noisy_stats[phase]["seconds"] += noisy.seconds
            victim.close()
            noisy.c.close()
        finally:
            child.stop()
    quiet = latencies["quiet"]

    def ms(xs: list[float], q: float) -> float:
        return 1e3 * float(np.quantile(np.asarray(xs), q)) if xs else float("nan")

    phases = {}
    for p in PHASES:
        xs = latencies[p]
        phases[p] = {
            "victim_calls": len(xs),
            "victim_p50_ms": ms(xs, 0.5),
            "victim_p99_ms": ms(xs, 0.99),
            "victim_max_ms": 1e3 * max(xs, default=float("nan")),
            "p99_vs_quiet": ms(xs, 0.99) / ms(quiet, 0.99),
            "noisy_done": noisy_stats[p]["done"],
            "noisy_refused": noisy_stats[p]["refused"],
            "noisy_median_ms": ms(noisy_stats[p]["seconds"], 0.5),
        }
    return {
        "benchmark": "neighbours",
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "model": "smoke" if args.smoke else "demo",
        "max_call_work": info.max_call_work,
        "pool_blocks": info.num_blocks,
        "seconds_per_phase": args.seconds,
        "repeats": args.repeats,
        "phases": phases,
        "duration_s": time.perf_counter() - started,
    }


def heaviest(repeats: int) -> dict[str, dict[str, Any]]:
    """The heaviest call of each shape the CPU's default bound admits, timed in this process (see the module
    doc): {shape: {"work", "tokens", "rows", "seconds"}}."""
    import torch

    from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
    from chunkattn_server.config import default_call_work
    from chunkattn_server.engine.types import BlockCall

    bound = default_call_work("cpu")
    rng = torch.Generator().manual_seed(0)
    demo = ModelShape(num_heads=8, num_kv_heads=2, head_size=64, layers=(LayerSpec(1024), LayerSpec(0)))
    small = ModelShape(num_heads=4, num_kv_heads=2, head_size=16, layers=(LayerSpec(16),))

    def engine(model: ModelShape, blocks: int, block_size: int = 16) -> Engine:
        cache = CacheConfig(block_size=block_size, num_blocks=blocks)
        return Engine(EngineConfig(model, cache, device="cpu", max_call_work=bound))

    def qkv(model: ModelShape, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = (model.num_heads, model.num_kv_heads, model.num_kv_heads)
        return tuple(torch.randn(n, h, model.head_size, generator=rng) for h in heads)  # type: ignore[return-value]

    def most(fits: Callable[[int], bool]) -> int:
        n = 1
        while fits(n * 2):
            n *= 2
        step = n // 2
        while step:
            n += step if fits(n + step) else 0
            step //= 2
        return n

    shapes: dict[str, tuple[int, int, int, Callable[[], object]]] = {}
    e = engine(demo, 8192)
    n = most(lambda t: entry_work(0, t, 0) <= bound)
    made = iter(range(1 << 30))

    def prefill() -> None:
        seq = f"p{next(made)}"
        e.attend(1, [BatchEntry(seq, 0, n)], *qkv(demo, n), tenant="")
        e.kv.release([seq], tenant="")

    shapes["global prefill"] = (entry_work(0, n, 0), n, 1, prefill)
    space = e.open_space(2048, [], tenant="")
    keys = 1024 * 16  # each row reads 1,024 blocks of 16; its last block its own
    for name, padding in (("written decode rows", False), ("padding decode rows", True)):
        cost = keys  # a decode, padded or not: its keys (one kernel call for the step's decodes)
        rows = min(1000, bound // cost)
        table = np.concatenate([np.tile(np.arange(1023), (rows, 1)), 1023 + np.arange(rows)[:, None]], axis=1)
        slots = np.full(rows, -1) if padding else (1023 + np.arange(rows)) * 16 + 15
        call = BlockCall(space.space_id, *qkv(demo, rows), slots, np.arange(rows + 1), np.full(rows, keys), table, "")
        shapes[name] = (rows * cost, rows, rows, functools.partial(e.attend_blocks, 1, [call]))
    pairs = most(lambda t: t * entry_work(0, 2, 0) <= bound)

    def entries() -> None:
        names = [f"e{next(made)}" for _ in range(pairs)]
        e.attend(1, [BatchEntry(x, 0, 2) for x in names], *qkv(demo, 2 * pairs), tenant="")
        e.kv.release(names, tenant="")

    shapes["2-token entries"] = (pairs * entry_work(0, 2, 0), 2 * pairs, pairs, entries)
    s = engine(small, 4096, 4)
    chunks = most(lambda t: entry_work(0, 16 * t, 16) <= bound)

    def small_chunks() -> None:
        seq = f"c{next(made)}"
        s.attend(0, [BatchEntry(seq, 0, 16 * chunks)], *qkv(small, 16 * chunks), tenant="")
        s.kv.release([seq], tenant="")

    shapes["C = 16 prefill"] = (entry_work(0, 16 * chunks, 16), 16 * chunks, chunks, small_chunks)
    timed = rounds({name: fn for name, (_, _, _, fn) in shapes.items()}, repeats)
    return {
        name: {"work": w, "tokens": t, "pieces_or_rows": r, "seconds": timed[name]}
        for name, (w, t, r, _) in shapes.items()
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"one tenant's heaviest allowed requests against another's decodes, {result['date']}, {result['machine']}",
        f"{result['model']} model, pool of {result['pool_blocks']:,} blocks, max_call_work"
        f" {result['max_call_work']:,}; {result['repeats']} rounds of {result['seconds_per_phase']:g} s a phase",
        "",
        f"{'phase':<13} {'victim calls':>12} {'p50':>8} {'p99':>8} {'worst':>8} {'p99/quiet':>9}"
        f" {'noisy done':>10} {'refused':>8} {'noisy median':>12}",
    ]
    for name, p in result["phases"].items():
        lines.append(
            f"{name:<13} {p['victim_calls']:>12} {p['victim_p50_ms']:>6.2f}ms {p['victim_p99_ms']:>6.2f}ms"
            f" {p['victim_max_ms']:>6.1f}ms {p['p99_vs_quiet']:>8.2f}x {p['noisy_done']:>10} {p['noisy_refused']:>8}"
            f" {p['noisy_median_ms']:>10.1f}ms"
        )
    if not result["heaviest_calls"]:
        return "\n".join(lines)
    lines += ["", "the heaviest call of each shape within the CPU's default bound (in-process, medians):",
              f"{'shape':<22} {'work':>10} {'tokens':>8} {'pieces/rows':>11} {'time':>9}"]  # fmt: skip
    for name, h in result["heaviest_calls"].items():
        lines.append(
            f"{name:<22} {h['work']:>10,} {h['tokens']:>8,} {h['pieces_or_rows']:>11,} {h['seconds'] * 1e3:>7.1f}ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every phase (default 3)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds a phase lasts each round (default 4)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and pool: checks the code paths")
    parser.add_argument(
        "--server-only",
        action="store_true",
        help="skip the in-process table (to run the phases against a server of another version, on PYTHONPATH)",
    )
    args = parser.parse_args(argv)
    result = run(args)
    result["heaviest_calls"] = {} if args.server_only else heaviest(1 if args.smoke else args.repeats)
    publish(result, report(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
