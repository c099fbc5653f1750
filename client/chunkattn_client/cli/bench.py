"""``chunkattn bench``: its options to BenchConfigs (a --sweep gives one per value), the runs on one channel
with Ctrl-C handling, and the table, JSON, CSV and HTML outputs. The bench package is imported only here,
when benching."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chunkattn_client.aio import AsyncChunkAttnClient
from chunkattn_client.cli.common import EXIT_FAILED, EXIT_MISMATCH, EXIT_OK, credentials

SWEEPABLE = {
    "concurrency": int,
    "rate": float,
    "prefill_chunk": int,
    "max_concurrency": int,
    "engines": int,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
}


def bench(args: argparse.Namespace) -> int:
    from chunkattn_client.bench import html, report  # import the bench only when benching
    from chunkattn_client.bench.config import BenchConfig
    from chunkattn_client.bench.workload import Lengths, WorkloadError, read_trace

    trace = tuple(read_trace(args.trace)) if args.trace else None
    config = BenchConfig(
        target=args.target,
        concurrency=args.concurrency,
        rate=args.rate,
        max_concurrency=args.max_concurrency,
        prompt=Lengths.parse(args.prompt_len, what="--prompt-len", minimum=1),
        output=Lengths.parse(args.output_len, what="--output-len", minimum=0),
        trace=trace,
        trace_path=args.trace,
        layers=args.layers,
        prefill_chunk=args.prefill_chunk,
        transport=args.transport,
        data_plane=args.data_plane,
        dtype=args.dtype,
        warmup_s=args.warmup,
        duration_s=args.duration,
        sequences=args.sequences,
        seed=args.seed,
        verify=args.verify,
        timeout_s=args.timeout,
        max_errors=args.max_errors,
        metrics_url=args.metrics_url,
        route=args.route,
        spec_tokens=args.spec_tokens,
        accept_rate=args.accept_rate,
        workload=args.workload,
        engines=args.engines,
        api=args.api,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        async_scheduling=args.async_scheduling,
        kv_blocks=args.kv_blocks,
        model_step_ms=args.model_step_ms,
    )
    param, values = _sweep(args.sweep, open_loop=args.rate is not None) if args.sweep else (None, [None])
    configs = [config if v is None else dataclasses.replace(config, **{param: v}) for v in values]  # type: ignore[arg-type]
    for cfg in configs:  # every point is checked before the first one runs
        cfg.check()
    for path in (args.json, args.csv, args.html):  # and every output can be written
        if path and not os.access(Path(path).resolve().parent, os.W_OK):
            raise WorkloadError(f"cannot write {path}: its directory does not exist or is not writable")

    results = asyncio.run(_run_all(configs, args.progress, credentials(args)))
    values = values[: len(results)]  # fewer when Ctrl-C ended a sweep
    rows = [(_label(v), r, report.summary(r)) for v, r in zip(values, results, strict=True)]
    for label, _, s in rows:
        if param:
            print(f"\n== {param} = {label}")
        print(report.table(s))
    if param:
        print("\n" + report.sweep_table(param, [(label, s) for label, _, s in rows]))
    if args.json:
        data: Any = rows[0][2] if param is None else {
            "sweep": {"param": param, "points": [{"value": v, **s} for v, (_, _, s) in zip(values, rows, strict=True)]}
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            report.write_csv([(label if param else "run", s) for label, _, s in rows], f)
    if args.html:
        Path(args.html).write_text(html.render(rows, param))
    summaries = [s for _, _, s in rows]
    if any(report.mismatched(s) for s in summaries):
        return EXIT_MISMATCH
    if any(report.failed(s) for s in summaries) and not args.allow_errors:
        return EXIT_FAILED
    return EXIT_OK


def _sweep(text: str, *, open_loop: bool) -> tuple[str, list[Any]]:
    from chunkattn_client.bench.workload import WorkloadError

    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in SWEEPABLE or not values:
        raise WorkloadError(f"--sweep: expected PARAM=V1,V2,... with PARAM one of {', '.join(SWEEPABLE)}; got {text!r}")
    if open_loop and name == "concurrency":
        raise WorkloadError("--sweep concurrency=...: with --rate the load is set by the rate; sweep rate instead")
    if not open_loop and name == "max_concurrency":
        raise WorkloadError("--sweep max_concurrency=...: only the open loop (--rate) has a cap to sweep")
    try:
        return name, [SWEEPABLE[name](v) for v in values.split(",")]
    except ValueError:
        raise WorkloadError(f"--sweep: {values!r} are not all numbers") from None


def _label(value: Any) -> str:
    return "run" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


async def _run_all(configs: Sequence[Any], progress_mode: str, creds: dict[str, Any]) -> list[Any]:
    """Run each config in turn on one channel. The first Ctrl-C ends the current run (it is still reported)
    and the sweep; a second one quits at once."""
    from chunkattn_client.bench.engine import EngineBench
    from chunkattn_client.bench.progress import make_progress
    from chunkattn_client.bench.runner import Bench

    results = []
    first = configs[0]
    async with AsyncChunkAttnClient(
        first.target, timeout_s=first.timeout_s, data_plane=first.data_plane, **creds
    ) as client:
        info = await client.info()
        used = await client.open_data_plane()  # each sequence's routed client opens its own, of this kind
        loop = asyncio.get_running_loop()
        for cfg in (dataclasses.replace(c, data_plane_used=used) for c in configs):
            bench = (EngineBench if cfg.workload == "engine" else Bench)(cfg, client, info)
            total, unit = (cfg.duration_s, "s") if cfg.duration_s else (cfg.max_sequences(), "seq")
            progress = make_progress(progress_mode, total, unit)

            def interrupt(bench: Bench = bench) -> None:
                print("\nchunkattn: stopping (Ctrl-C again to quit at once)", file=sys.stderr)
                bench.stop("interrupted (Ctrl-C)")
                loop.remove_signal_handler(signal.SIGINT)

            loop.add_signal_handler(signal.SIGINT, interrupt)
            try:
                results.append(await bench.run(progress))
            finally:
                loop.remove_signal_handler(signal.SIGINT)
                if progress is not None:
                    progress.close()
            if bench.interrupted:
                break
    return results
