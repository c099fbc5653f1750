"""The native kernels, built for this CPU: compiled on first use with torch's C++ extension API (g++ and
ninja) into torch's extension cache, once per ISA, and loaded for the widest ISA the CPU has (as ATen's own
CPU kernels choose at run time: at::vec::Vectorized is as wide as the flags a file is compiled with, so a
file is built per ISA, never with -march=native). ``load()`` returns the module, or raises NativeUnavailable
saying why (no compiler, a failed build): the engine then serves with the torch backend and logs it.

Prebuilt: ``python -m chunkattn_server.attention.backends.native.build --out DIR`` builds every ISA into DIR
(the Docker image's builder stage does, so that the image ships no compiler), and with CHUNKATTN_NATIVE_DIR=DIR
``load()`` imports the chosen ISA's shared object from there and never compiles: a missing or broken file is
NativeUnavailable, saying which file and why.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("chunkattn_server")

HERE = Path(__file__).parent
SOURCES = [HERE / "decode.cpp", HERE / "prefill.cpp"]  # and their headers: pages.h, store.h, amx.h
CLI = "python -m chunkattn_server.attention.backends.native.build"

X86 = ("x86_64", "AMD64", "i686", "i386")

_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
           "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]  # fmt: skip
# Our builds of the kernels, widest first: AMX (Intel since Sapphire Rapids: AVX-512 with BF16 and the AMX tiles,
# whose bfloat16 matrix multiply serves bfloat16 and float8 caches), then torch's names for the CPU's widest
# vector ISA.
FLAGS: dict[str, list[str]] = {
    "AMX": [*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-DCHUNKATTN_AMX"],
    "AVX512": _AVX512,
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}  # fmt: skip


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def cpu_isa() -> str:
    """The widest ISA this CPU runs: AMX where torch reads AVX512 with AVX512-BF16 and the AMX tiles and the
    kernel lets this process use them (torch asks Linux for the tiles' state, ARCH_REQ_XCOMP_PERM); else torch's
    AVX512 / AVX2, anything else DEFAULT. Every ISA ``runnable`` from it runs here."""
    if platform.machine() not in X86:
        return "DEFAULT"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and _amx():
        return "AMX"
    return capability if capability in FLAGS else "DEFAULT"


@functools.cache
def _amx() -> bool:
    """Whether this CPU has AMX tiles for bfloat16 and AVX512-BF16, and this process may use the tiles."""
    cpu = torch.cpu
    try:
        return bool(cpu._is_avx512_bf16_supported() and cpu._is_amx_tile_supported() and cpu._init_amx())
    except AttributeError:  # a torch without these probes: no AMX build
        return False


def isa() -> str:
    """The ISA whose build is loaded: CHUNKATTN_NATIVE_ISA (AMX, AVX512, AVX2 or DEFAULT) when set, else
    ``cpu_isa()``. Forcing a narrower ISA than the CPU's runs that build here (the tests check each build
    this way); a wider one stops the process with an illegal instruction."""
    forced = os.environ.get("CHUNKATTN_NATIVE_ISA")
    if forced:
        if forced not in FLAGS:
            raise NativeUnavailable(f"CHUNKATTN_NATIVE_ISA={forced!r}: expected one of {', '.join(FLAGS)}")
        return forced
    return cpu_isa()


def runnable(chosen: str) -> list[str]:
    """The ISAs a CPU that runs ``chosen`` can run, widest first (FLAGS is ordered so)."""
    names = list(FLAGS)
    return names[names.index(chosen) :]


def module_name(chosen: str) -> str:
    """The extension's module name for an ISA; its shared object is this name + ".so"."""
    return f"chunkattn_native_{chosen.lower()}"


def load() -> ModuleType:
    """The kernels' module for this CPU: from CHUNKATTN_NATIVE_DIR when set, else built once per ISA and torch
    version and cached by torch; CHUNKATTN_NATIVE=0 turns them off."""
    if os.environ.get("CHUNKATTN_NATIVE") == "0":
        raise NativeUnavailable("CHUNKATTN_NATIVE=0 turns the native kernels off")
    folder = os.environ.get("CHUNKATTN_NATIVE_DIR")
    if folder:
        return _prebuilt(folder, isa())
    return _build(isa())


@functools.cache
def _prebuilt(folder: str, chosen: str) -> ModuleType:
    """The widest prebuilt module in ``folder`` this CPU runs (``chosen``'s, else a narrower one: a folder
    built on a CPU without AVX512 holds no AVX512 build)."""
    where = f"CHUNKATTN_NATIVE_DIR={folder}"
    found = [Path(folder) / f"{module_name(i)}.so" for i in runnable(chosen)]
    path = next((p for p in found if p.is_file()), None)
    if path is None:
        names = ", ".join(p.name for p in found)
        raise NativeUnavailable(f"{where} has none of {names} for this CPU ({chosen}); build with {CLI} --out DIR")
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ImportError("not an extension module")
        module = importlib.util.module_from_spec(spec)  # dlopen: torch, imported above, provides its libraries
        spec.loader.exec_module(module)
    except Exception as e:  # another torch's build, another platform's, a truncated file
        raise NativeUnavailable(f"{where}: {path} did not load: {_last_line(e)}") from None
    log.info("native kernels: %s loaded (this CPU runs %s)", path, chosen)
    return module


def _last_line(e: Exception) -> str:
    """An exception's last line: a compiler's or loader's message ends with what went wrong."""
    lines = str(e).strip().splitlines() or [repr(e)]
    return lines[-1]


def _compile(chosen: str, build_directory: str | None = None) -> ModuleType:
    """Build (or find in the build directory, torch's cache by default) and import one ISA's module."""
    bin_dir = os.path.dirname(sys.executable)  # a venv's ninja (requirements/dev.txt), where PATH lacks it
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    module: ModuleType = cpp_extension.load(
        name=module_name(chosen),
        sources=[str(p) for p in SOURCES],
        extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", *FLAGS[chosen]],
        extra_ldflags=["-fopenmp"],
        build_directory=build_directory,
        verbose=False,
    )
    return module


@functools.cache
def _build(chosen: str) -> ModuleType:
    log.info(
        "native kernels: loading the %s build (compiled first if this torch and source have no build in torch's"
        " extension cache yet: about 30 s, once per machine)",
        chosen,
    )
    try:
        module = _compile(chosen)
    except Exception as e:  # no compiler, no ninja, a build error: say why, and let the caller fall back
        raise NativeUnavailable(f"the native kernels did not build or load ({chosen}): {_last_line(e)}") from None
    log.info("native kernels: %s build loaded", chosen)
    return module


def prebuild(out: Path, isas: Sequence[str]) -> list[Path]:
    """Build each ISA's module and leave in ``out`` only its shared object (what CHUNKATTN_NATIVE_DIR=out loads),
    the objects and ninja files in a temporary folder. torch imports each build once (its module
    initialisation runs here, compiled with the ISA's flags), so only ISAs this CPU runs are built. Run in a
    fresh process: torch renames a module built twice in one (``_v1``), and that name is refused."""
    wider = [i for i in isas if i not in runnable(isa())]
    if wider:
        raise ValueError(f"this CPU ({isa()}) cannot run {', '.join(wider)}: build those on a CPU that does")
    out.mkdir(parents=True, exist_ok=True)
    built = []
    for chosen in isas:
        name = module_name(chosen)
        with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
            module = _compile(chosen, tmp)
            if module.__name__ != name or module.__file__ is None:
                raise RuntimeError(f"torch built {module.__name__!r}, not {name!r}: build in a fresh process")
            target = out / f"{name}.so"
            shutil.copyfile(module.__file__, target)
        built.append(target)
    return built


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: build the kernels into a folder, for an image or machine without a compiler; or, with --check,
    as the server will load them here (``make install`` runs it)."""
    parser = argparse.ArgumentParser(
        prog=CLI,
        description="Build the native CPU kernels, one shared object per ISA, into a folder; a server run with"
        " CHUNKATTN_NATIVE_DIR=that folder loads the one for its CPU and needs no compiler (the Docker image's"
        " builder stage runs this). Needs g++ and ninja, and the torch that will load them.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", type=Path, metavar="DIR", help="the folder to leave the .so files in")
    what.add_argument(
        "--check",
        action="store_true",
        help="build (or find built) this CPU's kernels in torch's extension cache, as the server loads them, and"
        " say whether they are available; exits 0 either way (the server then serves with the torch backend)",
    )
    parser.add_argument(
        "--isa",
        default=",".join(runnable(isa())),
        metavar="LIST",
        help=f"comma-separated ISAs to build, of {','.join(FLAGS)} (default: every one this CPU runs: a build is"
        " imported once to check it, and a wider ISA's would stop this CPU; a server on a wider CPU then loads"
        " the widest built)",
    )
    args = parser.parse_args(argv)
    isas = [s.strip().upper() for s in args.isa.split(",") if s.strip()]
    unknown = [s for s in isas if s not in FLAGS]
    if unknown or not isas:
        parser.error(f"--isa: expected some of {', '.join(FLAGS)}, got {args.isa!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        try:
            load()
        except NativeUnavailable as e:
            log.warning("native kernels unavailable: %s; the server will serve with the torch backend", e)
        return 0
    for path in prebuild(args.out, isas):
        log.info("built %s (%d KiB)", path, path.stat().st_size >> 10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
