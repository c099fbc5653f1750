"""The house's import rules, checked on the source (what each module imports itself) and by importing:

- gRPC and protobuf stop at the service edge: nothing in engine/, kv/ or attention/ imports grpc, protobuf,
  the generated stubs, the wire codecs, the client's transport or the service; errors.py and config.py import
  neither grpc nor torch (they are shared by every layer);
- the block pool and the retention rule are plain Python: importing them imports no torch;
- what the server and the clients share (the client's dtypes, limits, batch and work, and the core modules that
  import them) loads no grpc or protobuf, and ``import chunkattn_client`` loads the client itself only on use;
- no tenant (nor the pool's account) has a default below the service.
(The client's own rule, no torch in ``import chunkattn_client``, is tests/client/test_client_thin.py.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "server" / "chunkattn_server"
CORE = ("engine", "kv", "attention")
TRANSPORT = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "google.protobuf",
    "chunkattn_client._pb",
    "chunkattn_client.wire",
    "chunkattn_client.codec",
    "chunkattn_client.client",
    "chunkattn_client.aio",
    "chunkattn_client._channel",
    "chunkattn_client._errors",
    "chunkattn_server.service",
    "chunkattn_server.server",
    "chunkattn_server.http",
    "chunkattn_server.reflection",
    "chunkattn_server.tools",
)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``from a import b`` counts as a and a.b); relative
    imports are refused outright: they would hide where an arrow goes."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import (from {'.' * node.level}{node.module or ''})"
            assert node.module is not None
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def banned(found: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in found if any(m == p or m.startswith(p + ".") for p in prefixes))


def core_modules() -> list[Path]:
    return sorted(p for layer in CORE for p in (PACKAGE / layer).rglob("*.py"))


def test_the_rule_sees_what_it_must() -> None:
    """The checker itself: the core has modules, and a service module would break the rule."""
    assert len(core_modules()) >= 12
    assert banned(imports(PACKAGE / "service" / "attend.py"), TRANSPORT)


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_core_imports_no_grpc_protobuf_or_service(path: Path) -> None:
    assert not banned(imports(path), TRANSPORT), f"{path.relative_to(PACKAGE)} reaches the transport"


@pytest.mark.parametrize("name", ["errors.py", "config.py", "jsonfile.py", "kv/scales.py", "kv/block_pool.py"])
def test_shared_plain_modules_import_neither_grpc_nor_torch(name: str) -> None:
    assert not banned(imports(PACKAGE / name), (*TRANSPORT, "torch", "triton"))


def test_the_block_pool_and_the_retention_rule_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import chunkattn_server.kv.block_pool, chunkattn_server.kv.sequences, chunkattn_server.kv.scales\n"
        "import chunkattn_server.errors, chunkattn_server.config\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing them pulled in {result.stdout.strip()}\n{result.stderr}"


# What the server and the clients both need loads neither gRPC, nor protobuf, nor torch: the
# retention rule, the pool and the step queue import the client's dtypes, limits, batch and work, whose package
# imports the client itself lazily.
TRANSPORT_FREE = {
    "chunkattn_server.kv.sequences": ("grpc", "google.protobuf", "torch"),
    "chunkattn_server.kv.block_pool": ("grpc", "google.protobuf", "torch"),
    "chunkattn_server.engine.step_queue": ("grpc", "google.protobuf", "torch"),
    "chunkattn_client": ("grpc", "google.protobuf", "torch", "zmq"),
    "chunkattn_client.dataplane": ("grpc", "google.protobuf", "torch", "zmq"),
    "chunkattn_client.dtypes": ("grpc", "google.protobuf", "torch"),
    "chunkattn_client.limits": ("grpc", "google.protobuf", "torch"),
    "chunkattn_client.batch": ("grpc", "google.protobuf", "torch"),
    "chunkattn_client.work": ("grpc", "google.protobuf", "torch"),
}


@pytest.mark.parametrize("module", sorted(TRANSPORT_FREE))
def test_shared_modules_load_no_grpc_or_protobuf(module: str) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        f"loaded = sorted({{p for p in {TRANSPORT_FREE[module]!r} for m in sys.modules"
        " if m == p or m.startswith(p + '.')})\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {module} pulled in {result.stdout.strip()}\n{result.stderr}"


def test_the_client_package_still_gives_its_names() -> None:
    """Lazy, but whole: ``from chunkattn_client import X`` works for every name of ``__all__`` (and loads gRPC
    only then)."""
    code = (
        "import sys, chunkattn_client\n"
        "assert 'grpc' not in sys.modules\n"
        "from chunkattn_client import ChunkAttnClient\n"
        "assert 'grpc' in sys.modules and ChunkAttnClient.__module__ == 'chunkattn_client.client'\n"
        "for name in chunkattn_client.__all__:\n"
        "    exec(f'from chunkattn_client import {name}')\n"
        "assert set(chunkattn_client.__all__) <= set(dir(chunkattn_client))\n"
        "try:\n"
        "    from chunkattn_client import NoSuchName\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    sys.exit('an unknown name imported')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# -- the tenant: required below the service ------------------------------------------------------------

OWNER_NAMES = ("tenant", "account")


def defaulted_owners(path: Path) -> list[str]:
    """Where ``path`` gives a tenant (or the pool's ``account``) a default: a parameter or a class field."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            with_default = positional[len(positional) - len(a.defaults) :]
            with_default += [arg for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
            found += [f"{node.name}({arg.arg}=...)" for arg in with_default if arg.arg in OWNER_NAMES]
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                target = item.target if isinstance(item, ast.AnnAssign) and item.value is not None else None
                if isinstance(target, ast.Name) and target.id in OWNER_NAMES:
                    found.append(f"{node.name}.{target.id} = ...")
    return found


def test_the_tenant_check_sees_a_default(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class A:\n    tenant: str = ''\n"
        "def f(x, tenant=''): ...\n"
        "def g(x, *, account: str = ''): ...\n"
        "def h(x, *, tenant: str): ...\n"
    )
    assert defaulted_owners(sample) == ["A.tenant = ...", "f(tenant=...)", "g(account=...)"]


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_tenant_has_a_default_below_the_service(path: Path) -> None:
    """A forgotten tenant must be a TypeError, never a call in the anonymous namespace ("")."""
    assert not defaulted_owners(path), f"{path.relative_to(PACKAGE)}: {defaulted_owners(path)}"


def module_graph() -> dict[str, set[str]]:
    """Every module of the server and the server modules it imports anywhere (a ``TYPE_CHECKING`` import too:
    a circle of types is still a circle to read); ``from a import b`` points at a.b where that is a module."""
    names = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        found = imports(path)
        graph[name] = {m for m in found if m in names and m != name and not any(f"{m}." in f for f in found)}
        graph[name] |= {m for m in found if m in names and m != name and m.rsplit(".", 1)[0] not in found}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_circle_of_imports_in_the_server() -> None:
    """engine/blocks.py once imported engine/core.py back (for its types); config.py and kv/scales.py each other."""
    assert circles(module_graph()) == []
