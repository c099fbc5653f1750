"""chunkattn as vLLM's attention: a vLLM plugin (the ``vllm`` extra; see docs/vllm.md).

vLLM loads ``register`` (the ``vllm.general_plugins`` entry point) in each of its processes. With
CHUNKATTN_VLLM_TARGET unset it does nothing. With it set, vLLM's CPU attention backend becomes
``backend.ChunkAttnBackend`` and, in the worker, vLLM's KV cache is a block space on the server
(``offload.Offload``): vLLM's own KV tensors are placeholders that hold no memory, and its block count is the
space's (CHUNKATTN_VLLM_KV_BLOCKS / _KV_BYTES) or, unset, vLLM's own sizing (``kvmemory``). Every attention
layer's step is one call to the server. The rest of vLLM (scheduling, its KV cache manager, prefix caching,
sampling) is unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("chunkattn_client.vllm")

_registered = False


def register() -> None:
    """The entry point: activate the plugin when CHUNKATTN_VLLM_TARGET is set (idempotent)."""
    global _registered
    from chunkattn_client.vllm.offload import PluginConfig

    config = PluginConfig.from_env()
    if config is None or _registered:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker import gpu_model_runner, gpu_worker

    from chunkattn_client.vllm import backend, kvmemory

    register_backend(AttentionBackendEnum.CPU_ATTN, "chunkattn_client.vllm.backend.ChunkAttnBackend")
    runner = gpu_model_runner.GPUModelRunner
    runner.initialize_kv_cache = backend.wrap_initialize_kv_cache(config, runner.initialize_kv_cache)
    # The model runner's KV tensors: placeholders (the name initialize_kv_cache_tensors calls).
    gpu_model_runner.allocate_kv_cache = kvmemory.wrap_allocate_kv_cache(gpu_model_runner.allocate_kv_cache)
    workers: list[Any] = [gpu_worker.Worker]
    if current_platform.is_cpu():
        from vllm.v1.worker import cpu_worker

        workers.append(cpu_worker.CPUWorker)
    for worker in workers:  # each class that defines its own (the CPU worker overrides the GPU worker's)
        if "determine_available_memory" in vars(worker):
            original = worker.determine_available_memory
            worker.determine_available_memory = kvmemory.wrap_determine_available_memory(config, original)
    gpu_worker.Worker.shutdown = backend.wrap_shutdown(gpu_worker.Worker.shutdown)
    _registered = True
    log.info("chunkattn: vLLM's CPU attention goes to %s", config.target)
