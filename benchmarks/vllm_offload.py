"""vLLM alone against vLLM offloading its attention to a local chunkattn server, side by side in one run.

Runs in .venv-vllm, from the repository (``make bench-vllm-offload``, or ``.venv-vllm/bin/python -m
benchmarks.vllm_offload``; the server runs from the project's .venv, as users run it). For each
concurrency (1, 8, 32 by default) and each mode, one vLLM instance (greedy, float32, eager) generates
``concurrency`` requests of ``--prompt`` tokens and ``--tokens`` new tokens; reported: output tokens/s and
time per engine step (the generation's wall time over vLLM's own step count), and the ratio offloaded /
alone. With the plugin, where one layer's call goes (per call, mean): the worker's side (vLLM's metadata to
arrays; the call, the answer into vLLM's output included: CHUNKATTN_VLLM_PROFILE) and the server's (per request
from its /metrics: the RPC's time in the server, of which queued and computing); the transport (gRPC, the
client's encoding and decoding) is the call less the server's time.

The model is a random-weight Llama 4 text checkpoint written here: ``tiny`` (the tests': 4 layers, 4/2 heads
of 64, hidden 256) or ``small`` (8 layers, 8/2 heads of 128, hidden 1024, C = 128): attention is a small part
of a step on either, so this measures what offloading costs a step, not what it saves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.helpers.llama4 import write_checkpoint
from tests.helpers.server_process import ServerProcess, counter

ROOT = Path(__file__).resolve().parents[1]

SERVER_PYTHON = os.environ.get("CHUNKATTN_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BLOCK_SIZE = 32
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64, "hidden": 256, "chunk": 64, "vocab": 512},
    "small": {"layers": 8, "heads": 8, "kv_heads": 2, "head_dim": 128, "hidden": 1024, "chunk": 128, "vocab": 4096},
}

# One vLLM instance, one concurrency: run as a script (vLLM spawns its engine; LLM() must be under __main__).
_DRIVER = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              kv_cache_memory_bytes=a["kv_bytes"], max_model_len=a["max_len"], disable_log_stats=False)
    params = SamplingParams(temperature=0, max_tokens=a["tokens"], ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in a["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, detokenize=False), use_tqdm=False)
    def steps():
        return sum(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total")
    before = steps()
    started = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.outputs[0].token_ids) for r in out)
    print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens, "steps": steps() - before}), flush=True)
if __name__ == "__main__":
    main()
"""


def run_vllm(args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(_DRIVER)
        script.flush()
        done = subprocess.run(
            [sys.executable, script.name, json.dumps(args)], env=env, capture_output=True, text=True, check=False
        )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return result
    raise SystemExit(f"vLLM exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def server_side(before: dict[Any, float], after: dict[Any, float]) -> dict[str, float]:
    """Per request served on the AttendStream: the server's time, queued, computing (seconds, means)."""

    def delta(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    requests = delta("chunkattn_rpc_duration_seconds_count", rpc="AttendStream")
    if not requests:
        return {"requests": 0.0, "rpc_s": 0.0, "queue_s": 0.0, "compute_s": 0.0}
    return {
        "requests": requests,
        "rpc_s": delta("chunkattn_rpc_duration_seconds_sum", rpc="AttendStream") / requests,
        "queue_s": delta("chunkattn_queue_seconds_sum", rpc="AttendStream") / requests,
        "compute_s": delta("chunkattn_compute_seconds_sum", rpc="AttendStream") / requests,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts (default 1,8,32)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    shape = MODELS[a.model]
    import numpy as np

    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / a.model
        write_checkpoint(checkpoint, **shape)
        per_block = BLOCK_SIZE * 2 * shape["kv_heads"] * shape["head_dim"] * 4  # one layer's K and V page
        max_len = a.prompt + a.tokens + BLOCK_SIZE
        need = max(levels) * (shape["layers"] * -(-max_len // BLOCK_SIZE)) + 64  # blocks: no preemption
        flags = ["--hf-config", str(checkpoint / "config.json"), "--block-size", str(BLOCK_SIZE)]
        flags += ["--num-blocks", str(need + 64), "--idle-timeout-s", "0"]
        base = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKATTN_VLLM_")}
        with ServerProcess(*flags, python=SERVER_PYTHON) as server:
            for concurrency in levels:
                prompts = [rng.integers(3, shape["vocab"] - 1, size=a.prompt).tolist() for _ in range(concurrency)]
                args = {
                    "model": str(checkpoint), "prompts": prompts, "tokens": a.tokens, "max_len": max_len,
                    "kv_bytes": need * per_block,
                }  # fmt: skip
                alone = run_vllm(args, base)
                profile = Path(tmp) / f"profile-{concurrency}.json"
                before = server.metrics()
                env = {**base, "CHUNKATTN_VLLM_TARGET": server.target, "CHUNKATTN_VLLM_PROFILE": str(profile)}
                offloaded = run_vllm(args, env)
                deadline = time.monotonic() + 30
                while not profile.exists() and time.monotonic() < deadline:  # written as the worker closes
                    time.sleep(0.2)
                worker = json.loads(profile.read_text()) if profile.exists() else {}
                results.append(summary(concurrency, alone, offloaded, worker, server_side(before, server.metrics())))
                print_row(results[-1])
    report = {
        "benchmark": "vllm_offload",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
        "model": {"name": a.model, **shape},
        "prompt_tokens": a.prompt,
        "new_tokens": a.tokens,
        "results": results,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def summary(
    concurrency: int, alone: dict[str, Any], offloaded: dict[str, Any], worker: dict[str, Any], server: dict[str, float]
) -> dict[str, Any]:
    def rate(r: dict[str, Any]) -> float:
        return float(r["tokens"] / r["seconds"])

    def step(r: dict[str, Any]) -> float:
        return float(r["seconds"] / max(1, r["steps"]))

    calls = max(1, int(worker.get("calls", 0)))
    per_call = {k.removesuffix("_s"): worker.get(k, 0.0) / calls for k in ("metadata_s", "call_s")}
    return {
        "concurrency": concurrency,
        "alone": {"tokens_per_s": rate(alone), "step_s": step(alone), "steps": alone["steps"]},
        "offloaded": {"tokens_per_s": rate(offloaded), "step_s": step(offloaded), "steps": offloaded["steps"]},
        "throughput_ratio": rate(offloaded) / rate(alone),
        "step_ratio": step(offloaded) / step(alone),
        "layer_call": {
            "calls": int(worker.get("calls", 0)),
            "worker_s": per_call,
            "server_s": {"in_server": server["rpc_s"], "queued": server["queue_s"], "computing": server["compute_s"]},
            "transport_s": max(0.0, per_call["call"] - server["rpc_s"]),
        },
    }


def print_row(r: dict[str, Any]) -> None:
    a, o, c = r["alone"], r["offloaded"], r["layer_call"]
    print(
        f"concurrency {r['concurrency']:>3}: alone {a['tokens_per_s']:8.1f} tok/s {a['step_s'] * 1e3:7.2f} ms/step | "
        f"offloaded {o['tokens_per_s']:8.1f} tok/s {o['step_s'] * 1e3:7.2f} ms/step | "
        f"x{r['throughput_ratio']:.2f} throughput, x{r['step_ratio']:.2f} step"
    )
    w, s = c["worker_s"], c["server_s"]
    print(
        f"  per layer call ({c['calls']} calls): {w['call'] * 1e3:.3f} ms call = server {s['in_server'] * 1e3:.3f}"
        f" (queued {s['queued'] * 1e3:.3f}, computing {s['computing'] * 1e3:.3f}) + transport"
        f" {c['transport_s'] * 1e3:.3f}; vLLM's metadata to arrays {w['metadata'] * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
