"""deploy/: Envoy's configuration is the generator's, Prometheus's passes promtool, and a real Prometheus
scraping real replicas and a real Envoy answers every Grafana dashboard panel's query with data.

Grafana itself cannot be installed here (no registry, no Debian package): its dashboard is checked by
running each panel's PromQL, as Grafana would send it, against Prometheus.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from chunkattn_client import ChunkAttnClient, kvfile
from chunkattn_client.cli import main as cli
from chunkattn_server.config import DEFAULT_MAX_OPEN_CALLS
from chunkattn_server.tools.cluster import Cluster
from chunkattn_server.tools.envoy import (
    COMPOSE_MAX_OPEN_CALLS,
    COMPOSE_REPLICAS,
    NO_LIMIT,
    compose_envoy_yaml,
    envoy_binary,
    envoy_config,
)
from chunkattn_server.tools.replica_flags import max_open_calls
from tests.helpers.server_process import SMALL, free_port
from tests.helpers.session import Session

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "chunkattn.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = (
    "Debian's prometheus is not installed: `make test` installs it when it runs as root with apt-get"
    " (scripts/install-apt.sh); elsewhere run `apt-get install prometheus`"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("CI"), reason=NO_PROMETHEUS
)  # under CI the test runs, and fails without it


def test_envoy_yaml_is_the_generators_output_and_envoy_accepts_it() -> None:
    assert (DEPLOY / "envoy" / "envoy.yaml").read_text() == compose_envoy_yaml(), (
        "deploy/envoy/envoy.yaml is stale:"
        " python -m chunkattn_server.tools.cluster --envoy-yaml > deploy/envoy/envoy.yaml"
    )
    done = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(DEPLOY / "envoy" / "envoy.yaml"), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def breakers(config: dict[str, Any]) -> dict[str, int]:
    """The circuit-breaker thresholds of an Envoy bootstrap's one cluster."""
    (cluster,) = config["static_resources"]["clusters"]
    (thresholds,) = cluster["circuit_breakers"]["thresholds"]
    return dict(thresholds)


REPLICAS = [("10.0.0.1", 50051, 9400), ("10.0.0.2", 50051, 9400), ("10.0.0.3", 50051, 9400)]


@pytest.mark.parametrize(
    ("per_replica", "replicas", "limit"),
    [(100, 3, 300), (1, 3, 3), (DEFAULT_MAX_OPEN_CALLS, 2, 2 * DEFAULT_MAX_OPEN_CALLS), (0, 3, NO_LIMIT),
     (0, 1, NO_LIMIT), (NO_LIMIT, 3, NO_LIMIT)],
)  # fmt: skip
def test_envoys_circuit_breakers_follow_the_replicas_max_open_calls(
    per_replica: int, replicas: int, limit: int
) -> None:
    config = envoy_config(REPLICAS[:replicas], max_open_calls=per_replica)
    assert breakers(config) == {"max_requests": limit, "max_pending_requests": limit, "max_connections": limit}
    assert limit < 2**32  # Envoy's thresholds are uint32
    with pytest.raises(ValueError, match=">= 0"):
        envoy_config(REPLICAS[:replicas], max_open_calls=-1)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No CHUNKATTN_MAX_OPEN_CALLS or CHUNKATTN_CONFIG from the environment the tests run in."""
    monkeypatch.delenv("CHUNKATTN_MAX_OPEN_CALLS", raising=False)
    monkeypatch.delenv("CHUNKATTN_CONFIG", raising=False)
    return monkeypatch


def test_the_replicas_max_open_calls_is_read_as_the_server_reads_it(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The flag in either form (the last one wins) over CHUNKATTN_MAX_OPEN_CALLS over the --config file."""
    config = tmp_path / "server.json"
    config.write_text(json.dumps({"max_open_calls": 11, "kv_memory_mib": 64}))
    assert max_open_calls([*SMALL, "--num-blocks", "64"]) == DEFAULT_MAX_OPEN_CALLS
    assert max_open_calls(["--max-open-calls", "7"]) == 7
    assert max_open_calls(["--max-open-calls=7"]) == 7
    assert max_open_calls(["--max-open-calls", "0"]) == 0  # no limit
    assert max_open_calls(["--max-open-calls=3", "--max-open-calls", "5"]) == 5
    assert max_open_calls(["--config", str(config)]) == 11
    assert max_open_calls([f"--config={config}", "--max-open-calls", "6"]) == 6
    clean_env.setenv("CHUNKATTN_CONFIG", str(config))
    assert max_open_calls([]) == 11
    clean_env.setenv("CHUNKATTN_MAX_OPEN_CALLS", "9")
    assert max_open_calls(["--config", str(config)]) == 9
    assert max_open_calls(["--max-open-calls=8"]) == 8


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--max-open-calls", "many"], "invalid int value"),
        (["--max-open-calls=-1"], ">= 0"),
        (["--config", "/nonexistent/server.json"], "--config /nonexistent/server.json"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_flags_the_server_would_refuse_are_refused_with_its_reason(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], why: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        max_open_calls(argv)
    with pytest.raises(ValueError, match=re.escape(why)):
        Cluster([(1, 2)], 3, 4, argv, workdir=tmp_path)


def test_a_clusters_envoy_follows_its_replicas_max_open_calls(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cluster = Cluster([(1, 2), (3, 4), (5, 6)], 7, 8, ("--max-open-calls=100",), workdir=tmp_path)
    assert cluster.max_open_calls == 100
    assert breakers(json.loads((tmp_path / "envoy.json").read_text()))["max_requests"] == 300
    clean_env.setenv("CHUNKATTN_MAX_OPEN_CALLS", "0")
    cluster = Cluster([(1, 2), (3, 4)], 7, 8, SMALL, workdir=tmp_path)
    assert cluster.max_open_calls == 0
    assert breakers(json.loads((tmp_path / "envoy.json").read_text()))["max_requests"] == NO_LIMIT


def compose_servers(path: Path) -> dict[str, dict[str, Any]]:
    services = yaml.safe_load(path.read_text())["services"]
    return {name: s for name, s in services.items() if name.startswith("server-")}


def test_the_compose_stacks_envoy_follows_its_replicas_flags(clean_env: pytest.MonkeyPatch) -> None:
    """deploy/envoy/envoy.yaml's circuit breakers are the compose replicas' --max-open-calls, as their
    commands (docker-compose.yml, docker-compose.gpu.yml) give it to them, times the replicas."""
    servers = compose_servers(ROOT / "docker-compose.yml")
    assert sorted(servers) == sorted(host for host, _, _ in COMPOSE_REPLICAS)
    for path in (ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml"):
        for name, service in compose_servers(path).items():
            # ${VAR:-default}: compose's substitution, with the default.
            command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in service.get("command", [])]
            environment = service.get("environment") or {}
            assert "CHUNKATTN_MAX_OPEN_CALLS" not in str(environment), (path.name, name)
            assert "CHUNKATTN_CONFIG" not in str(environment), (path.name, name)
            assert max_open_calls(command) == COMPOSE_MAX_OPEN_CALLS, (path.name, name, command)
    limit = COMPOSE_MAX_OPEN_CALLS * len(COMPOSE_REPLICAS)
    assert breakers(yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text()))["max_requests"] == limit


@needs_prometheus
def test_prometheus_config_passes_promtool() -> None:
    assert PROMTOOL is not None, NO_PROMETHEUS
    done = subprocess.run(
        [PROMTOOL, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def panels() -> list[dict[str, Any]]:
    return list(json.loads(DASHBOARD.read_text())["panels"])


def test_the_dashboard_uses_the_provisioned_data_source_and_covers_what_operators_watch() -> None:
    source = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "chunkattn.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    for p in panels():
        assert p["datasource"]["uid"] == uid
        assert p["description"]
        assert all(t["datasource"]["uid"] == uid for t in p["targets"])
    for metric in (
        "chunkattn_requests_total", "chunkattn_queue_seconds_bucket", "chunkattn_compute_seconds_bucket",
        "chunkattn_kv_blocks_used", "chunkattn_kv_blocks", "chunkattn_active_sequences", "chunkattn_tokens_total",
        "chunkattn_received_bytes_total", "chunkattn_sent_bytes_total", "chunkattn_kv_transfers_total",
        "envoy_cluster_membership_healthy",
    ):  # fmt: skip
        assert metric in exprs, metric


def as_grafana_sends(expr: str) -> str:
    """The query Grafana would send: every replica selected, a rate window of 30 s."""
    return expr.replace("$__rate_interval", "30s").replace('=~"$instance"', '=~".*"')


class Prometheus:
    """A real Prometheus on loopback scraping ``targets`` with deploy/prometheus/prometheus.yml's jobs."""

    def __init__(self, chunkattn: list[str], envoy: str) -> None:
        assert PROMETHEUS is not None, NO_PROMETHEUS
        self.dir = Path(tempfile.mkdtemp(prefix="chunkattn-prometheus-"))
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        jobs["chunkattn"]["static_configs"] = [{"targets": chunkattn}]
        jobs["envoy"]["static_configs"] = [{"targets": [envoy]}]
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}"]
        argv += [f"--web.listen-address={self.url.removeprefix('http://')}"]
        self.log = open(self.dir / "log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def targets_up(self) -> int:
        try:
            return sum(float(s["value"][1]) == 1 for s in self.query("up"))
        except OSError:
            return 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[Cluster, Prometheus]]:
    cluster = Cluster(
        [(free_port(), free_port()) for _ in range(2)], free_port(), free_port(), (*SMALL, "--num-blocks", "2048")
    )
    with cluster:
        prom = Prometheus([f"127.0.0.1:{r.metrics_port}" for r in cluster.replicas], f"127.0.0.1:{cluster.admin_port}")
        try:
            deadline = time.monotonic() + 60
            while prom.targets_up() < 3:
                assert prom.proc.poll() is None, (prom.dir / "log").read_text()
                assert time.monotonic() < deadline, f"{prom.targets_up()} of 3 targets up after 60 s"
                time.sleep(0.5)
            yield cluster, prom
        finally:
            prom.stop()


@pytest.mark.server
@needs_prometheus
@pytest.mark.slow
def test_prometheus_answers_every_dashboard_query_with_data(
    scraped: tuple[Cluster, Prometheus], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, prom = scraped
    argv = ["bench", "--target", cluster.target, "--duration", "4", "--concurrency", "4", "--prompt-len", "20"]
    assert cli([*argv, "--output-len", "8", "--progress", "none"]) == 0, capsys.readouterr()
    with ChunkAttnClient(cluster.target, route="moved", timeout_s=30) as envoy:  # a KV transfer: out, then in
        Session(envoy, "moved", seed=0).step(5)
        kvfile.write(tmp_path / "moved.kv", envoy.export_kv("moved"))
        envoy.import_kv(kvfile.read(tmp_path / "moved.kv"), seq_id="moved-copy")
    queries = [(p["title"], as_grafana_sends(t["expr"])) for p in panels() for t in p["targets"]]
    deadline = time.monotonic() + 30
    while True:
        empty = [
            (title, expr)
            for title, expr in queries
            if not any(not math.isnan(float(s["value"][1])) for s in prom.query(expr))
        ]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, f"panels whose queries return no data: {empty}"
