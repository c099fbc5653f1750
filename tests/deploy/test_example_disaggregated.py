"""examples/disaggregated_prefill_decode.py runs end to end (small model, short prompt) and finds equality."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.server_process import SMALL

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]


def test_the_disaggregated_example_moves_kv_and_decodes_bit_for_bit() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "disaggregated_prefill_decode.py"),
         "--tokens", "90", "--decode", "12", "--piece", "32", "--", *SMALL],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "prefilled 90 tokens" in result.stdout
    assert "outputs equal bit for bit: True" in result.stdout
    assert "this moved" in result.stdout
