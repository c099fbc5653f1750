"""A prefill/decode proxy for two vLLM OpenAI servers whose attention is on chunkattn (docs/vllm.md).

A client sends its completion to the proxy; the proxy sends the prompt to the prefill instance with
``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}`` (the prefill instance's chunkattn
connector hands the prompt's KV blocks over to a grant on the server and answers with the grant's params), then
the original request with those params to the decode instance, which copies the grant into its own blocks and
decodes. The client gets the decode instance's answer (streamed when it asked for a stream). No KV passes
through the proxy or, on one chunkattn server, over the network.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Standard library only. /v1/completions and /v1/chat/completions are proxied; /health answers 200 when both
instances do. A prefill instance that fails or gives no params is not fatal: the decode instance then computes
the prompt itself (the answer is the same, only slower), and the proxy logs why. A client's own
``kv_transfer_params`` are dropped: only the prefill instance's reach the decode instance.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("pd_proxy")
PATHS = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0


def post(url: str, body: dict[str, Any]) -> Any:
    """POST ``body`` as JSON; the open response (the caller reads and closes it)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)


def prefill_params(prefill: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill instance's kv_transfer_params for ``body``'s prompt (the prompt computed there, one token
    sampled and dropped), or None when it gives none."""
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    first.pop("max_completion_tokens", None)
    first.pop("stream_options", None)
    try:
        with post(prefill + path, first) as response:
            params = json.load(response).get("kv_transfer_params")
    except (urllib.error.URLError, OSError, ValueError) as e:
        log.warning("the prefill instance failed (%s): the decode instance computes the prompt", e)
        return None
    if not params:
        log.warning("the prefill instance gave no kv_transfer_params: is its chunkattn connector on?")
    return params or None


class Proxy(BaseHTTPRequestHandler):
    """One request: prefill, then decode (see the module doc)."""

    prefill = ""
    decode = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path != "/health":
            self._answer(404, {"error": f"no {self.path}; the proxy serves {', '.join(PATHS)} and /health"})
            return
        try:
            for url in (self.prefill, self.decode):
                with urllib.request.urlopen(url + "/health", timeout=5):
                    pass
        except (urllib.error.URLError, OSError) as e:
            self._answer(503, {"error": f"an instance is not healthy: {e}"})
            return
        self._answer(200, {"status": "ok"})

    def do_POST(self) -> None:
        if self.path not in PATHS:
            self._answer(404, {"error": f"no {self.path}; the proxy serves {', '.join(PATHS)}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as e:
            self._answer(400, {"error": f"the request body is not JSON: {e}"})
            return
        body.pop("kv_transfer_params", None)  # a client's own never reach an instance: only the prefill side's
        params = prefill_params(self.prefill, self.path, body)
        second = {**body, "kv_transfer_params": params} if params else body
        try:
            response = post(self.decode + self.path, second)
        except urllib.error.HTTPError as e:  # the decode instance's own refusal, passed on
            self._relay(e.code, e.headers.get("Content-Type", "application/json"), e.read())
            return
        except (urllib.error.URLError, OSError) as e:
            self._answer(502, {"error": f"the decode instance failed: {e}"})
            return
        with response:
            kind = response.headers.get("Content-Type", "application/json")
            if body.get("stream"):
                self._stream(kind, response)
            else:
                self._relay(response.status, kind, response.read())

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        self._relay(status, "application/json", json.dumps(body).encode())

    def _relay(self, status: int, kind: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, kind: str, response: Any) -> None:
        """Server-sent events, relayed chunk by chunk as they come."""
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while chunk := response.read1(65536):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    parser.add_argument("--decode", required=True, help="the decode instance's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pd_proxy %(message)s")
    Proxy.prefill, Proxy.decode = a.prefill.rstrip("/"), a.decode.rstrip("/")
    server = ThreadingHTTPServer((a.host, a.port), Proxy)
    log.info("proxying %s: prefill %s, decode %s", ", ".join(PATHS), Proxy.prefill, Proxy.decode)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
