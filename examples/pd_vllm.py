"""Prefill/decode disaggregation for vLLM whose KV never leaves chunkattn: one machine, end to end.

Starts a chunkattn server (two with ``--two-servers``), a prefill and a decode vLLM OpenAI server (the plugin
on, the chunkattn connector loaded: docs/vllm.md) and the proxy (examples/pd_proxy.py), sends prompts through
the proxy, sends the same prompts to the decode instance alone (it computes them itself), and checks that the
answers are the same tokens. It prints what the server(s) counted: handoffs, and bytes copied inside a server
or sent between the two. The model is a small random-weight Llama 4 (chunked and global layers) written here.

    make pd-demo                                   # or, in the vLLM venv:
    .venv-vllm/bin/python examples/pd_vllm.py [--two-servers] [--prompts 4] [--tokens 300] [--max-tokens 16]

Run it from the repository's root with the vLLM venv (make test-vllm makes it); the chunkattn server runs from
.venv (CHUNKATTN_SERVER_PYTHON to use another).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.pd_proxy import Proxy  # noqa: E402
from tests.helpers.llama4 import write_checkpoint  # noqa: E402

SERVER_PYTHON = os.environ.get("CHUNKATTN_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BLOCK_SIZE = 32
CHUNK = 64
CONNECTOR = {
    "kv_connector": "ChunkAttnConnector",
    "kv_connector_module_path": "chunkattn_client.vllm.connector",
    "kv_role": "kv_both",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float = 300) -> None:
    """Until ``url`` answers; RuntimeError with the end of ``log`` when ``proc`` exits or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            ended = proc.poll() is not None
            if ended or time.monotonic() > deadline:
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
                why = f"exited with {proc.returncode}" if ended else f"did not start within {timeout_s:.0f} s"
                raise RuntimeError(f"{what} {why}; the end of {log}:\n{tail}") from None
            time.sleep(1)


@contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A subprocess logging to ``log``, stopped with SIGTERM (then SIGKILL) at the end."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def chunkattn_server(stack: ExitStack, checkpoint: Path, logs: Path, name: str) -> tuple[str, int]:
    port, metrics = free_port(), free_port()
    flags = ["--port", str(port), "--metrics-port", str(metrics), "--hf-config", str(checkpoint / "config.json")]
    flags += ["--block-size", str(BLOCK_SIZE), "--kv-memory-mib", "256", "--dtype", "float32"]
    cmd = [SERVER_PYTHON, "-m", "chunkattn_server", *flags]
    proc = stack.enter_context(process(cmd, dict(os.environ), logs / name))
    wait_for(f"http://127.0.0.1:{metrics}/readyz", proc, f"chunkattn server {name}", logs / name, 120)
    return f"127.0.0.1:{port}", metrics


def vllm_server(stack: ExitStack, checkpoint: Path, target: str, env: dict[str, str], logs: Path, name: str) -> str:
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKATTN_VLLM_")}
    environment.update(env, CHUNKATTN_VLLM_TARGET=target, CHUNKATTN_VLLM_KV_BLOCKS="256")
    flags = ["--model", str(checkpoint), "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32"]
    flags += ["--enforce-eager", "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048"]
    flags += ["--kv-transfer-config", json.dumps(CONNECTOR), "--shutdown-timeout", "10"]
    # On the CPU this fraction of the machine's memory must be free at start; the KV is sized by the plugin.
    flags += ["--gpu-memory-utilization", "0.1"]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags]
    proc = stack.enter_context(process(cmd, environment, logs / name))
    wait_for(f"http://127.0.0.1:{port}/health", proc, f"vLLM {name}", logs / name)
    return f"http://127.0.0.1:{port}"


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        choice = json.load(r)["choices"][0]
    tokens = list(choice.get("token_ids") or [])
    if len(tokens) != max_tokens:
        raise RuntimeError(f"{url} answered {len(tokens)} token ids for max_tokens={max_tokens}: {choice}")
    return tokens


def counted(metrics_port: int) -> dict[str, float]:
    """The handoff counters of a server's /metrics, summed over labels that are not 'op' or 'where'."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("chunkattn_handoff") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            if 'code="OK"' in name or ("_total{" in name and "code=" not in name):
                key = name.replace(',code="OK"', "").replace('code="OK",', "")
                out[key] = out.get(key, 0.0) + float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--two-servers", action="store_true", help="prefill and decode on two chunkattn servers")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=300, help="prompt length (crosses chunks of 64)")
    parser.add_argument("--max-tokens", type=int, default=16)
    a = parser.parse_args(argv)
    import random

    logs = ROOT / "build" / "pd-demo"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        checkpoint = Path(tmp) / "tiny-llama4"
        write_checkpoint(checkpoint, layers=4, heads=4, kv_heads=2, head_dim=64, hidden=256, chunk=CHUNK, vocab=512)
        print(f"logs in {logs}")
        prefill_target, prefill_metrics = chunkattn_server(stack, checkpoint, logs, "chunkattn-prefill.log")
        decode_target, decode_metrics = (
            chunkattn_server(stack, checkpoint, logs, "chunkattn-decode.log")
            if a.two_servers
            else (prefill_target, prefill_metrics)
        )
        pushed = {"CHUNKATTN_VLLM_GRANT_TARGET": decode_target} if a.two_servers else {}
        prefill = vllm_server(stack, checkpoint, prefill_target, pushed, logs, "vllm-prefill.log")
        decode = vllm_server(stack, checkpoint, decode_target, {}, logs, "vllm-decode.log")
        Proxy.prefill, Proxy.decode = prefill, decode
        proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        stack.callback(proxy.shutdown)
        via = f"http://127.0.0.1:{proxy.server_address[1]}"
        print(f"chunkattn {prefill_target} / {decode_target}; vLLM prefill {prefill}, decode {decode}; proxy {via}")

        rng = random.Random(0)
        prompts = [[rng.randrange(3, 512) for _ in range(a.tokens + 7 * i)] for i in range(a.prompts)]
        model = str(checkpoint)
        same = True
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            handed = complete(via, model, prompt, a.max_tokens)
            took = time.perf_counter() - started
            alone = complete(decode, model, prompt, a.max_tokens)
            same &= handed == alone
            shown = f"{len(prompt)} tokens): {took:.2f} s via the proxy, {handed[:6]}..."
            print(f"prompt {i} ({shown}; as alone: {handed == alone}")
        for name, port in {"prefill": prefill_metrics, "decode": decode_metrics}.items():
            print(f"chunkattn ({name} side) counted: {counted(port)}")
            if not a.two_servers:
                break
        print("every answer the same as the decode instance computing the prompt itself" if same else "ANSWERS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
