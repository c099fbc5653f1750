"""The service's one door into the engine: the Engine's control-plane methods (engine/core.py), each run as a
job through the scheduler. No module of service/, nor server.py, reaches past them into the engine's parts:
``.kv`` (sequences, spaces, quotas), ``.transfer`` (export and import), ``.scales`` (read on the engine
thread only: Scheduler.scales is the snapshot others read) or ``.pool``.

The rule is on the source (AST): any attribute of those names, on anything, is refused, because the service
cannot tell an engine from another object by its name (``e``, ``engine``, ``worker.engine`` ...). The few
attributes of those names that are not the engine's are listed below, each by its module and its source text.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "server" / "chunkattn_server"
PARTS = frozenset({"kv", "transfer", "scales", "pool"})

# Not the engine's: (module, source text) -> what it is.
ALLOWED = {
    ("service/kvwire.py", "m.scales"): "a KVManifest's scales (what an export carries), not the engine's",
}


def reaches(path: Path) -> list[str]:
    """Where ``path`` reads an attribute named for an engine part, as 'line: source'."""
    source = path.read_text()
    nodes = [n for n in ast.walk(ast.parse(source, str(path))) if isinstance(n, ast.Attribute) and n.attr in PARTS]
    return [f"{n.lineno}: {ast.get_source_segment(source, n)}" for n in sorted(nodes, key=lambda n: n.lineno)]


def edge_modules() -> list[Path]:
    return sorted([*(PACKAGE / "service").rglob("*.py"), PACKAGE / "server.py"])


def test_the_rule_sees_what_it_must(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(e, worker):\n"
        "    e.kv.release(['a'], tenant='')\n"
        "    worker.engine.scales.of(0)\n"
        "    x = e.transfer\n"
        "    e.pool.num_blocks = 3\n"
        "    e.release(['a'], tenant='')\n"
    )
    assert reaches(sample) == ["2: e.kv", "3: worker.engine.scales", "4: e.transfer", "5: e.pool"]
    assert len(edge_modules()) >= 10


@pytest.mark.parametrize("path", edge_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_service_goes_through_the_engines_door(path: Path) -> None:
    name = str(path.relative_to(PACKAGE))
    found = [f for f in reaches(path) if (name, f.split(": ", 1)[1]) not in ALLOWED]
    assert not found, f"{name} reaches past the Engine's control plane: {found}"


def test_every_allowance_is_still_needed() -> None:
    """An allowance whose access went away goes too (so the list never hides a new one)."""
    for module, text in ALLOWED:
        assert text in [f.split(": ", 1)[1] for f in reaches(PACKAGE / module)], (module, text)
