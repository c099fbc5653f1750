"""The README's engine example runs as printed, and its outputs agree with the reference."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_engine_example_runs_and_matches_the_reference() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README lost its engine example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md", "exec"), {})
    errors = [float(line.rsplit(" ", 1)[1]) for line in out.getvalue().splitlines() if line[:1].isdigit()]
    assert len(errors) == 16
    assert max(errors) < 1e-5
