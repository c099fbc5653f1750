"""What a real server refuses at start, and on SIGHUP, and that a refusal leaves a running server alone: a port
another server holds (gRPC's or the metrics one), a token file that gives a key twice (issue 27)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from chunkattn_client import ChunkAttnClient, ChunkAttnError
from chunkattn_server import CacheConfig, EngineConfig
from chunkattn_server import server as server_module
from chunkattn_server.__main__ import main
from chunkattn_server.config import ServerConfig
from chunkattn_server.service.auth import token_digest
from tests.helpers.harness import MODELS
from tests.helpers.server_process import SMALL, ServerProcess, free_port

FLAGS = [*SMALL, "--num-blocks", "64"]
OLD, NEW = "token-of-the-first-entry-0123456789", "token-of-the-second-entry-0123456789"


def entry(token: str) -> str:
    return json.dumps({"tokens_sha256": [token_digest(token)]})


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    path.write_text(f'{{"tenants": {{"t": {entry(OLD)}}}}}')
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tokens: Path) -> Iterator[ServerProcess]:
    with ServerProcess(*FLAGS, "--auth-tokens", str(tokens)) as s:
        yield s


def start(*flags: str, timeout_s: float = 60.0) -> tuple[int | None, str]:
    """Start a server and wait: (its exit status, its output) once it exits; (None, its output) if it serves
    instead (then killed) or is still starting after timeout_s."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chunkattn_server", *flags], stdout=out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            out.seek(0)
            if "serving chunkattn.v1.ChunkAttn" in out.read():
                break
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            status = None
        else:
            status = proc.returncode
        out.seek(0)
        return status, out.read()


def call(server: ServerProcess, token: str) -> grpc.StatusCode:
    """The status of a call with ``token``."""
    with ChunkAttnClient(server.target, token=token, timeout_s=20) as client:
        try:
            client.info()
        except ChunkAttnError as e:
            return e.code
    return grpc.StatusCode.OK


@pytest.mark.server
def test_a_second_server_on_a_port_in_use_exits_naming_it_and_the_first_serves_on(server: ServerProcess) -> None:
    """gRPC sets SO_REUSEPORT by default: the second server used to start and take a share of the new
    connections, whose sequences were on the first."""
    status, out = start("--port", str(server.port), "--metrics-port", "0", *FLAGS)
    assert status == 2, out
    assert f"cannot start: cannot listen on 127.0.0.1:{server.port} (--port): the port is in use" in out
    assert "Traceback" not in out
    status, out = start("--port", str(free_port()), "--metrics-port", str(server.metrics_port), *FLAGS)
    assert status == 2, out
    assert f"cannot start: cannot listen on 127.0.0.1:{server.metrics_port} (--metrics-port): the port is in use" in out
    assert "Traceback" not in out
    for _ in range(5):  # fresh connections, every one to the first server
        assert call(server, OLD) == grpc.StatusCode.OK
    assert server.metrics()


@pytest.mark.server
def test_grpc_itself_refuses_a_port_that_an_earlier_server_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check before the pool aside (a server that took the port since, say), gRPC's own bind must fail
    too, even against a server that allows sharing the port (gRPC's default, as servers before issue 27)."""
    monkeypatch.setattr(server_module, "_check_free", lambda *_: None)
    holder = grpc.server(concurrent.futures.ThreadPoolExecutor(1))  # SO_REUSEPORT, as gRPC sets by default
    port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    try:
        config = EngineConfig(MODELS["mqa"], CacheConfig(block_size=4, num_blocks=8), device="cpu")
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\(--port\\): the port is in use"):
            asyncio.run(asyncio.wait_for(server_module.serve(config, ServerConfig(port=port, metrics_port=0)), 30))
    finally:
        holder.stop(None)


def test_one_port_for_grpc_and_the_metrics_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    port = str(free_port())
    with caplog.at_level(logging.ERROR):
        assert main(["--port", port, "--metrics-port", port, "--num-blocks", "8"]) == 2
    assert f"--port and --metrics-port are both {port}: give each a port of its own" in caplog.text


@pytest.mark.server
def test_a_token_file_that_gives_a_key_twice_stops_the_server_at_start(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(f'{{"tenants": {{"t": {entry(OLD)}, "t": {entry(NEW)}}}}}')
    path.chmod(0o600)
    status, out = start("--port", "0", "--metrics-port", "0", "--auth-tokens", str(path), *FLAGS)
    assert status == 2, out
    assert f"cannot start: {path}: 't' is given twice in 'tenants'; give each once" in out
    assert "Traceback" not in out


@pytest.mark.server
def test_sighup_with_a_token_file_that_gives_a_key_twice_keeps_the_old_one(server: ServerProcess, tokens: Path) -> None:
    """Last-wins would have kept only the second entry: the first one's token refused."""
    tokens.write_text(f'{{"tenants": {{"t": {entry(OLD)}, "t": {entry(NEW)}}}}}')
    before = server.log()
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "token file" not in server.log()[len(before) :]:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    assert "the token file was not reloaded, the previous one stays in force" in server.log()[len(before) :]
    assert "'t' is given twice in 'tenants'" in server.log()[len(before) :]
    assert call(server, OLD) == grpc.StatusCode.OK
    assert call(server, NEW) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("host", ["[::1]", "::1", ""])
def test_the_port_check_reads_hosts_as_grpc_does(host: str) -> None:
    """A bracketed IPv6 host and the empty host (every address) are checked too, not skipped as unresolvable."""
    import socket

    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on {re.escape(host)}:{port} \(--port\): the port is in use"):
            server_module._check_free(host, port, "--port")


def test_a_config_file_that_gives_an_option_twice_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the token and scales files: --config's JSON keeps no last-wins (auth_tokens then null would switch
    authentication off)."""
    from chunkattn_server.flags import parse

    path = tmp_path / "config.json"
    path.write_text('{"auth_tokens": "tokens.json", "port": 1, "auth_tokens": null}')
    with pytest.raises(SystemExit) as e:
        parse(["--config", str(path)])
    assert e.value.code == 2
    assert "'auth_tokens' is given twice at the top level" in capsys.readouterr().err
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        parse(["--config", str(path)])
    assert "expected a JSON object of options, got list" in capsys.readouterr().err


def test_calibrate_with_tenants_is_refused_only_when_a_layer_would_calibrate() -> None:
    from chunkattn_server.config import check_together
    from chunkattn_server.errors import ConfigError
    from chunkattn_server.kv.scales import KVScales

    model = MODELS["gqa"]
    server = ServerConfig(auth_tokens="tokens.json")
    given = KVScales((0.5,), (0.25,), calibrate=True)  # every layer has its scales: nothing to calibrate
    check_together(EngineConfig(model, CacheConfig(num_blocks=8, block_size=4, dtype="fp8", scales=given)), server)
    calibrating = EngineConfig(
        model, CacheConfig(num_blocks=8, block_size=4, dtype="fp8", scales=KVScales(calibrate=True))
    )
    with pytest.raises(ConfigError, match="--kv-scales calibrate lets the first write of any client"):
        check_together(calibrating, server)
