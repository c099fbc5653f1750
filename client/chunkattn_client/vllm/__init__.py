"""chunkattn as vLLM's attention: a vLLM plugin (the ``vllm`` extra; see docs/vllm.md).

vLLM loads ``register`` (the ``vllm.general_plugins`` entry point) in each of its processes. With
CHUNKATTN_VLLM_TARGET unset it does nothing. With it set, vLLM's CPU attention backend becomes
``backend.ChunkAttnBackend`` and, in the worker, the KV cache vLLM allocates is mirrored by a block space on
the server (``offload.Offload``); every attention layer's step is then one call to the server. The rest of
vLLM (scheduling, its KV cache manager, prefix caching, sampling) is unchanged.
"""

from __future__ import annotations

import logging

log = logging.getLogger("chunkattn_client.vllm")

_registered = False


def register() -> None:
    """The entry point: activate the plugin when CHUNKATTN_VLLM_TARGET is set (idempotent)."""
    global _registered
    from chunkattn_client.vllm.offload import PluginConfig

    config = PluginConfig.from_env()
    if config is None or _registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker import gpu_model_runner, gpu_worker

    from chunkattn_client.vllm import backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "chunkattn_client.vllm.backend.ChunkAttnBackend")
    runner = gpu_model_runner.GPUModelRunner
    runner.initialize_kv_cache = backend.wrap_initialize_kv_cache(config, runner.initialize_kv_cache)
    gpu_worker.Worker.shutdown = backend.wrap_shutdown(gpu_worker.Worker.shutdown)
    _registered = True
    log.info("chunkattn: vLLM's CPU attention goes to %s", config.target)
