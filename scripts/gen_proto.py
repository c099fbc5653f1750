"""Generate the Python stubs of proto/chunkattn/v1/*.proto under OUT/chunkattn_client/_pb/ (OUT: client/).

One protoc run (grpc_tools' bundled protoc) writes messages (`*_pb2.py`), their typing stubs (`*.pyi`), the
gRPC stubs (`*_pb2_grpc.py`) and mypy stubs for those (mypy-protobuf). `make proto` runs it on client/;
tests/service/test_proto.py runs it into a temporary directory and compares, so the checked-in code cannot drift.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


def generate(out: Path) -> None:
    bin_dir = Path(sys.executable).parent
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    args = [
        "protoc",
        f"-Ichunkattn_client/_pb={ROOT / 'proto'}",  # package-qualified imports in the generated code
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        *(f"chunkattn_client/_pb/{p}" for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for package in (out / "chunkattn_client" / "_pb").rglob("*"):
        if package.is_dir():
            (package / "__init__.py").touch()
    (out / "chunkattn_client" / "_pb" / "__init__.py").touch()


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "client")
    if target.resolve() == (ROOT / "client").resolve():
        shutil.rmtree(target / "chunkattn_client" / "_pb", ignore_errors=True)
    generate(target)
