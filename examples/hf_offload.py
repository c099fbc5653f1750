"""Remote attention offload with Hugging Face transformers: a Llama 4 model whose attention runs on chunkattn.

Builds a small Llama 4 text model with random weights from a config (nothing is downloaded), writes its
config.json, starts a chunkattn server with the same shape (``chunkattn-server --hf-config``), and
generates greedily from prompts of different lengths (one batch, each row its own sequence on the
server), once with transformers alone (its own KV cache, one row at a time) and once offloaded per
transport. It prints whether the tokens are identical, the largest logit difference, decode tokens/s
and the number of Attend calls, and checks that the server holds nothing after the session closes.

Needs the client's hf extra: pip install 'chunkattn-client[hf]' (make install has it).

    python examples/hf_offload.py [--prompts 40,27,53] [--new-tokens 64] [--json PATH] [-- server flags...]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

from chunkattn_client import ChunkAttnClient, hfconfig
from chunkattn_client.hf import Generation, OffloadSession, Transport, generate_locally


def example_config() -> Llama4TextConfig:
    """The example's model: Llama 4's text layers at toy size. 4 layers as Llama 4 interleaves them (3
    chunked with C = 16, then 1 global NoPE layer), 8 query / 2 KV heads of 32, 2 experts. floor_scale 8
    (Llama 4: 8192) makes the NoPE layer's attention temperature tuning change queries from position 7
    on, so that short runs exercise it."""
    return Llama4TextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        intermediate_size_mlp=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        attention_chunk_size=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        max_position_embeddings=4096,
        floor_scale=8,
        tie_word_embeddings=False,
    )


def build_model(seed: int = 0, config: Llama4TextConfig | None = None) -> Llama4ForCausalLM:
    """The example's model with random weights from ``seed``, float32, in eval mode."""
    torch.manual_seed(seed)
    model = Llama4ForCausalLM(config or example_config())
    model.train(False)
    return model


def prompts_of(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def max_logit_difference(a: Generation, b: Generation) -> float:
    assert a.logits is not None
    assert b.logits is not None
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits, strict=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``chunkattn-server --hf-config <config.json>`` on a free port; stopped with SIGTERM."""

    def __init__(self, config_json: Path, flags: list[str]) -> None:
        self.target = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "chunkattn_server", "--hf-config", str(config_json)]
        cmd += ["--port", self.target.rsplit(":", 1)[1], "--metrics-port", "0", "--kv-memory-mib", "16", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with ChunkAttnClient(self.target, timeout_s=5) as c:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if c.health() == "SERVING":
                        return
                except Exception:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        err = self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else ""
                        raise RuntimeError(f"the server did not start: {err}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def run(lengths: list[int], new_tokens: int, server_flags: list[str], seed: int = 0) -> dict[str, Any]:
    """Everything the example does; returns what it printed as data."""
    model = build_model(seed)
    config = model.config
    prompts = prompts_of(lengths, config.vocab_size)
    local = generate_locally(model, prompts, new_tokens, keep_logits=True)
    result: dict[str, Any] = {
        "prompts": lengths,
        "new_tokens": new_tokens,
        "chunk_sizes": list(hfconfig.layout(config.to_dict()).chunk_sizes),
        "local": {"decode_tokens_per_s": local.decode_tokens_per_s},
    }
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        config.save_pretrained(folder)
        server = Server(folder / "config.json", server_flags)
        stack.callback(server.stop)
        client = stack.enter_context(ChunkAttnClient(server.target, timeout_s=60))
        result["server"] = server.target
        transport: Transport
        for transport in ("unary", "stream"):
            with OffloadSession(client, model, transport=transport) as session:
                offloaded = session.generate(prompts, new_tokens, keep_logits=True)
                held = client.info().active_sequences
            info = client.info()
            result[transport] = {
                "tokens_equal": offloaded.tokens == local.tokens,
                "max_abs_logit_diff": max_logit_difference(offloaded, local),
                "decode_tokens_per_s": offloaded.decode_tokens_per_s,
                "attend_calls": offloaded.calls,
                "sequences_during": held,
                "free_blocks_after": info.free_blocks,
                "num_blocks": info.num_blocks,
                "sequences_after": info.active_sequences,
            }
    return result


def report(r: dict[str, Any]) -> str:
    lines = [
        f"model: Llama 4 text layers, random weights: {len(r['chunk_sizes'])} layers with chunk sizes"
        f" {r['chunk_sizes']} (0 = global); server {r['server']} started with --hf-config on its config.json",
        f"prompts of {', '.join(map(str, r['prompts']))} tokens (one row each), {r['new_tokens']} new tokens each,"
        " greedy",
        f"local (transformers alone, its own KV cache, a row at a time): decode {r['local']['decode_tokens_per_s']:.1f}"
        " tokens/s",
    ]
    for transport in ("unary", "stream"):
        x = r[transport]
        lines.append(
            f"offloaded, {transport:<6}: tokens identical: {x['tokens_equal']}; max |logit difference|"
            f" {x['max_abs_logit_diff']:.1e}; decode {x['decode_tokens_per_s']:.1f} tokens/s (all rows in one batch);"
            f" {x['attend_calls']} Attend calls (one per layer per forward)"
        )
        lines.append(
            f"  server during the session: {x['sequences_during']} sequences; after closing it:"
            f" {x['sequences_after']} sequences, {x['free_blocks_after']} of {x['num_blocks']} blocks free"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="40,27,53", help="prompt lengths, one row each (default 40,27,53)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per row (default 64)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("server_flags", nargs="*", help="more flags for the server (after --)")
    args = parser.parse_args()
    lengths = [int(x) for x in args.prompts.split(",")]
    if not lengths or min(lengths) < 1 or args.new_tokens < 1:
        parser.error("prompt lengths and --new-tokens must be >= 1")
    result = run(lengths, args.new_tokens, args.server_flags)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = all(
        result[t]["tokens_equal"] and result[t]["max_abs_logit_diff"] <= 1e-4 and result[t]["sequences_after"] == 0
        for t in ("unary", "stream")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
