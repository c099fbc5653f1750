"""deploy/: Envoy's configuration is the generator's, Prometheus's passes promtool, and a real Prometheus
scraping real replicas and a real Envoy answers every Grafana dashboard panel's query with data.

Grafana itself cannot be installed here (no registry, no Debian package): its dashboard is checked by
running each panel's PromQL, as Grafana would send it, against Prometheus.
"""

from __future__ import annotations

import json
import math
import os
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
from chunkattn_server.tools.cluster import Cluster, compose_envoy_yaml, envoy_binary
from tests.server_process import SMALL, free_port
from tests.test_topology import Session

ROOT = Path(__file__).resolve().parents[1]
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
