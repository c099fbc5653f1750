"""A real chunkattn-server in a subprocess, on free loopback ports, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from types import TracebackType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# A small model with short chunks so tests cross boundaries: 4 layers (3 chunked with C = 16, 1 global).
SMALL = [
    "--layers", "4", "--chunk-size", "16", "--global-every", "4",
    "--heads", "4", "--kv-heads", "2", "--head-size", "16", "--block-size", "4",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connections(pid: int, port: int) -> set[int]:
    """Local ports of the established TCP connections from process ``pid`` to ``port`` (Linux /proc; gRPC's
    sockets are IPv6 ones, with IPv4-mapped addresses for 127.0.0.1)."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                if state == "01" and int(remote.split(":")[1], 16) == port and f"socket:[{inode}]" in sockets:
                    ports.add(int(local.split(":")[1], 16))
    return ports


def metrics_at(port: int) -> Samples:
    """Every sample on the /metrics page of the server whose metrics port is ``port``, read with
    prometheus_client's own parser: {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class ServerProcess:
    """``with ServerProcess(*flags) as server:`` starts, waits for "serving", and stops it with SIGTERM.
    ``python``: the interpreter whose environment has the server (tests/vllm: the project's .venv)."""

    def __init__(
        self, *flags: str, env: dict[str, str] | None = None, startup_s: float = 90.0, python: str = sys.executable
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="chunkattn-server-")  # noqa: SIM115
        cmd = [python, "-m", "chunkattn_server", "--port", str(self.port)]
        cmd += ["--metrics-port", str(self.metrics_port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_s
        while "serving chunkattn.v1.ChunkAttn" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start (exit {self.proc.poll()}):\n{self.log()}")
            time.sleep(0.1)

    def metrics(self) -> Samples:
        return metrics_at(self.metrics_port)

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._log.close()


def counter(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))
