"""The ``chunkattn`` command: ``info``, ``health`` and ``bench`` against a running server.

    chunkattn info --target localhost:50051
    chunkattn health --target localhost:50051 --wait 60
    chunkattn bench --target localhost:50051 --concurrency 8 --duration 30 --html report.html
    chunkattn kv transfer --target prefill:50051 seq-1 --to decode:50051 --release

Exit codes: 0 success; 1 failed calls (bench; unless --allow-errors), not serving (health), or a refused
request (kv); 2 bad arguments or no server to talk to; 3 bench --verify found outputs that differ from the
reference or checked fewer calls than asked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from chunkattn_client import dtypes
from chunkattn_client.aio import AsyncChunkAttnClient
from chunkattn_client.bench.promtext import MetricsError
from chunkattn_client.client import ChunkAttnClient, ChunkAttnError, ServerInfo

DEFAULT_TARGET = os.environ.get("CHUNKATTN_TARGET", "localhost:50051")
SWEEPABLE = {"concurrency": int, "rate": float, "prefill_chunk": int, "max_concurrency": int}
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MISMATCH = 0, 1, 2, 3


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ChunkAttnError as e:  # no server to talk to (2), or it refused what was asked (1)
        print(f"chunkattn: {args.target}: {e}", file=sys.stderr)
        return EXIT_USAGE if e.code == grpc.StatusCode.UNAVAILABLE else EXIT_FAILED
    except DecodeError as e:  # a file that is not what it should be (a KV export)
        print(f"chunkattn: not a KV export file (unreadable message: {e})", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError, MetricsError) as e:  # WorkloadError is a ValueError
        print(f"chunkattn: {e}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chunkattn", description="Talk to a chunkattn server.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        _connection(c)
        return c

    c = command("info", "Print the server's model shape, KV pool and version.")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.add_argument("--timeout", type=float, default=10.0, metavar="S")
    c.set_defaults(func=_info)

    c = command("health", "Print the server's health; exit 0 only when it is SERVING.")
    c.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for SERVING")
    c.add_argument("--timeout", type=float, default=5.0, metavar="S")
    c.set_defaults(func=_health)

    kv = sub.add_parser("kv", help="Move, save and fork sequences' KV.", description="Move, save and fork KV.")
    kv_sub = kv.add_subparsers(required=True, metavar="ACTION")

    def kv_command(name: str, help: str) -> argparse.ArgumentParser:
        c = kv_sub.add_parser(name, help=help, description=help)
        _connection(c)
        c.add_argument("--timeout", type=float, default=300.0, metavar="S")
        return c

    c = kv_command("export", "Save a sequence's live KV to a file.")
    c.add_argument("seq_id")
    c.add_argument("--out", required=True, metavar="FILE")
    c.add_argument("--layers", default="", help="comma-separated layers (default: all)")
    c.set_defaults(func=_kv_export)
    c = kv_command("import", "Load a file written by `kv export` as a new sequence.")
    c.add_argument("file")
    c.add_argument("--seq-id", help="the new sequence's id (default: the exported one)")
    c.set_defaults(func=_kv_import)
    c = kv_command("transfer", "Have the target server send a sequence's KV straight to another server.")
    c.add_argument("seq_id")
    c.add_argument("--to", required=True, metavar="HOST:PORT", help="the importing server, as the source sees it")
    c.add_argument("--new-seq-id", default="", help="its id there (default: the same)")
    c.add_argument("--release", action="store_true", help="release it on the source once the target has it")
    c.add_argument("--layers", default="", help="comma-separated layers (default: all)")
    c.add_argument(
        "--target-token",
        default=os.environ.get("CHUNKATTN_TARGET_TOKEN", ""),
        help="the token the source presents to the importing server (default $CHUNKATTN_TARGET_TOKEN, else the"
        " source's own --transfer-token)",
    )
    c.set_defaults(func=_kv_transfer)
    c = kv_command("fork", "Start a sequence that shares another's KV copy-on-write.")
    c.add_argument("parent")
    c.add_argument("child")
    c.set_defaults(func=_kv_fork)

    c = command("bench", "Load-test the server with a synthetic model-runner workload.")
    w = c.add_argument_group("workload")
    w.add_argument("--concurrency", type=int, default=1, help="closed loop: sequences in flight (default 1)")
    w.add_argument("--rate", type=float, help="open loop: Poisson arrivals, sequences per second")
    w.add_argument("--max-concurrency", type=int, default=256, help="open loop: cap on sequences in flight")
    w.add_argument("--prompt-len", default="128", metavar="N|LO:HI", help="prompt tokens (default %(default)s)")
    w.add_argument("--output-len", default="32", metavar="N|LO:HI", help="decode steps (default %(default)s)")
    w.add_argument("--trace", metavar="JSONL", help='lengths from a file of {"prompt_len", "output_len"} lines')
    w.add_argument("--layers", default="all", help="layers each step calls: all, or e.g. 0,1,3")
    w.add_argument("--prefill-chunk", type=int, default=0, metavar="N", help="prefill in pieces of N (0: whole)")
    w.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: each decode step is a verify call of K drafts + 1 token, whose rejected drafts"
        " are then truncated (the server needs --spec-window K or more; default 0: one-token decode steps)",
    )
    w.add_argument(
        "--accept-rate",
        type=float,
        default=0.7,
        metavar="P",
        help="with --spec-tokens: each draft is accepted with probability P while the earlier ones were (default 0.7)",
    )
    w.add_argument("--transport", choices=("unary", "stream"), default="unary")
    w.add_argument("--dtype", choices=[d.name for d in dtypes.WIRE], default="float32")
    w.add_argument("--seed", type=int, default=0)
    r = c.add_argument_group("run")
    r.add_argument("--duration", type=float, metavar="S", help="measure for S seconds")
    r.add_argument("--sequences", type=int, metavar="N", help="measure N sequences (run to completion)")
    r.add_argument("--warmup", type=float, default=0.0, metavar="S", help="unmeasured warm-up first (default 0)")
    r.add_argument("--sweep", metavar="PARAM=V1,V2,..", help=f"one run per value of {', '.join(SWEEPABLE)}")
    r.add_argument("--verify", type=int, default=0, metavar="N", help="check N calls against the float64 reference")
    r.add_argument("--timeout", type=float, default=60.0, metavar="S", help="deadline of each call")
    r.add_argument("--max-errors", type=int, default=100, help="stop the run after this many failed calls")
    r.add_argument("--allow-errors", action="store_true", help="exit 0 even when calls failed")
    r.add_argument("--metrics-url", help="the server's /metrics URL: report its view beside the client's")
    r.add_argument("--progress", choices=("auto", "plain", "none"), default="auto")
    o = c.add_argument_group("outputs (the table always goes to stdout)")
    o.add_argument("--json", metavar="PATH", help="the summary as JSON")
    o.add_argument("--csv", metavar="PATH", help="one row per run (per sweep point)")
    o.add_argument("--html", metavar="PATH", help="a self-contained HTML report with plots")
    c.set_defaults(func=_bench)
    return p


# -- connections ----------------------------------------------------------------------------------------


def _connection(c: argparse.ArgumentParser) -> None:
    """The flags that say where the server is and how to talk to it."""
    c.add_argument("--target", default=DEFAULT_TARGET, help="HOST:PORT (default $CHUNKATTN_TARGET or %(default)s)")
    g = c.add_argument_group("security (a server with TLS, mutual TLS or tokens)")
    g.add_argument(
        "--tls-ca", metavar="FILE", help="use TLS, trusting the server's certificate if it chains to this CA"
    )
    g.add_argument("--tls-cert", metavar="FILE", help="present this client certificate (mutual TLS); with --tls-key")
    g.add_argument("--tls-key", metavar="FILE", help="the client certificate's private key")
    g.add_argument(
        "--token",
        default=os.environ.get("CHUNKATTN_TOKEN"),
        help="the bearer token that names your tenant (default $CHUNKATTN_TOKEN; a flag shows in ps)",
    )
    c.add_argument(
        "--route",
        metavar="KEY",
        help="the x-chunkattn-route key Envoy hashes to pick a replica (default: the sequence's id for kv commands"
        " (a fork: the parent's) and for each bench sequence; a random key otherwise)",
    )


def _credentials(args: argparse.Namespace) -> dict[str, Any]:
    """The client's credential arguments from the flags (files read here: OSError when one cannot be)."""

    def read(path: str | None, flag: str) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise OSError(f"{flag} {path}: {e.strerror}") from None

    return {
        "root_certificates": read(args.tls_ca, "--tls-ca"),
        "certificate_chain": read(args.tls_cert, "--tls-cert"),
        "private_key": read(args.tls_key, "--tls-key"),
        "token": args.token or None,
    }


def _client(args: argparse.Namespace, route: str | None = None) -> ChunkAttnClient:
    """A client for the flags; its route is --route, else ``route`` (None: a random one)."""
    route = args.route if args.route is not None else route
    return ChunkAttnClient(args.target, timeout_s=args.timeout, route=route, **_credentials(args))


# -- info, health ---------------------------------------------------------------------------------------


def _info(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.info()
    if args.json:
        print(json.dumps(dataclasses.asdict(info), indent=2))
    else:
        print(describe(info))
    return EXIT_OK


def describe(info: ServerInfo) -> str:
    """A human summary of Info."""
    chunks = [x.chunk_size for x in info.layers]
    kinds = ", ".join(f"{chunks.count(c)} x {'global' if c == 0 else f'C={c}'}" for c in sorted(set(chunks)))
    sharing = sum(x.kv_source is not None for x in info.layers)
    used = info.num_blocks - info.free_blocks
    return "\n".join(
        [
            f"chunkattn-server {info.version}: backend {info.backend} on {info.device}",
            f"model: {len(info.layers)} layers ({kinds}{f', {sharing} share KV' if sharing else ''}),"
            f" {info.num_heads} heads, {info.num_kv_heads} KV heads, head size {info.head_size}",
            f"KV cache: {info.cache_dtype}, {info.num_blocks} blocks of {info.block_size} tokens"
            f" ({info.bytes_per_block} bytes each), {used} in use; {info.active_sequences} active sequences"
            + (f"; spec window {info.spec_window} tokens" if info.spec_window else ""),
            f"dtypes on the wire: {', '.join(info.dtypes)}; attention computes in"
            f" {info.compute_dtype or info.cache_dtype}; max message {info.max_message_bytes >> 20} MiB",
        ]
    )


def _health(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    with _client(args) as c:
        while True:
            try:
                status = c.health()
            except ChunkAttnError as e:
                status = f"unreachable ({e.code.name}: {e.message})"
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_FAILED


# -- kv -----------------------------------------------------------------------------------------------------


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise ValueError(f"--layers: expected comma-separated layer numbers, got {text!r}") from None


def _kv_export(args: argparse.Namespace) -> int:
    from chunkattn_client import kvfile

    with _client(args, args.seq_id) as c:
        start = time.perf_counter()
        chunks = c.export_kv(args.seq_id, layers=_layers(args.layers))
        counted = _Counted(chunks)
        try:
            messages, size = kvfile.write(args.out, counted)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(args.out)  # no half-written export left behind
            raise
    print(
        f"exported {args.seq_id!r}: {counted.records} blocks, {counted.kv_bytes} bytes of K/V in {messages}"
        f" messages ({size} bytes) to {args.out} in {time.perf_counter() - start:.2f} s"
    )
    return EXIT_OK


class _Counted:
    """Passes KV chunks through, counting their blocks and K/V bytes."""

    def __init__(self, chunks: Any) -> None:
        self._chunks = chunks
        self.records = self.kv_bytes = 0

    def __iter__(self) -> Any:
        for chunk in self._chunks:
            for b in chunk.blocks.blocks:
                self.records += 1
                self.kv_bytes += len(b.k) + len(b.v)
            yield chunk


def _kv_import(args: argparse.Namespace) -> int:
    from chunkattn_client import kvfile

    if not os.path.exists(args.file):
        raise ValueError(f"no such file: {args.file}")
    chunks = kvfile.read(args.file)
    first = next(chunks, None)  # the header names the exported sequence: the route of the new one by default
    route = args.seq_id or (first.header.seq_id if first is not None and first.HasField("header") else None)
    with _client(args, route) as c:
        start = time.perf_counter()
        r = c.import_kv(itertools.chain([] if first is None else [first], chunks), seq_id=args.seq_id)
    print(
        f"imported {r.seq_id!r}: {r.blocks} blocks allocated, {r.records} received ({r.bytes} bytes of K/V)"
        f" in {time.perf_counter() - start:.2f} s"
    )
    return EXIT_OK


def _kv_transfer(args: argparse.Namespace) -> int:
    with _client(args, args.seq_id) as c:
        r = c.transfer_kv(
            args.seq_id,
            args.to,
            new_seq_id=args.new_seq_id,
            release_after=args.release,
            layers=_layers(args.layers),
            target_token=args.target_token,
        )
    where = f"{args.to} as {args.new_seq_id!r}" if args.new_seq_id else args.to
    print(
        f"transferred {args.seq_id!r} to {where}: {r.records} blocks, {r.bytes} bytes of K/V in {r.seconds:.3f} s"
        f" ({r.bytes / max(r.seconds, 1e-9) / 1e6:.0f} MB/s){'; released at the source' if r.released else ''}"
    )
    return EXIT_OK


def _kv_fork(args: argparse.Namespace) -> int:
    with _client(args, args.parent) as c:  # the child lives where its parent does
        shared = c.fork(args.parent, args.child)
    print(f"forked {args.parent!r} into {args.child!r}: {shared} blocks shared copy-on-write")
    return EXIT_OK


# -- bench ------------------------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    from chunkattn_client.bench import html, report  # import the bench only when benching
    from chunkattn_client.bench.runner import BenchConfig
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
    )
    param, values = _sweep(args.sweep, open_loop=args.rate is not None) if args.sweep else (None, [None])
    configs = [config if v is None else dataclasses.replace(config, **{param: v}) for v in values]  # type: ignore[arg-type]
    for cfg in configs:  # every point is checked before the first one runs
        cfg.check()
    for path in (args.json, args.csv, args.html):  # and every output can be written
        if path and not os.access(Path(path).resolve().parent, os.W_OK):
            raise WorkloadError(f"cannot write {path}: its directory does not exist or is not writable")

    results = asyncio.run(_run_all(configs, args.progress, _credentials(args)))
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


async def _run_all(configs: Sequence[Any], progress_mode: str, credentials: dict[str, Any]) -> list[Any]:
    """Run each config in turn on one channel. The first Ctrl-C ends the current run (it is still reported)
    and the sweep; a second one quits at once."""
    from chunkattn_client.bench.progress import make_progress
    from chunkattn_client.bench.runner import Bench

    results = []
    async with AsyncChunkAttnClient(configs[0].target, timeout_s=configs[0].timeout_s, **credentials) as client:
        info = await client.info()
        loop = asyncio.get_running_loop()
        for cfg in configs:
            bench = Bench(cfg, client, info)
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
