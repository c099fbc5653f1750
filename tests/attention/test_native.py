"""The native backend's build and fallback: chosen by --backend native, it serves where its kernels build and
load, and where they cannot the engine serves with the torch backend and says why (its correctness is the
backend-contract tests', run with impl "native": tests/engine/test_engine_reference.py, tests/kv/test_fp8.py,
tests/engine/test_blocks.py). Prebuilt: the build CLI leaves one shared object per ISA in a folder, and with
CHUNKATTN_NATIVE_DIR naming it the kernels load from there, never compiled (the Docker image's way)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chunkattn_server.attention.backends import TorchBackend
from chunkattn_server.attention.backends.native import build
from chunkattn_server.engine.device import make_backend
from tests.helpers.harness import NATIVE_PROBLEM

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def test_turned_off_the_native_backend_falls_back_to_torch_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CHUNKATTN_NATIVE", "0")
    with caplog.at_level(logging.WARNING, logger="chunkattn_server"):
        backend = make_backend("native", CPU)
    assert type(backend) is TorchBackend
    assert "native backend is unavailable (CHUNKATTN_NATIVE=0" in caplog.text


def test_an_unknown_isa_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKATTN_NATIVE_ISA", "SSE9")
    with pytest.raises(build.NativeUnavailable, match="expected one of AMX, AVX512, AVX2, DEFAULT"):
        build.load()


@pytest.mark.native
@pytest.mark.skipif(bool(NATIVE_PROBLEM), reason=NATIVE_PROBLEM or "built")
def test_where_it_builds_the_native_backend_serves() -> None:
    backend = make_backend("native", CPU)
    assert backend.name == "native"


def _never_compile(chosen: str, build_directory: str | None = None) -> None:
    raise AssertionError(f"compiled {chosen}: a prebuilt folder must never fall back to the compiler")


def test_a_prebuilt_folder_without_this_cpus_file_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKATTN_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CHUNKATTN_NATIVE_ISA", "AVX2")
    monkeypatch.setattr(build, "_compile", _never_compile)
    with pytest.raises(build.NativeUnavailable) as e:
        build.load()
    assert str(e.value) == (
        f"CHUNKATTN_NATIVE_DIR={tmp_path} has none of chunkattn_native_avx2.so, chunkattn_native_default.so for"
        " this CPU (AVX2); build with python -m chunkattn_server.attention.backends.native.build --out DIR"
    )


def test_a_prebuilt_folder_without_this_cpus_isa_serves_a_narrower_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder built on a CPU without AVX512 holds AVX2 and DEFAULT: an AVX512 CPU takes the widest there
    (here a broken DEFAULT file, so that its refusal names the file it chose), never a wider one."""
    (tmp_path / "chunkattn_native_default.so").write_bytes(b"not a shared object")
    (tmp_path / "chunkattn_native_avx512.so").write_bytes(b"wider than this CPU")
    monkeypatch.setenv("CHUNKATTN_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CHUNKATTN_NATIVE_ISA", "AVX2")
    monkeypatch.setattr(build, "_compile", _never_compile)
    with pytest.raises(build.NativeUnavailable, match=r"chunkattn_native_default\.so did not load"):
        build.load()


def test_the_build_cli_builds_no_isa_this_cpu_cannot_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKATTN_NATIVE_ISA", "AVX2")
    monkeypatch.setattr(build, "_compile", _never_compile)
    assert build.runnable(build.isa()) == ["AVX2", "DEFAULT"]
    with pytest.raises(ValueError, match=r"this CPU \(AVX2\) cannot run AVX512"):
        build.main(["--out", "unused", "--isa", "AVX512,AVX2"])


def test_a_prebuilt_file_that_does_not_load_is_refused_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "chunkattn_native_default.so").write_bytes(b"not a shared object\n" * 8)
    monkeypatch.setenv("CHUNKATTN_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CHUNKATTN_NATIVE_ISA", "DEFAULT")
    monkeypatch.setattr(build, "_compile", _never_compile)
    with pytest.raises(
        build.NativeUnavailable, match=r"chunkattn_native_default\.so did not load: .*invalid ELF header"
    ):
        build.load()


def test_without_its_prebuilt_file_the_native_backend_falls_back_to_torch_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CHUNKATTN_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_compile", _never_compile)
    with caplog.at_level(logging.WARNING, logger="chunkattn_server"):
        backend = make_backend("native", CPU)
    assert type(backend) is TorchBackend
    said = f"native backend is unavailable (CHUNKATTN_NATIVE_DIR={tmp_path} has none of chunkattn_native_"
    assert said in caplog.text


def test_the_build_cli_refuses_an_unknown_isa() -> None:
    with pytest.raises(SystemExit) as e:
        build.main(["--out", "unused", "--isa", "AVX2,SSE9"])
    assert e.value.code == 2


def _no_compiler() -> str:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (g++) here"
    if shutil.which("ninja") is None and shutil.which("ninja", path=os.path.dirname(sys.executable)) is None:
        return "no ninja here (requirements/dev.txt installs it)"
    return ""


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This CPU's ISA built by the CLI (a fresh process, as the Docker build runs it) into a folder."""
    if problem := _no_compiler():
        pytest.skip(problem)
    out = tmp_path_factory.mktemp("native")
    cli = [sys.executable, "-m", "chunkattn_server.attention.backends.native.build", "--out", str(out)]
    done = subprocess.run([*cli, "--isa", build.isa()], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# In a fresh process, as a server in the image: one where torch has already loaded the JIT build of the same
# name (this one, through the harness) gets that module back from the import system, whatever the path.
SERVE_PREBUILT = """
from chunkattn_client import BatchEntry
from chunkattn_server.attention.backends.native import build
from chunkattn_server.engine.device import make_backend
from tests.helpers.harness import MODELS, Harness


def never_compile(*args: object) -> None:
    raise AssertionError("a prebuilt folder must never fall back to the compiler")


build._compile = never_compile
assert make_backend("native", __import__("torch").device("cpu")).name == "native"
h = Harness.build(MODELS["gqa"], impl="native")  # C = 8 and global layers: decodes across a boundary
h.step([BatchEntry("a", 0, 6), BatchEntry("b", 0, 1)])
for i in range(4):
    h.step([BatchEntry("a", 6 + i, 1), BatchEntry("b", 1 + i, 1)])
print(build.load().__file__)
"""


@pytest.mark.native
@pytest.mark.slow
def test_a_prebuilt_folder_holds_only_the_shared_object_and_serves(prebuilt: Path) -> None:
    so = prebuilt / f"{build.module_name(build.isa())}.so"
    assert list(prebuilt.iterdir()) == [so]
    env = {**os.environ, "CHUNKATTN_NATIVE_DIR": str(prebuilt)}
    done = subprocess.run(
        [sys.executable, "-c", SERVE_PREBUILT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == str(so)


def test_the_build_check_says_why_the_kernels_are_unavailable_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``make install`` runs the check: a machine without the kernels installs, and is told the server will
    serve with the torch backend."""
    monkeypatch.setenv("CHUNKATTN_NATIVE", "0")
    with caplog.at_level(logging.WARNING, logger="chunkattn_server"):
        assert build.main(["--check"]) == 0
    assert "native kernels unavailable: CHUNKATTN_NATIVE=0 turns the native kernels off" in caplog.text
