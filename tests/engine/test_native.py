"""The native backend's build and fallback: chosen by --backend native, it serves where its kernels build and
load, and where they cannot the engine serves with the torch backend and says why (its correctness is the
backend-contract tests', run with impl "native": tests/engine/test_engine_reference.py, test_fp8.py,
test_blocks.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from chunkattn_server.attention.backends import TorchBackend
from chunkattn_server.attention.backends.native import build
from chunkattn_server.engine.device import make_backend
from tests.helpers.harness import NATIVE_PROBLEM

CPU = torch.device("cpu")


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
    with pytest.raises(build.NativeUnavailable, match="expected one of AVX512, AVX2, DEFAULT"):
        build.load()


@pytest.mark.skipif(bool(NATIVE_PROBLEM), reason=NATIVE_PROBLEM or "built")
def test_where_it_builds_the_native_backend_serves() -> None:
    backend = make_backend("native", CPU)
    assert backend.name == "native"
