"""``chunkattn-server``: builds the engine for the configured model and reports it.

The gRPC service (issue #3) is wired here next; until then this command allocates the KV pool for the
demo model, prints what it would serve, and exits.
"""

from __future__ import annotations

import argparse
import logging
import sys

from chunkattn_server.config import DEVICES, CacheConfig, EngineConfig, demo_model
from chunkattn_server.engine import Engine
from chunkattn_server.errors import ConfigError

log = logging.getLogger("chunkattn_server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkattn-server", description=__doc__)
    parser.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)} or cuda:N (default: auto)")
    parser.add_argument("--kv-memory-mib", type=int, default=1024, help="KV pool budget in MiB (default: 1024)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(
            EngineConfig(demo_model(), CacheConfig(memory_bytes=args.kv_memory_mib << 20), device=args.device)
        )
    except ConfigError as e:
        log.error("bad configuration: %s", e)
        return 2
    model = engine.config.model
    stats = engine.stats()
    log.info(
        "engine ready on %s: %d layers (chunk sizes %s), %d heads / %d KV heads, head size %d, %s cache,"
        " %d blocks of %d tokens",
        engine.device,
        model.num_layers,
        [spec.chunk_size for spec in model.layers],
        model.num_heads,
        model.num_kv_heads,
        model.head_size,
        str(engine.dtype).removeprefix("torch."),
        stats.num_blocks,
        stats.block_size,
    )
    log.info("the gRPC service arrives with issue #3; nothing to listen on yet, exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
