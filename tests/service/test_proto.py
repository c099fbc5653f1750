"""The checked-in generated code is exactly what `make proto` produces from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    fresh = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in (tmp_path / "chunkattn_client" / "_pb").rglob("*")
        if p.is_file()
    }
    checked_in_root = ROOT / "client"
    checked_in = {
        p.relative_to(checked_in_root): p.read_bytes()
        for p in (checked_in_root / "chunkattn_client" / "_pb").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sorted(fresh) == sorted(checked_in), "files differ: run `make proto`"
    stale = [str(p) for p in fresh if fresh[p] != checked_in[p]]
    assert not stale, f"stale generated code (run `make proto`): {stale}"
