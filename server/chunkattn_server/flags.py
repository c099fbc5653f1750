"""chunkattn-server: serve chunked-local attention over gRPC.

With no arguments it serves a small demo model on the CPU: 4 layers as Llama 4 interleaves them
(3 chunked with C = 1024, then 1 global), 8 query / 2 KV heads of size 64.

Every flag can also come from the environment (CHUNKATTN_<FLAG>, e.g. CHUNKATTN_PORT=50052) or from a
JSON file given with --config (keys are the flag names with underscores; "layers" may instead be a list
of {"chunk_size", "kv_source", "scale", "alibi_slopes"} objects). Precedence: flags, environment, file.

--hf-config FILE serves the attention shape of a Hugging Face config.json (heads, KV heads, head size,
and each layer's chunk size from layer_types and attention_chunk_size; see chunkattn_client.hfconfig),
so that a model runner and the server can be pointed at the same model.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from chunkattn_client._channel import MAX_KEEPALIVE_S, MIN_KEEPALIVE_S, check_keepalive
from chunkattn_server import jsonfile
from chunkattn_server.config import (
    DEFAULT_DATA_PLANE_SESSION_S,
    DEFAULT_IMPORT_STALL_S,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_MESSAGE_MIB,
    DEFAULT_MAX_OPEN_CALLS,
    DEFAULT_STREAM_IDLE_S,
    DEFAULT_TRANSFER_KEEPALIVE_S,
    MAX_CALL_WORK,
)

PRESETS: dict[str, dict[str, Any]] = {
    "demo": {"layers": 4, "chunk_size": 1024, "global_every": 4, "heads": 8, "kv_heads": 2, "head_size": 64},
    "llama4-scout": {"layers": 48, "chunk_size": 8192, "global_every": 4, "heads": 40, "kv_heads": 8, "head_size": 128},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chunkattn-server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    add("--config", metavar="FILE", help="JSON file with any of the options below")
    g = p.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051; 0 picks a free one)")
    g.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (default 9400; 0: off)")
    g.add_argument(
        "--max-message-mib",
        type=int,
        default=DEFAULT_MAX_MESSAGE_MIB,
        help="largest request or response in MiB; receiving one pauses every other call for ~1.5-5 ms per MiB"
        f" (default {DEFAULT_MAX_MESSAGE_MIB}: a 1,024-token Llama-4-Scout prefill in bf16)",
    )
    g.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=64,
        help="calls the server works on at once, beyond which new ones get RESOURCE_EXHAUSTED; a stream counts"
        " only while one of its messages is served; health and Info never count (default 64; 0: no limit)",
    )
    g.add_argument(
        "--max-open-calls",
        type=int,
        default=DEFAULT_MAX_OPEN_CALLS,
        help="calls open at once, idle streams and calls still being received included, beyond which gRPC"
        f" refuses new ones, health checks too, with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_OPEN_CALLS}; 0: no"
        " limit)",
    )
    g.add_argument(
        "--max-inflight-mib",
        type=int,
        help="request bytes held at once, beyond which a new request over 64 KiB gets RESOURCE_EXHAUSTED"
        " (default: an eighth of the machine's memory, at least --max-message-mib, at most 32 GiB)",
    )
    g.add_argument(
        "--stream-idle-s",
        type=float,
        default=DEFAULT_STREAM_IDLE_S,
        help="close a stream whose client sends nothing (or reads nothing) this long, with DEADLINE_EXCEEDED"
        f" (default {DEFAULT_STREAM_IDLE_S:g}; 0: never)",
    )
    g.add_argument(
        "--max-call-work",
        type=int,
        help="the most work one Attend call may ask for (the keys each new token sees, plus 8,192 per piece the"
        " engine computes apart: docs/server.md), beyond which it gets INVALID_ARGUMENT: what one call may hold"
        " the engine for while others wait (default: 2^22 on the CPU, 2^30 on CUDA; 0: no bound; at most 2^62)",
    )
    b = p.add_argument_group("batching (concurrent clients' Attend calls of one layer share an engine step)")
    b.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="tokens one engine step takes from queued Attend calls of one layer; a larger call runs alone"
        f" (default {DEFAULT_MAX_BATCH_TOKENS})",
    )
    b.add_argument(
        "--max-batch-delay-us",
        type=int,
        default=0,
        help="wait up to this long for more calls to join a step that has room (default 0: batch what is"
        " queued, never wait; as Triton's max_queue_delay_microseconds)",
    )
    b.add_argument(
        "--no-batching",
        dest="batching",
        action="store_false",
        help="run every call in a step of its own (for comparison)",
    )
    b.add_argument(
        "--no-inline-steps",
        dest="inline_steps",
        action="store_false",
        help="run every engine step on the engine thread; by default, on the CPU, the event loop runs a small"
        " step (a batch of decodes) itself while the engine thread is idle, which saves two thread hand-offs"
        " per step",
    )
    g.add_argument("--idle-timeout-s", type=float, default=600.0, help="release sequences idle this long (0: never)")
    g.add_argument("--grace-s", type=float, default=10.0, help="on SIGTERM, time for calls in flight (default 10)")
    g.add_argument(
        "--drain-delay-s",
        type=float,
        default=0.0,
        help="on SIGTERM, refuse new calls (UNAVAILABLE, NOT_SERVING) for at least this long before stopping, so"
        " that load balancers see the drain first; behind Envoy: 2 health-check intervals or more (default 0)",
    )
    g.add_argument(
        "--kv-import-stall-s",
        type=float,
        default=DEFAULT_IMPORT_STALL_S,
        help="abandon a KV import whose next message takes longer, returning its blocks"
        f" (default {DEFAULT_IMPORT_STALL_S:g}; 0: never)",
    )
    g.add_argument(
        "--transfer-keepalive-s",
        type=float,
        default=DEFAULT_TRANSFER_KEEPALIVE_S,
        help="TransferKV pings its target after this long without news and fails if no answer comes within as"
        f" long (default {DEFAULT_TRANSFER_KEEPALIVE_S:g}; 0: no pings; else {MIN_KEEPALIVE_S:g} to"
        f" {MAX_KEEPALIVE_S:g})",
    )
    d = p.add_argument_group(
        "data plane (Attend over ZeroMQ for model runners, opened by OpenDataPlane; docs/deployment.md). On a TLS"
        " server it is encrypted with CURVE"
    )
    d.add_argument(
        "--data-plane-tcp",
        metavar="HOST:PORT",
        help="serve the data plane on this TCP address ([IPv6]:PORT; port 0: any free one, OpenDataPlane gives"
        " the real one); default: no tcp data plane",
    )
    d.add_argument(
        "--data-plane-ipc",
        metavar="PATH",
        help="serve the data plane on this Unix socket (mode 0600; its folder must not be writable by others), or"
        " auto: a socket in a fresh 0700 folder of $XDG_RUNTIME_DIR (else the temporary folder); for clients on"
        " this host of the server's user; default: no ipc data plane",
    )
    d.add_argument(
        "--data-plane-advertise",
        metavar="HOST",
        help="the host OpenDataPlane gives out in tcp endpoints, as clients reach this server (default: the bound"
        " host, or this machine's name when bound to 0.0.0.0)",
    )
    d.add_argument(
        "--data-plane-session-s",
        type=float,
        default=DEFAULT_DATA_PLANE_SESSION_S,
        help=f"how long a data-plane session lives (default {DEFAULT_DATA_PLANE_SESSION_S:g})",
    )
    t = p.add_argument_group("security (docs/security.md)")
    t.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this PEM certificate (chain); with --tls-key")
    t.add_argument("--tls-key", metavar="FILE", help="the certificate's PEM private key")
    t.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="mutual TLS: require client certificates that chain to this PEM CA (a certificate's CN may name a"
        " tenant in --auth-tokens)",
    )
    t.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="tenants, their tokens' SHA-256 and quotas (JSON, see docs/security.md): every chunkattn RPC then needs a"
        " token or a client certificate that names a tenant; reloaded on SIGHUP with the TLS files",
    )
    t.add_argument(
        "--transfer-token",
        default="",
        help="the token TransferKV presents to the --transfer-targets unless a request brings its own; prefer"
        " the environment, CHUNKATTN_TRANSFER_TOKEN (a flag shows in ps)",
    )
    t.add_argument(
        "--transfer-targets",
        default="",
        metavar="HOST:PORT,...",
        help="the targets, exactly as requests name them, that may receive the server's own --transfer-token"
        " and --transfer-tls-cert (to any other target a request must bring its own target_token)",
    )
    t.add_argument(
        "--transfer-tls-ca", metavar="FILE", help="TransferKV reaches its targets over TLS, trusting this CA"
    )
    t.add_argument(
        "--transfer-tls-cert", metavar="FILE", help="the client certificate TransferKV presents (mutual TLS)"
    )
    t.add_argument("--transfer-tls-key", metavar="FILE", help="its private key")
    t.add_argument(
        "--hash-token",
        action="store_true",
        help="read a token on standard input, print its SHA-256 for the token file, and exit",
    )
    m = p.add_argument_group("model (the attention shape; must match the client's model)")
    m.add_argument("--preset", choices=sorted(PRESETS), default="demo", help="start from a known shape (default demo)")
    m.add_argument(
        "--hf-config",
        metavar="FILE",
        help="serve the shape of a Hugging Face config.json (instead of --preset and the flags below)",
    )
    m.add_argument("--layers", type=int, help="number of attention layers")
    m.add_argument("--chunk-size", type=int, help="C of the chunked layers")
    m.add_argument("--global-every", type=int, help="every n-th layer is global (Llama 4: 4; 0: none)")
    m.add_argument("--heads", type=int, help="query heads")
    m.add_argument("--kv-heads", type=int, help="KV heads (heads must be a multiple)")
    m.add_argument("--head-size", type=int, help="head size")
    c = p.add_argument_group("KV cache and device")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    c.add_argument("--kv-memory-mib", type=int, default=1024, help="KV pool budget in MiB (default 1024)")
    c.add_argument("--num-blocks", type=int, help="KV pool size in blocks (overrides --kv-memory-mib)")
    c.add_argument(
        "--spec-window",
        type=int,
        default=0,
        metavar="K",
        help="tokens a chunked layer keeps before its current chunk, so that Truncate can roll a sequence back"
        " K tokens across a chunk boundary (speculative decoding); up to ceil((C + K) / block size) blocks per"
        " sequence and chunked KV group (default 0: the current chunk only)",
    )
    c.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype, and the cache's unless --kv-cache-dtype: auto (bfloat16 on CUDA, float32 on the CPU),"
        " float32, float16 or bfloat16",
    )
    c.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="what the KV cache stores: auto (the compute dtype), float32, float16, bfloat16, or float8 over"
        " per-layer scales: fp8 (= fp8_e4m3) or fp8_e5m2, as vLLM's kv_cache_dtype",
    )
    c.add_argument(
        "--kv-scales",
        metavar="FILE",
        help='a float8 cache\'s per-layer scales: JSON {"k_scale": S or [S per layer], "v_scale": ...}, as a'
        " checkpoint gives them (default 1.0); or the word calibrate: a layer's first K/V written sets them",
    )
    c.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    c.add_argument(
        "--backend",
        default="auto",
        help="attention kernels: auto (triton on CUDA, native on the CPU), torch, native (CPU: decodes in a"
        " native kernel, built on first use; torch where it cannot be), triton",
    )
    return p


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags over environment over config file over defaults."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    defaults: dict[str, Any] = {}
    config_file = first.config or os.environ.get("CHUNKATTN_CONFIG")
    if config_file:
        try:
            with open(config_file) as f:
                data = jsonfile.load(f)
        except (OSError, ValueError) as e:
            parser.error(f"--config {config_file}: {e}")
        if not isinstance(data, dict):
            parser.error(f"--config {config_file}: expected a JSON object of options, got {type(data).__name__}")
        defaults.update(data)
    for action in parser._actions:
        env = os.environ.get("CHUNKATTN_" + action.dest.upper())
        if env is not None and action.dest != "help":
            if isinstance(action.const, bool):  # an on/off flag: CHUNKATTN_BATCHING=false, =0, =no, =off
                if env.strip().lower() not in _BOOLS:
                    parser.error(f"CHUNKATTN_{action.dest.upper()}={env!r}: expected one of {', '.join(_BOOLS)}")
                defaults[action.dest] = _BOOLS[env.strip().lower()]
            else:
                defaults[action.dest] = action.type(env) if callable(action.type) else env
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(defaults) - known - {"layers"})
    if unknown:
        parser.error(f"unknown options in the config file or environment: {unknown}")
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    """Exit with a usage error (status 2) naming the first flag out of range."""
    for flag in ("idle_timeout_s", "grace_s", "drain_delay_s", "max_concurrent_rpcs", "max_message_mib",
                 "kv_import_stall_s", "stream_idle_s", "max_inflight_mib", "max_open_calls",
                 "max_batch_delay_us", "max_call_work"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None and not 0 <= value < math.inf:  # NaN too; 0 is "never" where a flag has a never
            build_parser().error(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {getattr(args, flag)}")
    for flag in ("max_message_mib", "max_batch_tokens"):
        if getattr(args, flag) < 1:
            build_parser().error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_call_work is not None and args.max_call_work > MAX_CALL_WORK:
        build_parser().error(f"--max-call-work must be at most 2^62 ({MAX_CALL_WORK}), got {args.max_call_work}")
    try:
        check_keepalive(args.transfer_keepalive_s)
    except ValueError as e:
        build_parser().error(f"--transfer-keepalive-s: {e}")
