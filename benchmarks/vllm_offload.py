"""vLLM alone against vLLM offloading its attention to a local chunkattn server, side by side in one run.

Runs in .venv-vllm, from the repository (``make bench-vllm-offload``, or ``.venv-vllm/bin/python -m
benchmarks.vllm_offload``; the server runs from the project's .venv, as users run it, with ``--backend``,
native by default, and its data plane on: ``--data-plane-tcp 127.0.0.1:0 --data-plane-ipc auto``). For each
concurrency (1, 8, 32 by default), one vLLM instance (greedy, float32, eager) per mode generates
``concurrency`` requests of ``--prompt`` tokens and ``--tokens`` new tokens: vLLM alone, offloaded over gRPC
(CHUNKATTN_DATA_PLANE=grpc) and offloaded over the data plane (=zmq; on one host the client takes its ipc
endpoint). Reported: output tokens/s and time per engine step (the generation's wall time over vLLM's own step
count), and the ratios offloaded / alone. With the plugin, where one layer's call goes (per call, mean): the
worker's side (vLLM's metadata to arrays; the call, the answer into vLLM's output included:
CHUNKATTN_VLLM_PROFILE) and the server's (per request from its /metrics: the RPC's time in the server, of which
queued and computing: rpc AttendStream over gRPC, rpc Attend over the data plane); the transport (the client's
encoding and decoding, the hop) is the call less the server's time.

Then a run where vLLM's own KV budget binds (``--budget-concurrency`` requests of ``--budget-prompt`` tokens at
once): vLLM alone with a kv_cache_memory_bytes that holds ``--budget-fit`` of them (it preempts or queues)
against vLLM offloaded with the same kv_cache_memory_bytes and CHUNKATTN_VLLM_KV_BLOCKS large enough for all
(the server holds the KV; vLLM's KV tensors hold none): tokens/s, vLLM's preemption counter
(vllm:num_preemptions) and the blocks its scheduler had, side by side (``--budget-concurrency 0``: no such run).

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

PLANES = ("grpc", "zmq")  # the offloaded modes: CHUNKATTN_DATA_PLANE
DATA_PLANE_FLAGS = ["--data-plane-tcp", "127.0.0.1:0", "--data-plane-ipc", "auto"]

# One vLLM instance, one concurrency: run as a script (vLLM spawns its engine; LLM() must be under __main__).
# Its KV cache (the worker's blocks, the bytes its KV tensors hold) comes back through collective_rpc.
_DRIVER = r"""
import json, os, sys, time
def kv_cache(worker):
    runner = worker.model_runner
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in runner.kv_caches}
    return {"num_blocks": int(runner.kv_cache_config.num_blocks), "local_kv_bytes": sum(storages.values())}
def main():
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              kv_cache_memory_bytes=a["kv_bytes"], max_model_len=a["max_len"], disable_log_stats=False)
    params = SamplingParams(temperature=0, max_tokens=a["tokens"], ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in a["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, detokenize=False), use_tqdm=False)
    def steps():
        return sum(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total")
    def preemptions():
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    before, preempted = steps(), preemptions()
    started = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.outputs[0].token_ids) for r in out)
    (kv,) = llm.collective_rpc(kv_cache)
    result = {"seconds": seconds, "tokens": tokens, "steps": steps() - before, "kv": kv}
    result["preemptions"] = preemptions() - preempted
    print("RESULT " + json.dumps(result), flush=True)
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


def server_side(before: dict[Any, float], after: dict[Any, float], rpc: str) -> dict[str, float]:
    """Per request served as ``rpc`` (AttendStream: the plugin's stream over gRPC; Attend: its calls over the
    data plane, the only Attend calls in a run): the server's time, queued, computing (seconds, means)."""

    def delta(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    requests = delta("chunkattn_rpc_duration_seconds_count", rpc=rpc)
    if not requests:
        return {"requests": 0.0, "rpc_s": 0.0, "queue_s": 0.0, "compute_s": 0.0}
    return {
        "requests": requests,
        "rpc_s": delta("chunkattn_rpc_duration_seconds_sum", rpc=rpc) / requests,
        "queue_s": delta("chunkattn_queue_seconds_sum", rpc=rpc) / requests,
        "compute_s": delta("chunkattn_compute_seconds_sum", rpc=rpc) / requests,
    }


def client_has_data_plane() -> bool:
    """Whether this chunkattn-client can take the data plane (ChunkAttnClient's data_plane)."""
    import inspect

    from chunkattn_client import ChunkAttnClient

    return "data_plane" in inspect.signature(ChunkAttnClient).parameters


def offloaded_run(
    server: ServerProcess, args: dict[str, Any], env: dict[str, str], plane: str, profile: Path
) -> dict[str, Any]:
    """One offloaded vLLM run over ``plane`` (grpc, zmq): its result, the worker's profile and the server's side."""
    before = server.metrics()
    env = {**env, "CHUNKATTN_VLLM_TARGET": server.target, "CHUNKATTN_VLLM_PROFILE": str(profile)}
    env["CHUNKATTN_DATA_PLANE"] = plane
    result = run_vllm(args, env)
    deadline = time.monotonic() + 30
    while not profile.exists() and time.monotonic() < deadline:  # written as the worker closes
        time.sleep(0.2)
    result["worker"] = json.loads(profile.read_text()) if profile.exists() else {}
    result["server"] = server_side(before, server.metrics(), "AttendStream" if plane == "grpc" else "Attend")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts (default 1,8,32)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--planes", default="grpc,zmq", help="the offloaded modes, comma-separated (default grpc,zmq)")
    p.add_argument("--backend", default="native", help="the server's --backend (default native)")
    p.add_argument("--budget-concurrency", type=int, default=32, help="the KV budget run's requests (0: no run)")
    p.add_argument("--budget-prompt", type=int, default=1024, help="its prompt tokens per request (default 1024)")
    p.add_argument("--budget-tokens", type=int, default=32, help="its new tokens per request (default 32)")
    p.add_argument("--budget-fit", type=int, default=4, help="requests vLLM alone's KV budget holds (default 4)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    planes = [x for x in a.planes.split(",") if x]
    if any(x not in PLANES for x in planes):
        p.error(f"--planes takes {', '.join(PLANES)}")
    skipped: dict[str, str] = {}
    if "zmq" in planes and not client_has_data_plane():
        planes.remove("zmq")
        skipped["zmq"] = "this chunkattn-client has no data plane"
        print("offloaded over the data plane: skipped, this chunkattn-client has no data plane")
    shape = MODELS[a.model]
    import numpy as np

    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []
    budget: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / a.model
        write_checkpoint(checkpoint, **shape)
        need, max_len = blocks_for(shape, max(levels, default=1), a.prompt, a.tokens)
        budget_need, _ = blocks_for(shape, a.budget_concurrency, a.budget_prompt, a.budget_tokens)
        flags = ["--hf-config", str(checkpoint / "config.json"), "--block-size", str(BLOCK_SIZE)]
        flags += ["--num-blocks", str(max(need, budget_need) + 64), "--idle-timeout-s", "0", "--backend", a.backend]
        flags += DATA_PLANE_FLAGS if "zmq" in planes else []
        base = {
            k: v for k, v in os.environ.items() if not k.startswith("CHUNKATTN_VLLM_") and k != "CHUNKATTN_DATA_PLANE"
        }
        with ServerProcess(*flags, python=SERVER_PYTHON) as server:
            for concurrency in levels:
                prompts = [rng.integers(3, shape["vocab"] - 1, size=a.prompt).tolist() for _ in range(concurrency)]
                args = {
                    "model": str(checkpoint), "prompts": prompts, "tokens": a.tokens, "max_len": max_len,
                    "kv_bytes": need * page_bytes(shape),
                }  # fmt: skip
                alone = run_vllm(args, base)
                offloaded = {
                    plane: offloaded_run(server, args, base, plane, Path(tmp) / f"profile-{concurrency}-{plane}.json")
                    for plane in planes
                }
                results.append(summary(concurrency, alone, offloaded))
                print_row(results[-1])
            if a.budget_concurrency:
                prompts = [
                    rng.integers(3, shape["vocab"] - 1, size=a.budget_prompt).tolist()
                    for _ in range(a.budget_concurrency)
                ]
                budget = budget_run(a, shape, prompts, checkpoint, server, base, planes[-1] if planes else "grpc", tmp)
                print_budget(budget)
    report = {
        "benchmark": "vllm_offload",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
        "model": {"name": a.model, **shape},
        "server_backend": a.backend,
        "prompt_tokens": a.prompt,
        "new_tokens": a.tokens,
        "planes_skipped": skipped,
        "results": results,
        "kv_budget": budget,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def page_bytes(shape: dict[str, Any]) -> int:
    """One layer's K and V page of one block (vLLM's bytes per block: one layer's page a KV cache group)."""
    return BLOCK_SIZE * 2 * int(shape["kv_heads"]) * int(shape["head_dim"]) * 4


def blocks_for(shape: dict[str, Any], requests: int, prompt: int, tokens: int) -> tuple[int, int]:
    """Blocks for ``requests`` at once with every layer holding its whole sequence (an upper bound: vLLM never
    preempts with that many), and the max_model_len they take."""
    max_len = prompt + tokens + BLOCK_SIZE
    return requests * (int(shape["layers"]) * -(-max_len // BLOCK_SIZE)) + 64, max_len


def budget_run(
    a: argparse.Namespace,
    shape: dict[str, Any],
    prompts: list[list[int]],
    checkpoint: Path,
    server: ServerProcess,
    base: dict[str, str],
    plane: str,
    tmp: str,
) -> dict[str, Any]:
    """vLLM alone on a KV budget of ``--budget-fit`` requests against vLLM offloaded over ``plane`` with the same
    kv_cache_memory_bytes and the server sizing its KV (CHUNKATTN_VLLM_KV_BLOCKS: all the requests at once)."""
    need, max_len = blocks_for(shape, len(prompts), a.budget_prompt, a.budget_tokens)
    fit, _ = blocks_for(shape, max(1, a.budget_fit), a.budget_prompt, a.budget_tokens)
    kv_bytes = fit * page_bytes(shape)
    args = {"model": str(checkpoint), "prompts": prompts, "tokens": a.budget_tokens, "max_len": max_len}
    args["kv_bytes"] = kv_bytes

    def row(r: dict[str, Any]) -> dict[str, Any]:
        return {
            "tokens_per_s": r["tokens"] / r["seconds"],
            "seconds": r["seconds"],
            "steps": r["steps"],
            "preemptions": r["preemptions"],
            "num_blocks": r["kv"]["num_blocks"],
            "local_kv_bytes": r["kv"]["local_kv_bytes"],
        }

    alone = row(run_vllm(args, base))
    env = {**base, "CHUNKATTN_VLLM_KV_BLOCKS": str(need)}
    offloaded = row(offloaded_run(server, args, env, plane, Path(tmp) / "profile-budget.json"))
    return {
        "concurrency": len(prompts),
        "prompt_tokens": a.budget_prompt,
        "new_tokens": a.budget_tokens,
        "kv_cache_memory_bytes": kv_bytes,
        "chunkattn_vllm_kv_blocks": need,
        "plane": plane,
        "alone": alone,
        "offloaded": offloaded,
        "throughput_ratio": offloaded["tokens_per_s"] / alone["tokens_per_s"],
    }


def summary(concurrency: int, alone: dict[str, Any], offloaded: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One concurrency's row: vLLM alone, and per plane the offloaded run, its ratios to alone's and where its
    layer calls' time went."""

    def rate(r: dict[str, Any]) -> float:
        return float(r["tokens"] / r["seconds"])

    def step(r: dict[str, Any]) -> float:
        return float(r["seconds"] / max(1, r["steps"]))

    def plane(r: dict[str, Any]) -> dict[str, Any]:
        worker, s = r["worker"], r["server"]
        calls = max(1, int(worker.get("calls", 0)))
        per_call = {k.removesuffix("_s"): worker.get(k, 0.0) / calls for k in ("metadata_s", "call_s")}
        return {
            "tokens_per_s": rate(r),
            "step_s": step(r),
            "steps": r["steps"],
            "local_kv_bytes": r["kv"]["local_kv_bytes"],
            "throughput_ratio": rate(r) / rate(alone),
            "step_ratio": step(r) / step(alone),
            "layer_call": {
                "calls": int(worker.get("calls", 0)),
                "worker_s": per_call,
                "server_s": {"in_server": s["rpc_s"], "queued": s["queue_s"], "computing": s["compute_s"]},
                "transport_s": max(0.0, per_call["call"] - s["rpc_s"]),
            },
        }

    return {
        "concurrency": concurrency,
        "alone": {
            "tokens_per_s": rate(alone),
            "step_s": step(alone),
            "steps": alone["steps"],
            "local_kv_bytes": alone["kv"]["local_kv_bytes"],
        },
        "offloaded": {name: plane(r) for name, r in offloaded.items()},
    }


NAMES = {"grpc": "over gRPC", "zmq": "over the data plane"}


def print_row(r: dict[str, Any]) -> None:
    a = r["alone"]
    print(f"concurrency {r['concurrency']:>3}: alone {a['tokens_per_s']:8.1f} tok/s {a['step_s'] * 1e3:7.2f} ms/step")
    for name, o in r["offloaded"].items():
        c = o["layer_call"]
        w, s = c["worker_s"], c["server_s"]
        print(
            f"  offloaded {NAMES[name]:<20} {o['tokens_per_s']:8.1f} tok/s {o['step_s'] * 1e3:7.2f} ms/step |"
            f" x{o['throughput_ratio']:.2f} throughput, x{o['step_ratio']:.2f} step"
        )
        print(
            f"    per layer call ({c['calls']} calls): {w['call'] * 1e3:.3f} ms call = server"
            f" {s['in_server'] * 1e3:.3f} (queued {s['queued'] * 1e3:.3f}, computing {s['computing'] * 1e3:.3f}) +"
            f" transport {c['transport_s'] * 1e3:.3f}; vLLM's metadata to arrays {w['metadata'] * 1e3:.3f} ms"
        )


def print_budget(b: dict[str, Any]) -> None:
    a, o = b["alone"], b["offloaded"]
    print(
        f"KV budget: {b['concurrency']} requests of {b['prompt_tokens']} tokens, kv_cache_memory_bytes"
        f" {b['kv_cache_memory_bytes']}: alone {a['tokens_per_s']:.1f} tok/s, {a['num_blocks']} blocks,"
        f" {a['preemptions']:.0f} preemptions | offloaded {NAMES[b['plane']]} (CHUNKATTN_VLLM_KV_BLOCKS"
        f" {b['chunkattn_vllm_kv_blocks']}) {o['tokens_per_s']:.1f} tok/s, {o['num_blocks']} blocks,"
        f" {o['preemptions']:.0f} preemptions, local KV {o['local_kv_bytes']} bytes | x{b['throughput_ratio']:.2f}"
        " throughput"
    )


if __name__ == "__main__":
    sys.exit(main())
