"""benchmarks/decode_isa.py runs end to end at tiny shapes, so the script cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.harness import NATIVE_PROBLEM

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.native
@pytest.mark.skipif(bool(NATIVE_PROBLEM), reason=NATIVE_PROBLEM or "built")
def test_decode_isa_smoke_run_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "isa.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT / 'benchmarks'}"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_isa.py"), "--smoke", "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert {r["page"] for r in data["rows"]} == {"float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"}
    for row in data["rows"]:
        assert row["vector_s"] > 0
        if data["amx"] and row["page"] != "float32":  # the tiles ran beside the vector units, and agree
            assert row["tiles_s"] > 0
            assert row["max_diff"] <= 2e-2
            min_heads = data["amx_min_heads"][row["page"].replace("fp8_", "float8_").replace("e4m3", "e4m3fn")]
            assert row["default"] == ("tiles" if row["heads_per_kv"] >= min_heads else "vector")
        else:
            assert row["tiles_s"] is None
            assert row["default"] == "vector"
    assert data["build"] in result.stdout
