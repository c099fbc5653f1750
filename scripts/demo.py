"""`make demo`: a CPU server, a 30-second verified bench with an HTML report, and a clean stop.

Starts chunkattn-server (the demo model: 4 layers, 3 chunked with C = 1024 and 1 global) on free loopback
ports, waits until it is SERVING, runs `chunkattn bench` for 30 s at concurrency 4 with --verify and the
server's metrics, prints the table, then stops the server with SIGTERM and checks that it exited 0.
Reports land in build/demo/ (report.html, report.json). Extra arguments go to the bench.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OUT = ROOT / "build" / "demo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_port(), free_port()
    target, metrics = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    log = (OUT / "server.log").open("w")
    print(f"demo: starting chunkattn-server on {target} (metrics {metrics}; log {OUT / 'server.log'})", flush=True)
    server = subprocess.Popen(
        [str(BIN / "chunkattn-server"), "--port", str(port), "--metrics-port", str(metrics_port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        if subprocess.run([str(BIN / "chunkattn"), "health", "--target", target, "--wait", "120"]).returncode:
            print(f"demo: the server did not come up; its log:\n{(OUT / 'server.log').read_text()}", file=sys.stderr)
            return 1
        subprocess.run([str(BIN / "chunkattn"), "info", "--target", target], check=True)
        bench = [
            str(BIN / "chunkattn"), "bench", "--target", target, "--duration", "30", "--warmup", "2",
            "--concurrency", "4", "--prompt-len", "256:2048", "--output-len", "16:64", "--prefill-chunk", "512",
            "--verify", "50", "--metrics-url", metrics,
            "--html", str(OUT / "report.html"), "--json", str(OUT / "report.json"), *sys.argv[1:],
        ]  # fmt: skip
        print("demo: " + " ".join(bench[1:]), flush=True)
        rc = subprocess.run(bench).returncode
        print(f"demo: HTML report {OUT / 'report.html'}, JSON {OUT / 'report.json'}")
        return rc
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
        print(f"demo: server stopped (exit {code})")
        log.close()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
