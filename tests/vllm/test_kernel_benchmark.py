"""benchmarks/vllm_kernel.py (``make bench-vllm``) runs end to end at tiny shapes, so it cannot rot unnoticed: on
every row vLLM's kernel and ours give the same answers over caches that hold the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")


def isa(compute: str, cache: str) -> str:
    """The ISA vLLM's CPU attention picks here for a row (32 keys a block, the smoke run's head size 32)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(getattr(torch, compute), 32, 32, cache))


def test_kernel_benchmark_smoke_run_agrees_with_vllm_on_every_row(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    paths = [str(ROOT / "server"), *filter(None, [os.environ.get("PYTHONPATH")])]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vllm_kernel.py"), "--smoke", "--repeats", "1", "--json", str(out)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    decode = {
        ("decode", compute, cache, layout)
        for compute, cache in (
            ("float32", "auto"),
            ("bfloat16", "auto"),
            ("bfloat16", "fp8_e4m3"),
            ("bfloat16", "fp8_e5m2"),
        )
        for layout in ("allocator", "scattered")
    }
    prefill = {("prefill", compute, "auto", "-") for compute in ("float32", "bfloat16")}
    rows = data["rows"]
    assert {(r["kind"], r["compute"], r["cache"], r["layout"]) for r in rows} == decode | prefill
    ours = {"torch"} if data["native_unavailable"] else {"torch", "native"}
    for r in rows:
        assert set(r["seconds"]) == {"vllm"} | ours, r
        assert r["agree"], r
        assert r["isa"] == isa(r["compute"], r["cache"]), r  # the ISA the row ran with: bfloat16 on AMX where there is
        # ours too: "amx" only in a bfloat16 compute with the AMX build loaded, "-" without the native backend
        assert r["ours_isa"] in ({"-"} if data["native_unavailable"] else {"amx", "vec"}), r
        if r["ours_isa"] == "amx":
            assert r["compute"] == "bfloat16", r
            assert data["native_build"] == "AMX", r
        # every decode row's caches compared bit for bit, whatever the ISA's layout (the benchmark learns it)
        assert r["same_cache"] is (True if r["kind"] == "decode" else None), r
