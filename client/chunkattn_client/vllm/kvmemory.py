"""vLLM's KV cache with the plugin on: its size, and no memory behind it.

Two hooks, both in vLLM's worker process (``register()`` installs them):

- **Size** (``wrap_determine_available_memory``): vLLM's engine asks each worker how many bytes its KV cache may
  take (``Worker.determine_available_memory``, which the CPU worker overrides and the GPU worker defines: the one
  hook both have, and the only number that crosses from a worker to the engine process, which turns it into
  ``num_blocks`` in ``get_kv_cache_configs``). With CHUNKATTN_VLLM_KV_BLOCKS or _KV_BYTES set, the worker
  answers the bytes of exactly that many of vLLM's blocks (as vLLM counts a block's bytes), so its scheduler
  gets the space's block count; vLLM's own kv_cache_memory_bytes and gpu_memory_utilization then size nothing
  (one log line says so). vLLM still runs its path for an explicit size (its profile run, which compiles the
  model, without measuring memory: the KV costs nothing here). Unset: vLLM's answer, as without the plugin.
- **No memory** (``wrap_allocate_kv_cache``): vLLM's ``allocate_kv_cache`` lays its KV tensors out on the meta
  device (shapes, dtypes, strides, no bytes), and each layer gets a placeholder of its view's shape and dtype
  on the real device holding one row of the last dimension (every other stride 0): a few hundred bytes a
  layer. Nothing reads them (the plugin's impl does the attention and its ``do_kv_cache_update`` writes
  nothing); vLLM's zeroing of new blocks writes that one row (the CPU runner's ``kv[block].zero_()``, the GPU
  runner's zeroing kernel: a block stride of 0 and a page of one row, in bounds).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from chunkattn_client.vllm.offload import OffloadError, PluginConfig, server_info, space_blocks

log = logging.getLogger("chunkattn_client.vllm")

_sized: int | None = None  # the blocks this worker asked vLLM for; None: vLLM sized its KV cache


def sized_blocks() -> int | None:
    """The block count this worker gave vLLM (CHUNKATTN_VLLM_KV_BLOCKS / _KV_BYTES), or None when vLLM sized."""
    return _sized


def plane_offsets(kv_cache_config: Any) -> dict[str, int]:
    """Per layer vLLM keeps KV for, where that KV starts in vLLM's one backing buffer (bytes: the tensor's offset
    plus the layer's stride times its place). Layers at one offset alias one buffer (vLLM's hybrid KV cache
    groups overlay each other from byte 0), so they share one plane of the block space."""
    return {
        name: int(tensor.offset) + i * int(tensor.layer_stride)
        for tensor in kv_cache_config.kv_cache_tensors
        for i, name in enumerate(tensor.layers)
    }


def placeholder(view: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A tensor of ``view``'s shape and dtype on ``device`` that holds one row of its last dimension (a 1-D view:
    one element), every other stride 0: all the shape vLLM's code reads, none of the memory."""
    if view.dim() == 0:
        return torch.zeros((), dtype=view.dtype, device=device)
    row = view.shape[-1] if view.dim() > 1 else 1
    return torch.zeros(row, dtype=view.dtype, device=device).expand(view.shape)


def wrap_allocate_kv_cache(original: Callable[..., dict[str, torch.Tensor]]) -> Callable[..., dict[str, torch.Tensor]]:
    """vLLM's ``allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)``, its layout computed on
    the meta device, and a ``placeholder`` per layer on ``device``."""

    @functools.wraps(original)
    def allocate_kv_cache(kv_cache_config: Any, device: torch.device, *args: Any, **kwargs: Any) -> dict[str, Any]:
        views = original(kv_cache_config, torch.device("meta"), *args, **kwargs)
        return {name: placeholder(view, device) for name, view in views.items()}

    return allocate_kv_cache


def _vllm_block(worker: Any) -> tuple[int, int]:
    """The bytes vLLM counts per block of its KV cache (the divisor its engine turns the worker's bytes into
    num_blocks with) and the planes a block takes (distinct buffers: layers that alias share one), from the
    worker's KV cache spec and vLLM's own grouping and layout."""
    from vllm.v1.core import kv_cache_utils

    specs = copy.deepcopy(worker.get_kv_cache_spec())
    groups = kv_cache_utils.get_kv_cache_groups(worker.vllm_config, specs)
    if not groups:
        raise OffloadError("the chunkattn plugin found no attention layers with a KV cache in vLLM's model")
    per_block = int(kv_cache_utils._pool_bytes_per_block(worker.vllm_config, groups))
    layout = kv_cache_utils.get_kv_cache_config_from_groups(worker.vllm_config, groups, per_block)
    return per_block, len(set(plane_offsets(layout).values()))


def wrap_determine_available_memory(config: PluginConfig, original: Callable[[Any], int]) -> Callable[[Any], int]:
    """A worker's ``determine_available_memory``: with the plugin sizing the KV cache, the bytes of exactly the
    space's blocks (``offload.space_blocks``: bounded by the server's free pool); else vLLM's own answer."""

    @functools.wraps(original)
    def determine_available_memory(self: Any) -> int:
        global _sized
        if not config.sizes_kv:
            return original(self)
        cache = self.cache_config
        if cache.num_gpu_blocks_override is not None:
            raise OffloadError(
                f"vLLM's num_gpu_blocks_override ({cache.num_gpu_blocks_override}) and the chunkattn plugin's"
                " CHUNKATTN_VLLM_KV_BLOCKS / _KV_BYTES both size vLLM's KV cache: set one of them"
            )
        per_block, planes = _vllm_block(self)
        blocks = space_blocks(config, server_info(config), planes)
        own = cache.kv_cache_memory_bytes
        ignored = f"kv_cache_memory_bytes ({own})" if own is not None else "gpu_memory_utilization"
        log.info(
            "chunkattn: vLLM's KV cache is the block space's %d blocks (CHUNKATTN_VLLM_KV_%s); vLLM's %s is"
            " ignored, and its KV tensors take no memory",
            blocks,
            "BLOCKS" if config.kv_blocks is not None else "BYTES",
            ignored,
        )
        cache.kv_cache_memory_bytes = 1  # vLLM's path for an explicit size: the profile run, no memory check
        try:
            original(self)
        finally:
            cache.kv_cache_memory_bytes = own
        _sized = blocks
        return blocks * per_block

    return determine_available_memory
