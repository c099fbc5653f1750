"""benchmarks/engine.py runs end to end at tiny shapes, so the script cannot rot unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    assert "fp8 KV cache" in result.stdout
    for cache in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        row = data["fp8"][cache]
        assert row["step_s"] > 0
        assert row["error_vs_cached"] <= 2e-2 * 4  # bfloat16 compute, against K/V as the cache holds them
    # Quantization shows against the unquantized K/V, more for e5m2's 2 mantissa bits than e4m3's 3.
    assert data["fp8"]["fp8_e5m2"]["error_vs_unquantized"] > data["fp8"]["fp8_e4m3"]["error_vs_unquantized"]
