"""The attention shape of a Hugging Face transformers config, as chunkattn serves it. No torch here.

Both sides read a config through this module: ``chunkattn-server --hf-config config.json`` builds the
model it serves from it, and ``chunkattn_client.hf.OffloadSession`` checks the server against the model
it offloads, so the two cannot disagree about what a config means.

What is read (from the config itself or its ``text_config``, as in Llama 4's multimodal config.json):
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (default: the heads),
``head_dim`` (default ``hidden_size // num_attention_heads``), and each layer's kind: ``layer_types``
("chunked_attention" gets ``attention_chunk_size``, "full_attention" is global), else Llama 4's
``no_rope_layers`` (1: a RoPE layer, chunked; 0: NoPE, global), else every layer global. Llama 4 configs
("llama4", "llama4_text") get transformers' defaults for what they leave out: head_dim 128,
attention_chunk_size 8192, and an empty ``no_rope_layers`` means a NoPE layer every
``no_rope_layer_interval`` (4) layers, as Llama 4 Scout's own config.json relies on.

Sliding-window attention is refused ("sliding_attention" layers, or a ``sliding_window`` that is not
switched off by ``use_sliding_window: false``): chunkattn would silently serve it as global attention.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNKED, FULL = "chunked_attention", "full_attention"


class HFConfigError(ValueError):
    """A config chunkattn cannot serve, or a server that does not serve it; the message says which field."""


@dataclass(frozen=True)
class AttentionLayout:
    """What chunkattn needs of a model: heads, head size, and each layer's chunk size (0 = global)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    chunk_sizes: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.chunk_sizes)


def load(path: str | Path) -> AttentionLayout:
    """The layout of a config.json file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HFConfigError(f"cannot read the Hugging Face config {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{str(path)!r} is not a config: it holds a {type(data).__name__}, not an object")
    return layout(data)


LLAMA4_TYPES = ("llama4", "llama4_text")
LLAMA4_DEFAULTS: dict[str, Any] = {"head_dim": 128, "attention_chunk_size": 8192, "no_rope_layer_interval": 4}


def layout(config: Mapping[str, Any]) -> AttentionLayout:
    """The layout of a config as a dict (a config.json, or ``PretrainedConfig.to_dict()``)."""
    text = config.get("text_config")
    c: Mapping[str, Any] = text if isinstance(text, Mapping) else config
    if c.get("model_type", config.get("model_type")) in LLAMA4_TYPES:
        c = {**LLAMA4_DEFAULTS, **c}  # what transformers assumes where the file says nothing
    window = c.get("sliding_window")
    if window is not None and c.get("use_sliding_window", True) is not False:
        raise HFConfigError(
            f"the config has sliding-window attention (sliding_window {window!r}); chunkattn serves chunked-local"
            " and global layers only"
        )
    layers = _positive(c, "num_hidden_layers")
    heads = _positive(c, "num_attention_heads")
    kv_heads = _positive(c, "num_key_value_heads") if c.get("num_key_value_heads") is not None else heads
    head_size = _positive(c, "head_dim") if c.get("head_dim") is not None else _positive(c, "hidden_size") // heads
    kinds = _layer_kinds(c, layers)
    chunk = c.get("attention_chunk_size")
    size = chunk if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 else 0
    if CHUNKED in kinds and not size:
        raise HFConfigError(f"the config has chunked layers but attention_chunk_size is {chunk!r}; expected > 0")
    return AttentionLayout(heads, kv_heads, head_size, tuple(size if k == CHUNKED else 0 for k in kinds))


def first_difference(expected: AttentionLayout, served: AttentionLayout) -> str | None:
    """The first field where the server (``served``) differs from the config (``expected``), in words."""
    for name in ("num_layers", "num_heads", "num_kv_heads", "head_size"):
        want, got = getattr(expected, name), getattr(served, name)
        if want != got:
            return f"{name}: the model has {want}, the server {got}"
    for i, (want, got) in enumerate(zip(expected.chunk_sizes, served.chunk_sizes, strict=True)):
        if want != got:
            return f"layer {i}'s chunk size: the model has {want or 'global (0)'}, the server {got or 'global (0)'}"
    return None


def _layer_kinds(c: Mapping[str, Any], layers: int) -> list[str]:
    types = c.get("layer_types")
    if types is not None:
        kinds = _list(types, "layer_types", layers)
        for i, kind in enumerate(kinds):
            if kind not in (CHUNKED, FULL):
                raise HFConfigError(
                    f"layer_types[{i}] is {kind!r}; chunkattn serves {CHUNKED!r} and {FULL!r} layers only"
                )
        return [str(k) for k in kinds]
    rope = c.get("no_rope_layers")
    if rope:  # Llama 4 before layer_types: 1 = RoPE (chunked), 0 = NoPE (global)
        return [CHUNKED if flag else FULL for flag in _list(rope, "no_rope_layers", layers)]
    interval = c.get("no_rope_layer_interval")
    if interval is not None:  # Llama 4 with no_rope_layers empty: transformers builds it from the interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise HFConfigError(f"no_rope_layer_interval must be a positive integer, got {interval!r}")
        return [CHUNKED if (i + 1) % interval else FULL for i in range(layers)]
    return [FULL] * layers


def _list(value: Any, name: str, layers: int) -> Sequence[Any]:
    if not isinstance(value, list) or len(value) != layers:
        raise HFConfigError(f"{name} must list each of the {layers} layers (num_hidden_layers), got {value!r}")
    return value


def _positive(c: Mapping[str, Any], name: str) -> int:
    value = c.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HFConfigError(f"the config's {name} must be a positive integer, got {value!r}")
    return value
