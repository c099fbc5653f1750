"""Random-weight Llama 4 text checkpoints (transformers' Llama4ForCausalLM), for the vLLM tests and the vLLM
benchmark: the RoPE layers chunked (C = ``chunk``), every fourth a global NoPE layer, as Llama 4 interleaves
them; 2 experts of one token each."""

from __future__ import annotations

from pathlib import Path


def write_checkpoint(
    path: Path, *, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, chunk: int, vocab: int
) -> None:
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    config = Llama4TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden,
        intermediate_size_mlp=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_local_experts=2,
        num_experts_per_tok=1,
        no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(layers)],
        attention_chunk_size=chunk,
        max_position_embeddings=4096,
        interleave_moe_layer_step=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    Llama4ForCausalLM(config).save_pretrained(path)
