"""What every ``chunkattn`` subcommand shares: the exit codes, the flags that say where the server is and
how to talk to it, and the client made from them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from chunkattn_client.client import ChunkAttnClient

DEFAULT_TARGET = os.environ.get("CHUNKATTN_TARGET", "localhost:50051")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MISMATCH = 0, 1, 2, 3


def add_connection(c: argparse.ArgumentParser) -> None:
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


def credentials(args: argparse.Namespace) -> dict[str, Any]:
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


def connect(args: argparse.Namespace, route: str | None = None) -> ChunkAttnClient:
    """A client for the flags; its route is --route, else ``route`` (None: a random one)."""
    route = args.route if args.route is not None else route
    return ChunkAttnClient(args.target, timeout_s=args.timeout, route=route, **credentials(args))
