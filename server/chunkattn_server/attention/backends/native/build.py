"""The native kernels, built for this CPU: compiled on first use with torch's C++ extension API (g++ and
ninja) into torch's extension cache, once per ISA, and loaded for the widest ISA the CPU has (as ATen's own
CPU kernels choose at run time: at::vec::Vectorized is as wide as the flags a file is compiled with, so a
file is built per ISA, never with -march=native). ``load()`` returns the module, or raises NativeUnavailable
saying why (no compiler, a failed build): the engine then serves with the torch backend and logs it.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("chunkattn_server")

SOURCE = Path(__file__).with_name("decode.cpp")

# torch's name for the CPU's widest vector ISA -> our build of the kernel for it.
FLAGS: dict[str, list[str]] = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}  # fmt: skip


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def isa() -> str:
    """The ISA whose build this CPU runs: CHUNKATTN_NATIVE_ISA (AVX512, AVX2 or DEFAULT) when set, else
    torch's reading of the CPU (AVX512 / AVX2, anything else: DEFAULT)."""
    forced = os.environ.get("CHUNKATTN_NATIVE_ISA")
    if forced:
        if forced not in FLAGS:
            raise NativeUnavailable(f"CHUNKATTN_NATIVE_ISA={forced!r}: expected one of {', '.join(FLAGS)}")
        return forced
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in FLAGS else "DEFAULT"


def load() -> ModuleType:
    """The kernels' module for this CPU (built once per ISA and torch version, then cached by torch);
    CHUNKATTN_NATIVE=0 turns them off."""
    if os.environ.get("CHUNKATTN_NATIVE") == "0":
        raise NativeUnavailable("CHUNKATTN_NATIVE=0 turns the native kernels off")
    return _build(isa())


@functools.cache
def _build(chosen: str) -> ModuleType:
    bin_dir = os.path.dirname(sys.executable)  # a venv's ninja (requirements/dev.txt), where PATH lacks it
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension

        module: ModuleType = cpp_extension.load(
            name=f"chunkattn_native_{chosen.lower()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", *FLAGS[chosen]],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a build error: say why, and let the caller fall back
        lines = str(e).strip().splitlines() or [repr(e)]
        raise NativeUnavailable(f"the native kernels did not build or load ({chosen}): {lines[-1]}") from None
    log.info("native kernels: %s build loaded", chosen)
    return module
