"""The ``chunkattn`` command: ``info``, ``health``, ``kv`` and ``bench`` against a running server.

    chunkattn info --target localhost:50051
    chunkattn health --target localhost:50051 --wait 60
    chunkattn bench --target localhost:50051 --concurrency 8 --duration 30 --html report.html
    chunkattn kv transfer --target prefill:50051 seq-1 --to decode:50051 --release

Exit codes: 0 success; 1 failed calls (bench; unless --allow-errors), not serving (health), or a refused
request (kv); 2 bad arguments or no server to talk to; 3 bench --verify found outputs that differ from the
reference or checked fewer calls than asked.

This module owns ``main``: parse, run the subcommand, map errors to exit codes. The rest: ``parser``
(every subcommand's flags), ``common`` (exit codes, connection flags and credentials, ``connect``),
``info`` (info and health), ``kv`` (kv export, import, transfer, fork) and ``bench`` (bench runs, sweeps
and their outputs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from google.protobuf.message import DecodeError

from chunkattn_client.bench.promtext import MetricsError
from chunkattn_client.cli.common import EXIT_FAILED, EXIT_USAGE
from chunkattn_client.cli.parser import build_parser
from chunkattn_client.client import ChunkAttnError


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
    """The command's argument parser (tests/deploy/test_docs.py checks the docs' commands against it)."""
    return build_parser()
