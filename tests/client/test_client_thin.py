"""The client stays thin: importing it (the CLI, the bench and hfconfig too) never imports torch, triton or
transformers; only chunkattn_client.hf does, for the hf extra."""

from __future__ import annotations

import subprocess
import sys


def test_import_chunkattn_client_does_not_import_torch_or_triton() -> None:
    code = (
        "import sys, chunkattn_client, chunkattn_client.reference, chunkattn_client.batch, chunkattn_client.cli\n"
        "import chunkattn_client.bench.runner, chunkattn_client.bench.html, chunkattn_client.bench.progress\n"
        "import chunkattn_client.hfconfig\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing the client pulled in {result.stdout.strip()}\n{result.stderr}"
