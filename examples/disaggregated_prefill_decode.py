"""Disaggregated prefill/decode with chunkattn: prefill on one server, move the KV, decode on another.

Starts two chunkattn servers on the CPU (the demo model unless told otherwise), prefills a 20,000-token
sequence on the first, transfers its live KV to the second with TransferKV (server to server), decodes
64 tokens on the second and the same 64 on the first, and checks that the outputs are equal bit for bit.
It prints the bytes moved against what moving the whole KV would cost: chunked layers only send their
current chunk.

    python examples/disaggregated_prefill_decode.py [--tokens 20000] [--decode 64] [-- server flags...]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

import numpy as np

from chunkattn_client import BatchEntry, ChunkAttnClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A chunkattn-server subprocess on a free port; stopped with SIGTERM."""

    def __init__(self, flags: list[str]) -> None:
        self.target = f"127.0.0.1:{free_port()}"
        port = self.target.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "chunkattn_server", "--port", port, "--metrics-port", "0", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with ChunkAttnClient(self.target, timeout_s=5) as c:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if c.health() == "SERVING":
                        break
                except Exception:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the server did not start: {self.proc.stderr.read() if self.proc.stderr else ''}"
                        ) from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20_000, help="prompt length (default 20,000)")
    parser.add_argument("--decode", type=int, default=64, help="tokens to decode (default 64)")
    parser.add_argument("--piece", type=int, default=4096, help="prefill piece size (default 4,096)")
    parser.add_argument("server_flags", nargs="*", help="flags for both servers (after --)")
    args = parser.parse_args()
    with ExitStack() as stack:
        prefill_server, decode_server = Server(args.server_flags), Server(args.server_flags)
        stack.callback(prefill_server.stop)
        stack.callback(decode_server.stop)
        p = stack.enter_context(ChunkAttnClient(prefill_server.target, timeout_s=600))
        d = stack.enter_context(ChunkAttnClient(decode_server.target, timeout_s=600))
        info = p.info()
        chunks = sorted({x.chunk_size for x in info.layers})
        print(
            f"prefill server {prefill_server.target}, decode server {decode_server.target}: {len(info.layers)} layers"
            f" (chunk sizes {chunks}; 0 is global), {info.num_heads}/{info.num_kv_heads} heads of {info.head_size},"
            f" {info.cache_dtype} cache, blocks of {info.block_size}"
        )
        rng = np.random.default_rng(0)

        def step(clients: list[ChunkAttnClient], position: int, n: int) -> list[list[Any]]:
            outs: list[list[Any]] = [[] for _ in clients]
            for layer in range(len(info.layers)):
                q = rng.standard_normal((n, info.num_heads, info.head_size), dtype=np.float32)
                k, v = (rng.standard_normal((n, info.num_kv_heads, info.head_size), dtype=np.float32) for _ in range(2))
                for i, c in enumerate(clients):
                    outs[i].append(c.attend(layer, [BatchEntry("req-1", position, n)], q, k, v))
            return outs

        start = time.perf_counter()
        for pos in range(0, args.tokens, args.piece):
            step([p], pos, min(args.piece, args.tokens - pos))
        print(f"prefilled {args.tokens:,} tokens on the prefill server in {time.perf_counter() - start:.1f} s")

        moved = p.transfer_kv("req-1", decode_server.target)
        bytes_per_token = 2 * info.num_kv_heads * info.head_size * (4 if info.cache_dtype == "float32" else 2)
        writing = sum(1 for x in info.layers if x.kv_source is None)
        full = args.tokens * bytes_per_token * writing
        print(
            f"transferred the live KV: {moved.records:,} blocks, {moved.bytes:,} bytes in {moved.seconds:.2f} s"
            f" ({moved.bytes / moved.seconds / 1e6:.0f} MB/s)"
        )
        print(
            f"moving all KV would take {full:,} bytes: this moved {100 * moved.bytes / full:.1f}% of it"
            " (chunked layers send only their current chunk)"
        )

        same = True
        for i in range(args.decode):
            at_prefill, at_decode = step([p, d], args.tokens + i, 1)
            same &= all(np.array_equal(x, y) for x, y in zip(at_prefill, at_decode, strict=True))
        print(
            f"decoded {args.decode} tokens on the decode server and the same {args.decode} on the prefill server:"
            f" outputs equal bit for bit: {same}"
        )
        p.release(["req-1"])
        d.release(["req-1"])
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("CHUNKATTN_IDLE_TIMEOUT_S", "0")
    sys.exit(main())
