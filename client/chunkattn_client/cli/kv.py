"""``chunkattn kv``: export a sequence's KV to a file, import one, transfer it between servers, fork it."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import time
from typing import Any

from chunkattn_client.cli.common import EXIT_OK, connect


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise ValueError(f"--layers: expected comma-separated layer numbers, got {text!r}") from None


def kv_export(args: argparse.Namespace) -> int:
    from chunkattn_client import kvfile

    with connect(args, args.seq_id) as c:
        start = time.perf_counter()
        messages = c.export_kv(args.seq_id, layers=_layers(args.layers))
        counted = _Counted(messages)
        try:
            count, size = kvfile.write(args.out, counted)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(args.out)  # no half-written export left behind
            raise
    print(
        f"exported {args.seq_id!r}: {counted.records} blocks, {counted.kv_bytes} bytes of K/V in {count}"
        f" messages ({size} bytes) to {args.out} in {time.perf_counter() - start:.2f} s"
    )
    return EXIT_OK


class _Counted:
    """Passes KV stream messages through, counting their blocks and K/V bytes."""

    def __init__(self, messages: Any) -> None:
        self._messages = messages
        self.records = self.kv_bytes = 0

    def __iter__(self) -> Any:
        for message in self._messages:
            for b in message.blocks.blocks:
                self.records += 1
                self.kv_bytes += len(b.k) + len(b.v)
            yield message


def kv_import(args: argparse.Namespace) -> int:
    from chunkattn_client import kvfile

    if not os.path.exists(args.file):
        raise ValueError(f"no such file: {args.file}")
    messages = kvfile.read(args.file)
    first = next(messages, None)  # the header names the exported sequence: the route of the new one by default
    route = args.seq_id or (first.header.seq_id if first is not None and first.HasField("header") else None)
    with connect(args, route) as c:
        start = time.perf_counter()
        r = c.import_kv(itertools.chain([] if first is None else [first], messages), seq_id=args.seq_id)
    print(
        f"imported {r.seq_id!r}: {r.blocks} blocks allocated, {r.records} received ({r.bytes} bytes of K/V)"
        f" in {time.perf_counter() - start:.2f} s"
    )
    return EXIT_OK


def kv_transfer(args: argparse.Namespace) -> int:
    with connect(args, args.seq_id) as c:
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


def kv_fork(args: argparse.Namespace) -> int:
    with connect(args, args.parent) as c:  # the child lives where its parent does
        shared = c.fork(args.parent, args.child)
    print(f"forked {args.parent!r} into {args.child!r}: {shared} blocks shared copy-on-write")
    return EXIT_OK
