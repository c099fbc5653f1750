"""benchmarks/engine.py runs end to end at tiny shapes, so the script cannot rot unnoticed."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_benchmark_smoke_run_writes_the_documented_json(tmp_path: Path) -> None:
    # FlexAttention is skipped: compiling it takes ~30 s even at tiny shapes; the full run covers it.
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "engine.py"),
            "--smoke",
            "--no-flex",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for section in ("prefill", "decode", "memory"):
        assert section in result.stdout
    data = json.loads(out.read_text())
    for dtype in ("float32", "bfloat16"):
        assert set(data["prefill"][dtype]) >= {"ours_s", "sdpa_per_chunk_s", "full_causal_s", "flex_s"}
        assert set(data["decode"][dtype]) >= {"ours_s", "sdpa_contiguous_s", "kv_gbps", "copy_gbps"}
        assert all(v is None or v > 0 for v in data["prefill"][dtype].values())
    assert data["memory"]["blocks_held"] <= data["memory"]["bound"]
    # The native backend runs beside torch on every row where it builds; where it does not, the run says why.
    native = data["native"]
    if native["available"]:
        for dtype in ("float32", "bfloat16"):
            assert data["prefill"][dtype]["native_vs_torch"] > 0
            assert data["prefill"][dtype]["native_pieces_vs_torch"] > 0
            assert data["decode"][dtype]["native_vs_torch"] > 0
            assert data["decode"][dtype]["native_scattered_vs_torch"] > 0
        for cache in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
            assert data["fp8"][cache]["native_vs_torch"] > 0
            assert data["fp8"][cache]["native_error_vs_cached"] <= 2e-2 * 4
        assert "nat/torch" in result.stdout
    else:
        assert native["reason"] in result.stdout
    assert "fp8 KV cache" in result.stdout
    for cache in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        row = data["fp8"][cache]
        assert row["step_s"] > 0
        assert row["error_vs_cached"] <= 2e-2 * 4  # bfloat16 compute, against K/V as the cache holds them
    # Quantization shows against the unquantized K/V, more for e5m2's 2 mantissa bits than e4m3's 3.
    assert data["fp8"]["fp8_e5m2"]["error_vs_unquantized"] > data["fp8"]["fp8_e4m3"]["error_vs_unquantized"]
    # The printed verdicts follow the targets from the JSON's own numbers (ours/ideal <= 1.15, full/ours >= 3
    # for prefill; ours/contiguous <= 1.2 for decode; the memory bound), and every ratio is finite.
    for dtype, p in data["prefill"].items():
        ratio, full = p["ours_s"] / p["sdpa_per_chunk_s"], p["full_causal_s"] / p["ours_s"]
        assert math.isfinite(ratio)
        assert math.isfinite(full)
        row = re.search(rf"^{dtype}\s.*?\s(\d+\.\d+)\s+(ok|MISS)\s.*?\s(\d+\.\d\d)x\s+(ok|MISS)", result.stdout, re.M)
        assert row, result.stdout
        assert float(row[1]) == round(ratio, 3)
        assert row[2] == ("ok" if ratio <= 1.15 else "MISS")
        assert float(row[3]) == round(full, 2)
        assert row[4] == ("ok" if full >= 3 else "MISS")
    decode_part = result.stdout.split("decode (", 1)[1]
    for dtype, d in data["decode"].items():
        ratio = d["ours_s"] / d["sdpa_contiguous_s"]
        row = re.search(rf"^{dtype}\s.*?ms\s+(\d+\.\d+)\s+(ok|MISS)", decode_part, re.M)
        assert row, decode_part
        assert float(row[1]) == round(ratio, 3)
        assert row[2] == ("ok" if ratio <= 1.2 else "MISS")
    memory = data["memory"]
    assert ("ok" if memory["peak_blocks"] <= memory["bound"] else "MISS") in result.stdout.split("memory:", 1)[1]
