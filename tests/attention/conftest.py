"""Fixtures of the attention tests."""

from __future__ import annotations

import pytest

from chunkattn_server.attention.backends.native import build
from tests.helpers.harness import NATIVE_PROBLEM


@pytest.fixture(params=list(build.FLAGS), ids=str.lower)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each ISA build of the native kernels in turn (AMX, AVX512, AVX2, DEFAULT), forced with CHUNKATTN_NATIVE_ISA
    and compiled (not a prebuilt folder's); its module built and loaded first, so that a build that fails is this
    test's failure, not a fallback. An ISA wider than this CPU's is skipped, saying so: its code would stop the
    process with an illegal instruction."""
    chosen: str = request.param
    if NATIVE_PROBLEM:
        pytest.skip(f"the native kernels do not build here: {NATIVE_PROBLEM}")
    widest = build.cpu_isa()
    if chosen not in build.runnable(widest):
        pytest.skip(f"this CPU runs {widest} at widest: a {chosen} build would stop it (illegal instruction)")
    monkeypatch.delenv("CHUNKATTN_NATIVE_DIR", raising=False)
    monkeypatch.setenv("CHUNKATTN_NATIVE_ISA", chosen)
    assert build.load().__name__ == build.module_name(chosen)
    return chosen
