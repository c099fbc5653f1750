"""``chunkattn info`` and ``chunkattn health``: the server's shape, pool and version; its health."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from chunkattn_client.cli.common import EXIT_FAILED, EXIT_OK, connect
from chunkattn_client.client import ChunkAttnError, ServerInfo


def info(args: argparse.Namespace) -> int:
    with connect(args) as c:
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


def health(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    with connect(args) as c:
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
