"""vLLM's side: an attention backend whose impl sends every layer's work to a chunkattn block space.

``register()`` (vllm/__init__.py) puts ``ChunkAttnBackend`` in place of vLLM's CPU backend (CPU_ATTN) and
wraps the model runner's ``initialize_kv_cache``: right after vLLM lays out its KV cache (placeholders that
hold no memory: kvmemory.py) the worker checks the server against the model and opens a block space of vLLM's
block count, laid out as vLLM's KV tensors are (layers that alias one buffer, vLLM's hybrid KV cache groups,
share one plane), so that a server that cannot serve the model stops vLLM at start with the reason. Chunked
layers arrive as vLLM's virtual batches (rows windowed to one chunk), which the server computes as given.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from chunkattn_client.vllm.kvmemory import plane_offsets, sized_blocks
from chunkattn_client.vllm.offload import LayerShape, Offload, OffloadError, PluginConfig

log = logging.getLogger("chunkattn_client.vllm")

_lock = threading.Lock()
_offload: Offload | None = None


def current() -> Offload:
    """The worker's Offload (opened with vLLM's KV cache); OffloadError before."""
    if _offload is None:
        raise OffloadError(
            "the chunkattn plugin has no block space: vLLM called attention before allocating its KV cache"
        )
    return _offload


def start(config: PluginConfig, runner: Any) -> None:
    """Open the worker's Offload from the model runner's attention layers and their KV tensors (once)."""
    global _offload
    with _lock:
        if _offload is not None:
            return
        layers = _attention_layers(runner)
        if not layers:
            raise OffloadError("the chunkattn plugin found no attention layers in vLLM's model")
        dtype = str(runner.vllm_config.model_config.dtype).removeprefix("torch.")
        shapes, planes, num_blocks, block_size = _describe(layers, dtype, plane_offsets(runner.kv_cache_config))
        sized = sized_blocks()
        if sized is not None and sized != num_blocks:
            raise OffloadError(
                f"the chunkattn plugin gave vLLM {sized} KV blocks (CHUNKATTN_VLLM_KV_BLOCKS / _KV_BYTES) and vLLM"
                f" made {num_blocks} of them: this vLLM counts a block's bytes otherwise than the plugin reads it"
            )
        _offload = Offload(config, shapes, num_blocks, block_size, planes)
        atexit.register(stop)
        log.info(
            "chunkattn: %d layers on %s, block space %s of %d blocks (%d planes)",
            len(shapes),
            config.target,
            _offload.space_id,
            num_blocks,
            max(planes) + 1,
        )


def _attention_layers(runner: Any) -> list[tuple[int, Attention]]:
    context = runner.vllm_config.compilation_config.static_forward_context
    found = sorted(
        ((extract_layer_index(name), layer) for name, layer in context.items() if isinstance(layer, Attention)),
        key=lambda x: x[0],
    )
    if [index for index, _ in found] != list(range(len(found))):  # the server numbers attention layers 0..L-1
        raise OffloadError("the model has layers that are not attention between its attention layers: not served")
    return found


def _describe(
    layers: list[tuple[int, Attention]], model_dtype: str, offsets: dict[str, int]
) -> tuple[list[LayerShape], list[int], int, int]:
    """Per layer its shape and plane (a plane per distinct KV buffer, in layer order: ``offsets``, where each
    layer's KV starts in vLLM's layout), and vLLM's block count and block size (from the shapes of its KV
    tensors: [num_blocks, Hkv, block_size, 2 * D])."""
    by_name = {layer.layer_name: index for index, layer in layers}
    shapes: list[LayerShape] = []
    planes: list[int] = []
    buffers: dict[int, int] = {}
    num_blocks = block_size = 0
    for index, layer in layers:
        impl = layer.impl
        kv = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
        target = getattr(impl, "kv_sharing_target_layer_name", None)
        if getattr(impl, "sliding_window", -1) not in (-1, None) or getattr(impl, "logits_soft_cap", None):
            raise OffloadError(
                f"layer {index} uses a sliding window or a logits soft cap, which chunkattn does not serve"
            )
        kind = str(getattr(impl, "attn_type", "decoder")).lower()
        if getattr(impl, "sinks", None) is not None or "decoder" not in kind:
            raise OffloadError(f"layer {index} is not causal decoder attention (sinks or another type): not served")
        slopes = getattr(impl, "alibi_slopes", None)
        shapes.append(
            LayerShape(
                index=index,
                num_heads=impl.num_heads,
                num_kv_heads=impl.num_kv_heads,
                head_size=impl.head_size,
                scale=float(impl.scale),
                chunk_size=int(getattr(layer, "attention_chunk_size", 0) or 0),
                kv_source=None if target is None else by_name[target],
                alibi_slopes=() if slopes is None else tuple(float(x) for x in slopes.tolist()),
                cache_dtype=str(impl.kv_cache_dtype),
                model_dtype=model_dtype,
                k_scale=float(getattr(layer, "_k_scale_float", 1.0)),
                v_scale=float(getattr(layer, "_v_scale_float", 1.0)),
            )
        )
        planes.append(0 if target is not None else buffers.setdefault(offsets[layer.layer_name], len(buffers)))
        if target is None and kv.numel():
            num_blocks, block_size = int(kv.shape[0]), int(kv.shape[2])
    if not num_blocks:
        raise OffloadError("vLLM has allocated no KV cache to mirror")
    return shapes, planes, num_blocks, block_size


def wrap_initialize_kv_cache(config: PluginConfig, original: Callable[..., Any]) -> Callable[..., Any]:
    """The model runner's initialize_kv_cache, then the worker's Offload (not for a profiling run)."""

    @functools.wraps(original)
    def initialize_kv_cache(self: Any, kv_cache_config: Any, is_profiling: bool = False, **kwargs: Any) -> Any:
        result = original(self, kv_cache_config, is_profiling, **kwargs)
        if not is_profiling:
            start(config, self)
        return result

    return initialize_kv_cache


def stop() -> None:
    """Close the worker's Offload (its space's blocks back to the server's pool); never raises."""
    global _offload
    with _lock:
        offload, _offload = _offload, None
    if offload is not None:
        offload.close()


def wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    """The worker's shutdown, after closing its Offload (vLLM's engine shuts its workers down this way; a
    worker that exits otherwise closes it at exit)."""

    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        stop()
        return original(self, *args, **kwargs)

    return shutdown


class ChunkAttnImpl(CPUAttentionBackendImpl):
    """vLLM's CPU impl with every layer's attention on the chunkattn server: vLLM's own KV cache is left
    unwritten (its K/V travel with the layer's call), and ``output`` is filled from the server's answer."""

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        return  # the server writes K/V at the same slots, in the layer's call (forward)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None, "vLLM passes the output buffer"
        if attn_metadata is None:  # a profiling or warm-up run without KV: nothing to attend
            return output
        if output_scale is not None or output_block_scale is not None:
            raise OffloadError("the chunkattn plugin does not produce quantized attention outputs")
        if not getattr(attn_metadata, "causal", True):
            raise OffloadError("the chunkattn plugin serves causal attention only")
        sharing = self.kv_sharing_target_layer_name is not None
        current().attend(
            extract_layer_index(layer.layer_name),
            query,
            None if sharing else key,
            None if sharing else value,
            attn_metadata,
            output,
        )
        return output


class ChunkAttnBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (its metadata builder: virtual batches for chunked layers), served by
    chunkattn."""

    @staticmethod
    def get_impl_cls() -> type[ChunkAttnImpl]:
        return ChunkAttnImpl
