"""benchmarks/transport.py runs end to end at tiny payloads (real server and echo as subprocesses)."""

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


def test_transport_benchmark_smoke_run_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "transport.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "ours/echo" in result.stdout
    data = json.loads(out.read_text())
    assert {"date", "machine"} <= set(data)
    for mode in ("unary", "stream"):
        sizes = data[mode]
        assert sizes, f"no payload sizes under {mode!r}"
        for nbytes, r in sizes.items():
            assert int(nbytes) > 0
            assert {"ours_mbps", "echo_mbps"} <= set(r)
            assert r["ours_mbps"] > 0
            assert r["echo_mbps"] > 0
    assert set(data["unary"]) == set(data["stream"])
    kv = data["kv_transfer"]
    assert kv["kv_bytes"] > 0
    assert kv["stream_bytes"] > kv["kv_bytes"]  # K/V plus headers and checksums
    assert kv["ours_mbps"] > 0
    assert kv["echo_mbps"] > 0
    assert set(kv["cpu_ms"]["ours"]) == {"source", "target", "client"}  # /proc exists where CI runs
    assert all(ms >= 0 for ms in kv["cpu_ms"]["ours"].values())  # /proc counts 10 ms ticks: a smoke run may read 0
    assert set(kv["engine_cpu_ms"]) == {"export", "import"}
    assert all(ms > 0 for ms in kv["engine_cpu_ms"].values())  # thread_time: fine-grained, never 0 for real work
    # The printed table says what the JSON says: ratios, and verdicts that follow the 0.8x target (1 MiB up).
    rows = re.findall(r"^(unary|stream|kv)\s.*?\s(\d+\.\d\d)x\s+(ok|MISS|-)\s*$", result.stdout, re.M)
    expected = [(m, r) for m in ("unary", "stream") for r in data[m].values()] + [("kv", kv)]
    assert len(rows) == len(expected), result.stdout
    for (mode, ratio, verdict), (want_mode, r) in zip(rows, expected, strict=True):
        exact = r["ours_mbps"] / r["echo_mbps"]
        assert mode == want_mode
        assert math.isfinite(exact)
        assert exact > 0
        assert float(ratio) == round(exact, 2)
        if verdict != "-":
            assert verdict == ("ok" if exact >= 0.8 else "MISS")
