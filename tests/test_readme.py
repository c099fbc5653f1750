"""The README's examples run as printed, and their outputs agree with the reference."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from tests.server_process import ServerProcess

README = Path(__file__).resolve().parents[1] / "README.md"


def _example(marker: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"the README should have one python example with {marker!r}"
    return str(blocks[0])


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    return out.getvalue()


def test_readme_engine_example_runs_and_matches_the_reference() -> None:
    printed = _run(_example("Engine("))
    errors = [float(line.rsplit(" ", 1)[1]) for line in printed.splitlines() if line[:1].isdigit()]
    assert len(errors) == 16
    assert max(errors) < 1e-5


def test_readme_client_example_against_the_demo_server() -> None:
    """The client example, against `chunkattn-server` with its defaults (a smaller pool, to start fast)."""
    with ServerProcess("--kv-memory-mib", "64") as server:
        printed = _run(_example("ReferenceModel.for_server(").replace("127.0.0.1:50051", server.target))
    lines = printed.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"position {p}" for p in (0, 100, 101, 102)]
    assert all(float(line.rsplit(" ", 1)[1]) < 1e-5 for line in lines[:4])
    assert lines[4] == "released 1"
