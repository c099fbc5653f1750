"""The test server's model (server_process.SMALL) as vLLM's layers describe it to the plugin, for the tests of
chunkattn_client.vllm.offload without vLLM (tests/client/test_vllm_lease.py, tests/client/test_vllm_offload.py,
tests/client/test_vllm_sizing.py)."""

from __future__ import annotations

from chunkattn_client.vllm.offload import LayerShape

LAYERS = [
    LayerShape(i, 4, 2, 16, 0.25, c, None, (), "auto", "float32") for i, c in enumerate((16, 16, 16, 0))
]  # SMALL's, as vLLM's layers would describe it
PLANES = [0, 1, 2, 3]  # one plane per layer (vLLM's layout of four KV cache groups of one layer each)
