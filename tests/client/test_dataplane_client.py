"""The clients over the data plane (#37), against real servers: the choice (auto, grpc, zmq; ipc on this host,
tcp from another), answers identical to gRPC's (sequence and block calls, sync and asyncio, unary and stream),
the server's errors with their code and message, sessions that expire under the calls, a server that freezes
(DEADLINE_EXCEEDED, the heartbeat) or dies mid-call (UNAVAILABLE), and the thin import."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from chunkattn_client import AsyncChunkAttnClient, BatchEntry, BlockRows, ChunkAttnClient, ChunkAttnError, dataplane
from chunkattn_client.cli import main
from chunkattn_client.dataplane import HEARTBEAT_TIMEOUT_MS
from tests.helpers.server_process import SMALL, ServerProcess, counter

pytestmark = pytest.mark.server

H, HKV, D = 4, 2, 16  # SMALL's heads
PLANE = ["--data-plane-tcp", "127.0.0.1:0", "--data-plane-ipc", "auto"]
FAST = ["--backend", "torch", "--host", "127.0.0.1"]  # no native build: the server starts in seconds


@pytest.fixture(scope="module")
def plane() -> Iterator[ServerProcess]:
    """A server that offers the data plane on tcp and ipc."""
    with ServerProcess(*SMALL, *FAST, *PLANE) as server:
        yield server


@pytest.fixture(scope="module")
def plain() -> Iterator[ServerProcess]:
    """A server without the data plane's flags."""
    with ServerProcess(*SMALL, *FAST) as server:
        yield server


def qkv(tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((tokens, H, D), dtype=np.float32),
        rng.standard_normal((tokens, HKV, D), dtype=np.float32),
        rng.standard_normal((tokens, HKV, D), dtype=np.float32),
    )


# (layer, entries as (position, tokens), seed): a prefill across a chunk boundary, then decodes, every layer.
STEPS = [(layer, 0, 20, 1) for layer in range(4)] + [(layer, 20 + t, 1, 2 + t) for t in range(3) for layer in range(4)]


def run_sequence(call: Any, seq: str) -> list[np.ndarray]:
    out = []
    for layer, position, tokens, seed in STEPS:
        q, k, v = qkv(tokens, seed)
        out.append(np.array(call(layer, [BatchEntry(seq, position, tokens)], q, k, v)))
    return out


def block_calls(client: Any) -> list[tuple[int, BlockRows, Any, Any, Any]]:
    """Two block-addressed calls on a new space of ``client``'s: a 5-token row, then its next token."""
    space = client.open_block_space(4)
    first = BlockRows(space.space_id, list(range(5)), [0, 5], [5], [[0, 1]])
    second = BlockRows(space.space_id, [5], [0, 1], [6], [[0, 1]])
    return [(0, first, *qkv(5, 7)), (0, second, *qkv(1, 8))]


# -- the choice -------------------------------------------------------------------------------------------------


def test_auto_takes_the_data_plane_where_offered_and_grpc_where_not(plane: ServerProcess, plain: ServerProcess) -> None:
    with ChunkAttnClient(plane.target) as offered, ChunkAttnClient(plain.target) as refused:
        assert offered.data_plane == refused.data_plane == "auto"  # nothing is opened before the first Attend
        q, k, v = qkv(1, 0)
        offered.attend(0, [BatchEntry("auto", 0, 1)], q, k, v, end_of_sequence=["auto"])
        refused.attend(0, [BatchEntry("auto", 0, 1)], q, k, v, end_of_sequence=["auto"])
        assert offered.data_plane == "zmq:ipc"  # same host, the socket is there
        assert refused.data_plane == "grpc"
    with ChunkAttnClient(plane.target, data_plane="grpc") as grpc_only:
        assert grpc_only.data_plane == grpc_only.open_data_plane() == "grpc"


def test_the_environment_sets_the_default_and_a_bad_setting_is_refused(
    plane: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dataplane.ENV, "grpc")
    with ChunkAttnClient(plane.target) as client:
        assert client.open_data_plane() == "grpc"
    with ChunkAttnClient(plane.target, data_plane="auto") as client:  # the argument wins
        assert client.open_data_plane() == "zmq:ipc"
    with pytest.raises(ValueError, match="data_plane must be one of auto, grpc, zmq; got 'udp'"):
        ChunkAttnClient(plane.target, data_plane="udp")
    monkeypatch.setenv(dataplane.ENV, "ZMQ")
    with pytest.raises(ValueError, match=r"\$CHUNKATTN_DATA_PLANE must be one of auto, grpc, zmq; got 'ZMQ'"):
        ChunkAttnClient(plane.target)


def test_zmq_against_a_server_without_a_data_plane_is_a_clear_error(plain: ServerProcess) -> None:
    with ChunkAttnClient(plain.target, data_plane="zmq") as client:
        q, k, v = qkv(1, 0)
        with pytest.raises(ChunkAttnError) as err:
            client.attend(0, [BatchEntry("z", 0, 1)], q, k, v)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "data_plane='zmq', but the server offers no data plane" in err.value.message
        assert "--data-plane-tcp" in err.value.message  # the server's own words: which flags would offer one
        assert client.info().active_sequences == 0  # nothing was sent


def test_tcp_when_the_server_is_on_another_host(plane: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "host_id", lambda: "another host")
    with ChunkAttnClient(plane.target, data_plane="zmq") as far, ChunkAttnClient(plane.target, data_plane="grpc") as g:
        assert far.open_data_plane() == "zmq:tcp"
        assert far._plane.offer.address.startswith("tcp://127.0.0.1:")
        assert_same(run_sequence(far.attend, "far"), run_sequence(g.attend, "far-grpc"))


# -- the same answers -----------------------------------------------------------------------------------------


def assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert np.array_equal(a, b)


def test_sync_answers_are_grpcs_unary_stream_and_blocks(plane: ServerProcess) -> None:
    with ChunkAttnClient(plane.target, timeout_s=30) as z, ChunkAttnClient(plane.target, data_plane="grpc") as g:
        expected = run_sequence(g.attend, "sync-grpc")
        assert_same(run_sequence(z.attend, "sync-zmq"), expected)
        with z.stream() as zs, g.stream() as gs:
            assert z.data_plane == "zmq:ipc"
            assert_same(run_sequence(zs.attend, "sync-zmq-stream"), expected)
            assert_same(run_sequence(gs.attend, "sync-grpc-stream"), expected)
            blocks_z = [zs.attend_blocks(*c) for c in block_calls(z)]
            blocks_g = [gs.attend_blocks(*c) for c in block_calls(g)]
        assert_same(blocks_z, blocks_g)
        assert_same([z.attend_blocks(*c) for c in block_calls(z)], [g.attend_blocks(*c) for c in block_calls(g)])


def test_asyncio_answers_are_grpcs_and_calls_in_flight_share_the_socket(plane: ServerProcess) -> None:
    async def main() -> None:
        async with (
            AsyncChunkAttnClient(plane.target, timeout_s=30) as z,
            AsyncChunkAttnClient(plane.target, data_plane="grpc") as g,
        ):

            async def sequence(client: AsyncChunkAttnClient | Any, seq: str) -> list[np.ndarray]:
                out = []
                for layer, position, tokens, seed in STEPS:
                    out.append(
                        np.array(await client.attend(layer, [BatchEntry(seq, position, tokens)], *qkv(tokens, seed)))
                    )
                return out

            expected = await sequence(g, "aio-grpc")
            # Eight sequences at once on one socket: answers come in any order, each reaches its caller.
            many = await asyncio.gather(*(sequence(z, f"aio-zmq-{i}") for i in range(8)))
            assert z.data_plane == "zmq:ipc"
            for answers in many:
                assert_same(answers, expected)
            async with z.stream() as zs:
                assert_same(await sequence(zs, "aio-zmq-stream"), expected)
                space = await z.open_block_space(4)
                rows = BlockRows(space.space_id, list(range(5)), [0, 5], [5], [[0, 1]])
                got = np.array(await zs.attend_blocks(0, rows, *qkv(5, 7)))
            space = await g.open_block_space(4)
            rows = BlockRows(space.space_id, list(range(5)), [0, 5], [5], [[0, 1]])
            assert_same([got], [np.array(await g.attend_blocks(0, rows, *qkv(5, 7)))])

    asyncio.run(main())


def test_errors_keep_their_code_and_message_and_the_calls_go_on(plane: ServerProcess) -> None:
    with ChunkAttnClient(plane.target, data_plane="zmq") as z, ChunkAttnClient(plane.target, data_plane="grpc") as g:
        errors = []
        for client in (z, g):
            seq = f"err-{client.data_plane}"
            client.attend(0, [BatchEntry(seq, 0, 5)], *qkv(5, 0))
            with pytest.raises(ChunkAttnError) as err:
                client.attend(0, [BatchEntry(seq, 3, 1)], *qkv(1, 1))  # position 3: it has 5
            errors.append((err.value.code, err.value.message.replace(seq, "SEQ")))
            assert err.type is ChunkAttnError
            client.attend(0, [BatchEntry(seq, 5, 1)], *qkv(1, 1), end_of_sequence=[seq])  # it goes on
        assert errors[0] == errors[1]
        assert errors[0][0] == grpc.StatusCode.FAILED_PRECONDITION
        assert "next position is 5" in errors[0][1]
        with z.stream() as stream:  # a stream goes on after a call's error, as over gRPC
            with pytest.raises(ChunkAttnError, match="NOT_FOUND: sequence 'err-stream' does not exist"):
                stream.attend(0, [BatchEntry("err-stream", 4, 1)], *qkv(1, 1))
            stream.attend(0, [BatchEntry("err-stream", 0, 1)], *qkv(1, 1), end_of_sequence=["err-stream"])
        with pytest.raises(ValueError, match="end_of_sequence names sequences not in the batch"):
            z.attend(0, [BatchEntry("err-local", 0, 1)], *qkv(1, 1), end_of_sequence=["other"])


# -- sessions ---------------------------------------------------------------------------------------------------


def test_calls_go_on_across_session_expiry() -> None:
    with (
        ServerProcess(*SMALL, *FAST, *PLANE, "--data-plane-session-s", "2") as server,
        ChunkAttnClient(server.target, data_plane="zmq", timeout_s=30) as client,
    ):
        q, k, v = qkv(1, 0)
        position = 0

        def call() -> None:
            nonlocal position
            client.attend(0, [BatchEntry("long", position, 1)], q, k, v)
            position += 1

        call()
        first = client._plane.offer
        assert first.lifetime_s == pytest.approx(2.0, abs=0.1)
        time.sleep(1.9)  # within the last 10% of its life: the next call renews it first
        call()
        second = client._plane.offer
        assert second.key != first.key
        # A session that expires unnoticed (as on a client whose clock ran ahead of the server's renewal):
        # the server answers UNAUTHENTICATED before running the request; it is sent again on a new session.
        client._plane.offer = dataclasses.replace(second, lifetime_s=1e9)
        time.sleep(2.2)
        call()
        assert client._plane.offer.key not in (first.key, second.key)
        assert client.info().active_sequences == 1
        client.release(["long"])
    assert position == 3


# -- a server that freezes or dies ---------------------------------------------------------------------------


def _in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException], list[float]]:
    failures: list[BaseException] = []
    took: list[float] = []

    def run() -> None:
        t = time.monotonic()
        try:
            fn()
        except BaseException as e:
            failures.append(e)
        took.append(time.monotonic() - t)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failures, took


def test_a_frozen_server_times_out_and_a_killed_one_is_a_lost_connection() -> None:
    with (
        ServerProcess(*SMALL, *FAST, *PLANE) as server,
        ChunkAttnClient(server.target, data_plane="zmq", timeout_s=0.5) as quick,
        ChunkAttnClient(server.target, data_plane="zmq") as patient,
    ):
        q, k, v = qkv(1, 0)
        connected, frozen = threading.Event(), threading.Event()

        def patient_calls() -> None:  # in a thread of its own, which has its own socket
            patient.attend(0, [BatchEntry("patient", 0, 1)], q, k, v)
            connected.set()
            frozen.wait()
            patient.attend(0, [BatchEntry("patient", 1, 1)], q, k, v)

        thread, failures, _ = _in_thread(patient_calls)
        quick.attend(0, [BatchEntry("quick", 0, 1)], q, k, v)
        assert connected.wait(30)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ChunkAttnError) as err:
                quick.attend(0, [BatchEntry("quick", 1, 1)], q, k, v)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no answer on the data plane within 0.5 s" in err.value.message
            frozen.set()
            time.sleep(0.3)
            assert thread.is_alive()  # it waits: no deadline
        finally:
            server.proc.kill()
        thread.join(HEARTBEAT_TIMEOUT_MS / 1000)
        assert not thread.is_alive(), "the call still waits on a dead server"
        (failure,) = failures
        assert isinstance(failure, ChunkAttnError)
        assert failure.code == grpc.StatusCode.UNAVAILABLE
        assert f"the data-plane connection to {patient._plane.offer.address} was lost mid-call" in failure.message
        with pytest.raises(ChunkAttnError) as err:  # nobody there now: nothing can be sent
            quick.attend(0, [BatchEntry("quick", 2, 1)], q, k, v)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED  # its 0.5 s, before the 5 s to connect
        assert "no answer on the data plane within 0.5 s" in err.value.message


def test_a_silent_server_is_found_out_by_the_heartbeat_and_asyncio_loses_it_too() -> None:
    """SIGSTOP: the kernel keeps the connection, the server answers nothing (not even heartbeats): a call with no
    deadline fails with UNAVAILABLE once the heartbeat times out, not never."""
    with ServerProcess(*SMALL, *FAST, *PLANE) as server:

        async def main() -> ChunkAttnError:
            async with AsyncChunkAttnClient(server.target, data_plane="zmq") as client:
                q, k, v = qkv(1, 0)
                await client.attend(0, [BatchEntry("silent", 0, 1)], q, k, v)
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    with pytest.raises(ChunkAttnError) as err:
                        await asyncio.wait_for(
                            client.attend(0, [BatchEntry("silent", 1, 1)], q, k, v), 4 * HEARTBEAT_TIMEOUT_MS / 1000
                        )
                finally:
                    server.proc.kill()
                return err.value

        error = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "was lost mid-call" in error.message
    assert "heartbeat" in error.message


# -- chunkattn bench --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_bench_runs_over_the_data_plane_and_says_so(
    plane: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], transport: str
) -> None:
    out = tmp_path / "run.json"
    before = plane.metrics()
    rc = main([
        "bench", "--target", plane.target, "--progress", "none", "--json", str(out), "--data-plane", "zmq",
        "--transport", transport, "--sequences", "4", "--concurrency", "2", "--prompt-len", "10:30",
        "--output-len", "3:6", "--verify", "20",
    ])  # fmt: skip
    table = capsys.readouterr().out
    after = plane.metrics()
    s = json.loads(out.read_text())
    assert rc == 0
    assert (s["sequences"], s["sequences_failed"], s["errors"]) == (4, 0, {})
    assert s["params"]["data_plane"] == "zmq:ipc"
    assert "zmq:ipc" in table
    assert s["verify"]["checked"] == 20
    assert s["verify"]["mismatches"] == 0
    served = counter(after, "chunkattn_requests_total", rpc="Attend", code="OK", transport="zmq")
    served -= counter(before, "chunkattn_requests_total", rpc="Attend", code="OK", transport="zmq")
    assert served == s["calls"]  # every call went over the data plane
    with pytest.raises(SystemExit):
        main(["bench", "--target", plane.target, "--data-plane", "udp", "--sequences", "1"])
    assert "invalid choice: 'udp'" in capsys.readouterr().err


# -- thin -------------------------------------------------------------------------------------------------------


def test_the_client_loads_zmq_only_once_it_opens_the_data_plane() -> None:
    code = (
        "import sys, chunkattn_client\n"
        "from chunkattn_client import ChunkAttnClient, AsyncChunkAttnClient\n"
        "from chunkattn_client import dataplane\n"
        "c = ChunkAttnClient('127.0.0.1:1'); a = AsyncChunkAttnClient('127.0.0.1:1', data_plane='zmq')\n"
        "assert c.data_plane == 'auto' and a.data_plane == 'zmq'\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'zmq')\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the client pulled in {result.stdout.strip()}\n{result.stderr}"
