"""The ``chunkattn`` command's argument parser: every subcommand's flags, and the function that runs it."""

from __future__ import annotations

import argparse
import os

from chunkattn_client import dtypes
from chunkattn_client.cli.bench import SWEEPABLE, bench
from chunkattn_client.cli.common import add_connection
from chunkattn_client.cli.info import health, info
from chunkattn_client.cli.kv import kv_export, kv_fork, kv_import, kv_transfer
from chunkattn_client.dataplane import ENV as DATA_PLANE_ENV
from chunkattn_client.dataplane import SETTINGS as DATA_PLANES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chunkattn", description="Talk to a chunkattn server.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        add_connection(c)
        return c

    c = command("info", "Print the server's model shape, KV pool and version.")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.add_argument("--timeout", type=float, default=10.0, metavar="S")
    c.set_defaults(func=info)

    c = command("health", "Print the server's health; exit 0 only when it is SERVING.")
    c.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for SERVING")
    c.add_argument("--timeout", type=float, default=5.0, metavar="S")
    c.set_defaults(func=health)

    kv = sub.add_parser("kv", help="Move, save and fork sequences' KV.", description="Move, save and fork KV.")
    kv_sub = kv.add_subparsers(required=True, metavar="ACTION")

    def kv_command(name: str, help: str) -> argparse.ArgumentParser:
        c = kv_sub.add_parser(name, help=help, description=help)
        add_connection(c)
        c.add_argument("--timeout", type=float, default=300.0, metavar="S")
        return c

    c = kv_command("export", "Save a sequence's live KV to a file.")
    c.add_argument("seq_id")
    c.add_argument("--out", required=True, metavar="FILE")
    c.add_argument("--layers", default="", help="comma-separated layers (default: all)")
    c.set_defaults(func=kv_export)
    c = kv_command("import", "Load a file written by `kv export` as a new sequence.")
    c.add_argument("file")
    c.add_argument("--seq-id", help="the new sequence's id (default: the exported one)")
    c.set_defaults(func=kv_import)
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
    c.set_defaults(func=kv_transfer)
    c = kv_command("fork", "Start a sequence that shares another's KV copy-on-write.")
    c.add_argument("parent")
    c.add_argument("child")
    c.set_defaults(func=kv_fork)

    c = command("bench", "Load-test the server with a synthetic model-runner workload.")
    w = c.add_argument_group("workload")
    w.add_argument(
        "--concurrency", type=int, default=1, help="closed loop: sequences in flight (per engine; default 1)"
    )
    w.add_argument("--rate", type=float, help="open loop: Poisson arrivals, sequences per second (per engine)")
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
    e = c.add_argument_group(
        "engine workload (--workload engine: serving engines that batch their requests, as vLLM does; docs/bench.md)"
    )
    e.add_argument(
        "--workload",
        choices=("sequences", "engine"),
        default="sequences",
        help="sequences: one model runner per sequence, a call per sequence per layer (default); engine: --engines"
        " engines, a call per layer per step carrying every request the engine scheduled",
    )
    e.add_argument("--engines", type=int, default=1, help="engines at once, each its own space and route (default 1)")
    e.add_argument(
        "--api",
        choices=("blocks", "sequence"),
        default="blocks",
        help="how an engine addresses KV: blocks (its own block space, as the vLLM plugin; default) or sequence",
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="an engine step's token budget, prefills chunked to it (vLLM's; default %(default)s)",
    )
    e.add_argument(
        "--max-num-seqs", type=int, default=256, metavar="N", help="requests an engine runs at once (default 256)"
    )
    e.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule as vLLM does on GPUs (step N + 1 before step N's tokens: a finished request holds its seat"
        " and blocks a step longer, a new one starts a step later); default: synchronous, as vLLM on the CPU",
    )
    e.add_argument(
        "--kv-blocks",
        type=int,
        metavar="N",
        help="blocks of each engine's KV cache (default: room for its running requests at their longest)",
    )
    e.add_argument(
        "--model-step-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="the model's non-attention time per step, slept before its layers' calls in pauses of at least 2 ms"
        " (default 0)",
    )
    w.add_argument("--transport", choices=("unary", "stream"), default="unary")
    w.add_argument(
        "--data-plane",
        choices=DATA_PLANES,
        default=os.environ.get(DATA_PLANE_ENV) or "auto",
        help="where the Attend calls go: auto (the server's ZeroMQ data plane where it offers one, else gRPC),"
        " grpc, zmq (default $CHUNKATTN_DATA_PLANE, else auto); the report says which was used",
    )
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
    c.set_defaults(func=bench)
    return p
