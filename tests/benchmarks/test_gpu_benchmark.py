"""benchmarks/gpu.py --dry-run: the GPU script's code paths at tiny shapes on the CPU, under the interpreter,
so the script a lent GPU runs cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_dry_run_checks_times_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["dry_run"] is True
    assert [c["case"] for c in data["checks"]] == [
        "scout heads, float16", "scout heads, float32", "head size 64, GQA 4", "ALiBi, chunked and global",
    ]  # fmt: skip
    assert set(data["prefill"]["seconds"]) == {"triton", "torch", "flex", "sdpa_per_chunk"}
    assert set(data["decode"]["seconds"]) == {
        "triton", "triton_prepare_and_run", "torch", "sdpa_contiguous", "triton_fp8_e4m3",
    }  # fmt: skip
    assert all(t > 0 for t in [*data["prefill"]["seconds"].values(), *data["decode"]["seconds"].values()])
    assert data["decode"]["max_error_vs_sdpa"] < 1e-2  # the kernels against SDPA on a contiguous copy
    assert data["decode"]["graph"] == {"captured": False, "matches_eager": None}  # no CUDA here
    fp8 = data["decode"]["fp8_e4m3"]  # the same pages as an e4m3 cache, against their dequantized values
    assert fp8["max_error_vs_dequantized"] < 2e-2
    assert fp8["speedup"] > 0
    assert 0 < fp8["k_scale"] < 1
    assert 0 < fp8["v_scale"] < 1
    assert data["decode"]["kv_gbps"]["triton_fp8_e4m3"] > 0
    assert "float8 e4m3 cache (k_scale" in result.stdout
    assert "flex / triton" in result.stdout
    assert "not measured: a dry run" in result.stdout
