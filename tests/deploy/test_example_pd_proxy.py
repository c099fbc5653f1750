"""examples/pd_proxy.py against two stand-in instances (stdlib HTTP servers that answer as vLLM's OpenAI server
does, recording what they were sent): the prefill request is the client's with max_tokens 1, no stream and
``{"do_remote_decode": true}``; the decode request is the client's with the prefill answer's kv_transfer_params;
a stream is relayed as it comes; a failed or param-less prefill leaves the decode request as the client sent it;
the decode instance's refusal is passed on; bad requests get 400/404. The real instances are examples/pd_vllm.py's
(make pd-demo) and tests/vllm/test_pd.py's."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from examples.pd_proxy import Proxy

PARAMS = {"do_remote_prefill": True, "chunkattn_grant": "g" * 32, "num_tokens": 5}


class Upstream:
    """A stand-in instance: records each body; answers ``answer`` (JSON), an SSE stream when asked for one, or
    ``status`` with an error."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer = answer
        self.status = 200
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                upstream.bodies.append(body)
                if upstream.status != 200:
                    data = json.dumps({"error": "refused here"}).encode()
                    self.send_response(upstream.status)
                elif body.get("stream"):
                    data = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                else:
                    data = json.dumps(upstream.answer).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def setup() -> Iterator[tuple[Upstream, Upstream, str]]:
    prefill = Upstream({"choices": [{"token_ids": [9]}], "kv_transfer_params": PARAMS})
    decode = Upstream({"choices": [{"token_ids": [1, 2, 3]}]})
    Proxy.prefill, Proxy.decode = prefill.url, decode.url
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield prefill, decode, f"http://127.0.0.1:{proxy.server_address[1]}"
    finally:
        proxy.shutdown()
        proxy.server_close()
        prefill.close()
        decode.close()


def post(url: str, body: Any) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_prompt_goes_to_prefill_for_one_token_then_to_decode_with_its_params(
    setup: tuple[Upstream, Upstream, str],
) -> None:
    prefill, decode, proxy = setup
    asked = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0}
    status, data = post(proxy + "/v1/completions", asked)
    assert status == 200
    assert json.loads(data) == decode.answer
    (first,) = prefill.bodies
    assert first == {**asked, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    (second,) = decode.bodies
    assert second == {**asked, "kv_transfer_params": PARAMS}


def test_a_stream_is_relayed_and_chat_completions_are_proxied(setup: tuple[Upstream, Upstream, str]) -> None:
    prefill, decode, proxy = setup
    status, data = post(proxy + "/v1/chat/completions", {"model": "m", "messages": [], "stream": True})
    assert status == 200
    assert data == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    assert prefill.bodies[0]["stream"] is False
    assert "stream_options" not in prefill.bodies[0]
    assert decode.bodies[0]["kv_transfer_params"] == PARAMS


def test_without_prefill_params_the_decode_instance_gets_the_request_as_sent(
    setup: tuple[Upstream, Upstream, str],
) -> None:
    prefill, decode, proxy = setup
    asked = {"model": "m", "prompt": [1], "max_tokens": 2}
    prefill.answer = {"choices": []}  # a prefill instance without the connector: no params
    assert post(proxy + "/v1/completions", asked)[0] == 200
    prefill.status = 500  # a failing prefill instance, and a client sending params of its own: dropped
    assert post(proxy + "/v1/completions", {**asked, "kv_transfer_params": PARAMS})[0] == 200
    assert decode.bodies == [asked, asked]


def test_refusals_are_passed_on_or_explained(setup: tuple[Upstream, Upstream, str]) -> None:
    _, decode, proxy = setup
    decode.status = 400
    status, data = post(proxy + "/v1/completions", {"model": "m", "prompt": [1]})
    assert (status, json.loads(data)) == (400, {"error": "refused here"})
    status, data = post(proxy + "/v1/completions", b"not json")
    assert status == 400
    assert b"not JSON" in data
    assert post(proxy + "/v1/other", {})[0] == 404
    with urllib.request.urlopen(proxy + "/health", timeout=10) as r:
        assert r.status == 200
