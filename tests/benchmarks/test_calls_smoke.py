"""benchmarks/calls.py runs end to end with short rounds (four servers as subprocesses), so it cannot rot."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"ours_cps", "ours_nobatch_cps", "echo_cps", "ours_p50_ms", "ours_p99_ms"}
ZMQ_KEYS = {"ours_zmq_cps", "zmq_echo_cps", "ours_zmq_p50_ms", "ours_zmq_p99_ms", "zmq_echo_p50_ms"}
CONTENDERS = ("ours", "ours_nobatch", "echo", "ours_zmq", "zmq_echo")


def test_calls_benchmark_smoke_run_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "calls.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "calls.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "ours/echo" in result.stdout
    data = json.loads(out.read_text())
    assert {"date", "machine", "request_bytes", "response_bytes"} <= set(data)
    assert data["verify_max_abs_err"] <= 1e-5  # the sessions were checked against the float64 reference
    assert set(data["unary"]) == set(data["stream"]) == {"1", "4"}
    for transport in ("unary", "stream"):
        for clients, r in data[transport].items():
            assert set(r) >= KEYS | ZMQ_KEYS, (transport, clients)
            assert all(r[k] > 0 for k in KEYS | ZMQ_KEYS), (transport, clients, r)
            assert r["ours_p50_ms"] <= r["ours_p99_ms"]
            assert r["ours_zmq_p50_ms"] <= r["ours_zmq_p99_ms"]
            assert r["calls_per_step"] >= 1  # the batching server's step histogram was read
            assert r["ours_zmq_calls_per_step"] >= 1  # and the data plane's calls were served in its steps
            assert r["zmq_vs_grpc"] == r["ours_zmq_cps"] / r["ours_cps"]
            assert r["zmq_vs_zmq_echo"] == r["ours_zmq_cps"] / r["zmq_echo_cps"]
            for kind in CONTENDERS:
                assert set(r["cpu_ms_per_call"][kind]) == {kind, "client"}  # /proc exists where CI runs
    # The printed table says what the JSON says: each row's ratios, and a verdict that follows the target.
    rows = re.findall(r"^(unary|stream)\s+(\d+)\s.*?\s(\d+\.\d\d)x\s+(ok|MISS)\s+(\d+\.\d\d)x", result.stdout, re.M)
    assert len(rows) == 4, result.stdout
    for transport, clients, ratio, verdict, on_off in rows:
        r = data[transport][clients]
        assert math.isfinite(float(ratio))
        assert float(ratio) > 0
        assert float(ratio) == round(r["ours_cps"] / r["echo_cps"], 2)
        assert float(on_off) == round(r["ours_cps"] / r["ours_nobatch_cps"], 2)
        assert verdict == ("ok" if r["ours_cps"] / r["echo_cps"] >= 0.6 else "MISS")
    # The data plane's table: its ratios, and verdicts that follow the targets (zmq/grpc judged at 1 client).
    rows = re.findall(
        r"^zmq-(unary|stream)\s+(\d+)\s.*?\s(\d+\.\d\d)x\s+(ok|MISS)?\s*(\d+\.\d\d)x\s+(ok|MISS)\s", result.stdout, re.M
    )
    assert len(rows) == 4, result.stdout
    for transport, clients, vs_grpc, grpc_verdict, vs_echo, echo_verdict in rows:
        r = data[transport][clients]
        assert float(vs_grpc) == round(r["zmq_vs_grpc"], 2)
        assert float(vs_echo) == round(r["zmq_vs_zmq_echo"], 2)
        assert grpc_verdict == (("ok" if r["zmq_vs_grpc"] >= 4 else "MISS") if clients == "1" else "")
        assert echo_verdict == ("ok" if r["zmq_vs_zmq_echo"] >= 0.6 else "MISS")
