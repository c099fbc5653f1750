"""Reading a Hugging Face config's attention shape (chunkattn_client.hfconfig) and the server's --hf-config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chunkattn_client.hfconfig import AttentionLayout, HFConfigError, first_difference, layout, load
from chunkattn_server.__main__ import engine_config
from chunkattn_server.config import LayerSpec
from chunkattn_server.errors import ConfigError
from chunkattn_server.flags import parse
from examples.hf_offload import example_config

TEXT: dict[str, Any] = {
    "num_hidden_layers": 4,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 5120,
    "attention_chunk_size": 8192,
    "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
}


def test_the_example_models_config_reads_as_llama_4_interleaves_its_layers() -> None:
    assert layout(example_config().to_dict()) == AttentionLayout(8, 2, 32, (16, 16, 16, 0))


def test_a_multimodal_config_is_read_through_its_text_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama4", "text_config": TEXT, "vision_config": {}}))
    assert load(path) == AttentionLayout(40, 8, 128, (8192, 8192, 8192, 0))


# Llama 4 Scout's text_config as its config.json has it (the attention fields; no layer_types, an empty
# no_rope_layers, which transformers fills in from no_rope_layer_interval's default of 4).
SCOUT_TEXT: dict[str, Any] = {
    "model_type": "llama4_text",
    "attention_chunk_size": 8192,
    "head_dim": 128,
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "no_rope_layers": [],
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "vocab_size": 202048,
}


def test_llama_4_scouts_config_reads_as_transformers_reads_it() -> None:
    from transformers import Llama4TextConfig

    ours = layout({"model_type": "llama4", "text_config": SCOUT_TEXT})
    assert ours.chunk_sizes == tuple(0 if (i + 1) % 4 == 0 else 8192 for i in range(48))
    assert (ours.num_heads, ours.num_kv_heads, ours.head_size) == (40, 8, 128)
    theirs = Llama4TextConfig(**{k: v for k, v in SCOUT_TEXT.items() if k != "model_type"})
    assert layout(theirs.to_dict()) == ours  # what transformers builds from the same file
    without = {k: v for k, v in SCOUT_TEXT.items() if k not in ("head_dim", "attention_chunk_size")}
    assert layout(without) == ours  # Llama 4's defaults fill what the file leaves out


def test_sliding_window_models_are_refused_unless_it_is_switched_off() -> None:
    mistral = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "sliding_window": 4096}
    with pytest.raises(HFConfigError, match="sliding-window attention"):
        layout(mistral)
    assert layout({**mistral, "use_sliding_window": False}).chunk_sizes == (0, 0)  # as Qwen 2's configs say


def test_older_llama_4_configs_give_the_layer_kinds_through_no_rope_layers() -> None:
    config = {**TEXT, "layer_types": None, "no_rope_layers": [1, 1, 1, 0]}
    assert layout(config).chunk_sizes == (8192, 8192, 8192, 0)


def test_a_config_without_chunking_is_all_global_and_head_size_defaults_to_hidden_over_heads() -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}
    assert layout(config) == AttentionLayout(8, 8, 64, (0, 0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["sliding_attention"] * 4}, r"layer_types\[0\] is 'sliding_attention'"),
        ({"layer_types": ["full_attention"]}, "layer_types must list each of the 4 layers"),
        ({"attention_chunk_size": None}, "chunked layers but attention_chunk_size is None"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"num_hidden_layers": "4"}, "num_hidden_layers must be a positive integer"),
    ],
)
def test_configs_that_cannot_be_served_are_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(HFConfigError, match=message):
        layout({**TEXT, **change})


def test_unreadable_files_are_refused_with_the_path(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(HFConfigError, match=r"list\.json.*holds a list"):
        load(tmp_path / "list.json")
    with pytest.raises(HFConfigError, match=r"cannot read .*missing\.json"):
        load(tmp_path / "missing.json")


def test_the_first_difference_is_named() -> None:
    ours = AttentionLayout(8, 2, 32, (16, 16, 16, 0))
    assert first_difference(ours, ours) is None
    assert (
        first_difference(ours, AttentionLayout(8, 2, 32, (16, 16, 16))) == "num_layers: the model has 4, the server 3"
    )
    assert first_difference(ours, AttentionLayout(8, 4, 32, (16, 16, 16, 0))) == (
        "num_kv_heads: the model has 2, the server 4"
    )
    assert first_difference(ours, AttentionLayout(8, 2, 32, (16, 16, 16, 16))) == (
        "layer 3's chunk size: the model has global (0), the server 16"
    )


def test_the_server_serves_the_shape_of_a_config_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": TEXT}))
    model = engine_config(parse(["--hf-config", str(path)])).model
    assert (model.num_heads, model.num_kv_heads, model.head_size) == (40, 8, 128)
    assert model.layers == (LayerSpec(8192), LayerSpec(8192), LayerSpec(8192), LayerSpec(0))


def test_the_server_refuses_hf_config_with_shape_flags_or_a_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TEXT))
    with pytest.raises(ConfigError, match="drop --layers, --heads or drop --hf-config"):
        engine_config(parse(["--hf-config", str(path), "--heads", "4", "--layers", "2"]))
    path.write_text(json.dumps({**TEXT, "layer_types": ["sliding_attention"] * 4}))
    with pytest.raises(ConfigError, match="sliding_attention"):
        engine_config(parse(["--hf-config", str(path)]))
