"""The server's glibc malloc settings: applied on glibc, left alone elsewhere or when the user set them."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from typing import Any

import pytest

from chunkattn_server import malloc

CLEAN = {k: v for k, v in os.environ.items() if k not in (*malloc.ENVIRONMENT, "GLIBC_TUNABLES")}
GLIBC = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the settings are glibc's; elsewhere nothing is done"
)


def _in_a_fresh_process(env: dict[str, str]) -> str:
    code = "from chunkattn_server import malloc; print(malloc.keep_freed_memory())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


@GLIBC
def test_glibc_takes_the_settings() -> None:
    assert _in_a_fresh_process(CLEAN).strip() == "malloc keeps up to 64 MiB freed (mmap threshold 32 MiB)"


@GLIBC
@pytest.mark.parametrize(
    "env",
    [{"MALLOC_TRIM_THRESHOLD_": "1048576"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}],
)
def test_the_users_malloc_environment_wins(env: dict[str, str]) -> None:
    out = _in_a_fresh_process({**CLEAN, **env})
    assert out.strip() == "malloc left to " + " and ".join(f"{k}={v}" for k, v in env.items())


def _fake_glibc(monkeypatch: pytest.MonkeyPatch, result: int) -> list[tuple[int, int]]:
    """glibc whose mallopt answers ``result``; returns the list its calls go to."""
    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return result

    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    for name in (*malloc.ENVIRONMENT, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_right_parameters_reach_mallopt(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_glibc(monkeypatch, 1)
    assert malloc.keep_freed_memory().startswith("malloc keeps")
    assert calls == [(-3, 32 << 20), (-1, 64 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def test_a_refused_setting_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_glibc(monkeypatch, 0)
    assert malloc.keep_freed_memory() == "malloc left as it is (mallopt refused the settings)"


@pytest.mark.parametrize("libc", [("", ""), ("musl", "1.2")])
def test_other_c_libraries_are_left_alone(monkeypatch: pytest.MonkeyPatch, libc: tuple[str, str]) -> None:
    def no_dlopen(name: Any) -> None:
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(platform, "libc_ver", lambda: libc)
    monkeypatch.setattr(ctypes, "CDLL", no_dlopen)
    assert malloc.keep_freed_memory() == "malloc left as it is (not glibc)"
