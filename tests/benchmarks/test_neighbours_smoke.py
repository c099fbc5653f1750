"""benchmarks/neighbours.py runs end to end at a tiny shape (a server subprocess, two tenants), so it cannot rot:
every phase ran, the noisy tenant's loops did what they say (its block and prefill calls were within the work
bound and served; its whole-pool opens were served or refused for the opening rate, never failed otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]


def test_neighbours_benchmark_smoke_run_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "neighbours.json"
    result = subprocess.run(
        [sys.executable, "neighbours.py", "--smoke", "--repeats", "1", "--seconds", "0.5", "--json", str(out)],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["max_call_work"] == 1 << 22  # the server's default on the CPU
    phases = data["phases"]
    assert list(phases) == ["quiet", "open/close", "block work", "prefill work"]
    assert all(p["victim_calls"] > 0 for p in phases.values())
    assert phases["quiet"]["noisy_done"] == 0
    assert phases["open/close"]["noisy_done"] + phases["open/close"]["noisy_refused"] > 0
    for work in ("block work", "prefill work"):
        assert phases[work]["noisy_done"] > 0, phases[work]
        assert phases[work]["noisy_refused"] == 0
    assert "p99/quiet" in result.stdout
