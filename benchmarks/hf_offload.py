"""Decode tokens/s of a transformers model with its attention offloaded to chunkattn, against running it locally.

The model is the example's (examples/hf_offload.py): a random-weight Llama 4 text model at toy size
(4 layers, 8/2 heads of 32), float32 on the CPU, in this process; the server runs in a process of its own
on the same machine, started with ``--hf-config`` on the model's config.json.

Contenders, each generating ``--new-tokens`` tokens greedily per row from the same prompts:
- local: transformers alone with its own KV cache (sdpa attention), one row at a time: the reference the
  offloaded runs are checked against;
- local batched: transformers alone, all rows in one batch, left-padded with an attention mask (its usual
  way to batch rows of different lengths). Only with more than one row, and only timed: padding shifts
  where transformers puts Llama 4's chunk boundaries in the padded rows, so its tokens may differ;
- unary / stream: ``chunkattn_client.hf.OffloadSession``, all rows in one batch without padding, one Attend
  call per layer per forward, as unary RPCs or over one AttendStream.

Ratios are against local batched where there is one (the same batch, so the same work), else local.

Decode tokens/s = rows x (new tokens - 1) / seconds of the decode steps (the prefill is left out). Each
round runs every contender in turn (interleaved, so drift on a shared machine hits all alike); the
figure is the median over rounds. The first round also checks that every offloaded run chose the local
run's tokens, with logits within 1e-4, and stops with an error otherwise.

    python benchmarks/hf_offload.py [--batches 1,3] [--new-tokens 64] [--repeats 5] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
import transformers

from chunkattn_client import ChunkAttnClient
from chunkattn_client.hf import Generation, OffloadSession, Transport, generate_locally, greedy

from timing import cpu_name  # benchmarks/timing.py, beside this script

ROOT = Path(__file__).resolve().parents[1]


def _example() -> Any:
    """examples/hf_offload.py, the model and server this benchmark shares with the example (loaded from its
    file: examples/ is not a package on the path)."""
    spec = importlib.util.spec_from_file_location("hf_offload_example", ROOT / "examples" / "hf_offload.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


_EXAMPLE = _example()
Server, build_model, max_logit_difference, prompts_of = (
    _EXAMPLE.Server,
    _EXAMPLE.build_model,
    _EXAMPLE.max_logit_difference,
    _EXAMPLE.prompts_of,
)

PROMPT_LENGTHS = (40, 27, 53)  # row r gets PROMPT_LENGTHS[r % 3]: every prefill crosses a chunk boundary (16)
TRANSPORTS: tuple[Transport, ...] = ("unary", "stream")


def bench_batch(model: Any, client: ChunkAttnClient, rows: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    prompts = prompts_of([PROMPT_LENGTHS[r % len(PROMPT_LENGTHS)] for r in range(rows)], model.config.vocab_size)
    runs: dict[str, Callable[[], Generation]] = {"local": lambda: generate_locally(model, prompts, new_tokens)}
    if rows > 1:
        runs["local_batched"] = lambda: generate_padded(model, prompts, new_tokens)

    def offloaded(transport: Transport, keep_logits: bool = False) -> Generation:
        with OffloadSession(client, model, transport=transport) as session:
            return session.generate(prompts, new_tokens, keep_logits=keep_logits)

    for transport in TRANSPORTS:
        runs[transport] = functools.partial(offloaded, transport)
    reference = generate_locally(model, prompts, new_tokens, keep_logits=True)
    worst = 0.0
    for transport in TRANSPORTS:  # correctness first, untimed
        checked = offloaded(transport, keep_logits=True)
        if checked.tokens != reference.tokens:
            raise SystemExit(f"{transport}: the offloaded run chose other tokens than the local model")
        worst = max(worst, max_logit_difference(checked, reference))
    if worst > 1e-4:
        raise SystemExit(f"offloaded logits differ from the local model's by {worst:.1e} (> 1e-4)")
    rates: dict[str, list[float]] = {name: [] for name in runs}
    calls: dict[str, int] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            result = run()
            rates[name].append(result.decode_tokens_per_s)
            calls[name] = result.calls
    tps = {name: statistics.median(r) for name, r in rates.items()}
    baseline = "local_batched" if rows > 1 else "local"
    return {
        "rows": rows,
        "prompt_lengths": [len(p) for p in prompts],
        "new_tokens": new_tokens,
        "decode_tokens_per_s": tps,
        "baseline": baseline,
        "ratio": {t: tps[t] / tps[baseline] for t in TRANSPORTS},
        "attend_calls": {t: calls[t] for t in TRANSPORTS},
        "ms_per_decode_step": {name: 1e3 * rows / v for name, v in tps.items()},
        "max_abs_logit_diff": worst,
    }


class PaddedBatch:
    """All rows in one batch run by transformers alone: left-padded, with an attention mask and its own KV
    cache. ``last`` after the prefill, then ``step``, as ``chunkattn_client.hf.greedy`` drives them."""

    def __init__(self, model: Any, prompts: list[list[int]]) -> None:
        rows, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((rows, width), dtype=torch.long)
        self.mask = torch.zeros((rows, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            self.mask[r, width - len(p) :] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.model, self.position = model, positions[:, -1:]
        out = model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.cache, self.last = out.past_key_values, list(out.logits[:, -1].float())

    def step(self, chosen: list[int]) -> list[torch.Tensor]:
        self.mask = torch.cat([self.mask, torch.ones((len(chosen), 1), dtype=torch.long)], dim=1)
        self.position = self.position + 1
        out = self.model(
            input_ids=torch.tensor(chosen)[:, None],
            attention_mask=self.mask,
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return list(out.logits[:, -1].float())


def generate_padded(model: Any, prompts: list[list[int]], new_tokens: int) -> Generation:
    """Greedy generation by transformers alone, all rows in one left-padded batch (``PaddedBatch``)."""
    started = time.perf_counter()
    with torch.no_grad():
        batch = PaddedBatch(model, prompts)
        decode_started = time.perf_counter()
        tokens, _ = greedy(batch.last, new_tokens, batch.step)
    end = time.perf_counter()
    return Generation(tokens, None, end - started, end - decode_started, decode_tokens=len(prompts) * (new_tokens - 1))


def run(batches: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    started = time.perf_counter()
    model = build_model(seed=0)
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        server = Server(Path(folder) / "config.json", [])
        try:
            with ChunkAttnClient(server.target, timeout_s=60) as client:
                results = [bench_batch(model, client, rows, new_tokens, repeats) for rows in batches]
        finally:
            server.stop()
    return {
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}",
        "repeats": repeats,
        "batches": results,
        "duration_s": time.perf_counter() - started,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"chunkattn hf offload benchmark, {result['date']}, {result['machine']}",
        "",
        "the example's Llama 4 text model (4 layers, 8/2 heads of 32, float32); decode tokens/s, median of"
        f" {result['repeats']} rounds; local = transformers alone, a row at a time; batched = transformers alone,"
        " left-padded; ratios against batched where there is one",
        f"{'rows':>4} {'prompts':<12} {'new':>4} {'local':>8} {'batched':>8} {'unary':>8} {'ratio':>6}"
        f" {'stream':>8} {'ratio':>6} {'calls':>6} {'max |dlogit|':>12}",
    ]
    for b in result["batches"]:
        t, r = b["decode_tokens_per_s"], b["ratio"]
        batched = f"{t['local_batched']:>8.1f}" if "local_batched" in t else f"{'-':>8}"
        lines.append(
            f"{b['rows']:>4} {','.join(map(str, b['prompt_lengths'])):<12} {b['new_tokens']:>4} {t['local']:>8.1f}"
            f" {batched} {t['unary']:>8.1f} {r['unary']:>5.2f}x {t['stream']:>8.1f} {r['stream']:>5.2f}x"
            f" {b['attend_calls']['stream']:>6} {b['max_abs_logit_diff']:>12.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,3", help="rows per batch to measure (default 1,3)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--smoke", action="store_true", help="1 and 2 rows, 4 tokens, 1 round: checks the code paths")
    args = parser.parse_args(argv)
    batches = [1, 2] if args.smoke else [int(x) for x in args.batches.split(",")]
    new_tokens, repeats = (4, 1) if args.smoke else (args.new_tokens, args.repeats)
    if min(batches) < 1 or new_tokens < 2 or repeats < 1:
        parser.error("rows and --repeats must be >= 1, --new-tokens >= 2 (one decode step at least)")
    result = run(batches, new_tokens, repeats)
    print(report(result))
    print(f"\n({result['duration_s']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
