"""chunkattn-server: serve chunked-local attention over gRPC (the flags: flags.py).

The flags become an EngineConfig (the model and its cache) and a ServerConfig (the network, limits and
security), and ``serve`` runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from chunkattn_client import hfconfig
from chunkattn_client.limits import token_problem
from chunkattn_server import malloc
from chunkattn_server.config import (
    CacheConfig,
    EngineConfig,
    LayerSpec,
    ModelShape,
    ServerConfig,
)
from chunkattn_server.errors import ConfigError
from chunkattn_server.flags import PRESETS, build_parser, check, parse
from chunkattn_server.kv.scales import KVScales
from chunkattn_server.server import serve
from chunkattn_server.service.auth import token_digest

log = logging.getLogger("chunkattn_server")

SHAPE_FLAGS = ("layers", "chunk_size", "global_every", "heads", "kv_heads", "head_size")


def hf_model(path: str) -> ModelShape:
    """The model of a Hugging Face config.json; ConfigError when it cannot be served."""
    try:
        layout = hfconfig.load(path)
    except hfconfig.HFConfigError as e:
        raise ConfigError(str(e)) from None
    return ModelShape(
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        layers=tuple(LayerSpec(chunk_size=c) for c in layout.chunk_sizes),
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.hf_config:
        given = [f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if getattr(args, f) is not None]
        if given:
            raise ConfigError(f"--hf-config sets the model's shape; drop {', '.join(given)} or drop --hf-config")
        model = hf_model(args.hf_config)
        return EngineConfig(model, cache_config(args), args.device, args.backend, args.dtype, args.max_call_work)
    shape = dict(PRESETS[args.preset])
    for key in ("chunk_size", "global_every", "heads", "kv_heads", "head_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if isinstance(args.layers, list):  # explicit per-layer specs from a config file
        model = ModelShape(
            num_heads=shape["heads"],
            num_kv_heads=shape["kv_heads"],
            head_size=shape["head_size"],
            layers=tuple(
                LayerSpec(
                    chunk_size=spec.get("chunk_size", 0),
                    kv_source=spec.get("kv_source"),
                    scale=spec.get("scale"),
                    alibi_slopes=tuple(spec["alibi_slopes"]) if spec.get("alibi_slopes") else None,
                )
                for spec in args.layers
            ),
        )
    else:
        model = ModelShape.interleaved(
            num_layers=args.layers if args.layers is not None else shape["layers"],
            chunk_size=shape["chunk_size"],
            global_every=shape["global_every"],
            num_heads=shape["heads"],
            num_kv_heads=shape["kv_heads"],
            head_size=shape["head_size"],
        )
    return EngineConfig(model, cache_config(args), args.device, args.backend, args.dtype, args.max_call_work)


def cache_config(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        memory_bytes=None if args.num_blocks else args.kv_memory_mib << 20,
        dtype=args.kv_cache_dtype,
        scales=KVScales.read(args.kv_scales) if args.kv_scales else None,
        spec_window=args.spec_window,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.hash_token:
        token = sys.stdin.readline().strip()
        problem = token_problem(token, "the token on standard input")
        if problem:
            build_parser().error(f"--hash-token: {problem}")
        print(token_digest(token))
        return 0
    check(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("%s", malloc.keep_freed_memory())
    try:
        server = ServerConfig(
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            max_message_bytes=args.max_message_mib << 20,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            max_open_calls=args.max_open_calls,
            max_inflight_bytes=None if args.max_inflight_mib is None else args.max_inflight_mib << 20,
            stream_idle_s=args.stream_idle_s,
            idle_timeout_s=args.idle_timeout_s,
            grace_s=args.grace_s,
            drain_delay_s=args.drain_delay_s,
            kv_import_stall_s=args.kv_import_stall_s,
            transfer_keepalive_s=args.transfer_keepalive_s,
            batching=args.batching,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_delay_us=args.max_batch_delay_us,
            inline_steps=args.inline_steps,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            auth_tokens=args.auth_tokens,
            transfer_token=args.transfer_token,
            transfer_tls_ca=args.transfer_tls_ca,
            transfer_tls_cert=args.transfer_tls_cert,
            transfer_tls_key=args.transfer_tls_key,
            transfer_targets=tuple(t for t in (x.strip() for x in args.transfer_targets.split(",")) if t),
            data_plane_tcp=args.data_plane_tcp,
            data_plane_ipc=args.data_plane_ipc,
            data_plane_advertise=args.data_plane_advertise,
            data_plane_session_s=args.data_plane_session_s,
        )
        asyncio.run(serve(engine_config(args), server))
    except (ConfigError, OSError) as e:
        log.error("cannot start: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
