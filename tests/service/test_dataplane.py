"""The data plane (issue 37: Attend over ZeroMQ) against real servers, through a raw pyzmq DEALER
(tests/helpers/rawzmq.py) so that nothing here depends on the client library's data plane.

Covered: OpenDataPlane (endpoints, key, host id; FAILED_PRECONDITION without a data plane); parity with the
float64 reference for a sequence call (a prefill across a chunk boundary, then decodes) and a block call, over
tcp and ipc; answers byte-identical to gRPC Attend's; the hostile request matrices of test_hostile.py and
test_block_api_hostile.py (their case lists, imported) refused with the same statuses, leaving the pool and the
space as they were; tenant isolation; quotas (max_calls); drain (UNAVAILABLE, the call in flight answered);
sessions: none, a random key, expired, revoked by a SIGHUP reload, kept (and its quotas refreshed) by one that
keeps its tenant; TLS (a CURVE key, a CURVE DEALER served, a plain DEALER not; TLS without CURVE refused);
malformed frames and an oversized message (that peer dropped, the others served); a client that vanishes
mid-call (nothing half-written, counted); the ipc socket's mode; the transport label and the sessions gauge.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import zmq

from chunkattn_client import BatchEntry, BlockRows, ChunkAttnClient, ReferenceModel, codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.dataplane import KEY_BYTES, host_id
from chunkattn_client.reference import chunked_attention
from chunkattn_server.config import ServerConfig
from chunkattn_server.errors import ConfigError, Unauthenticated
from chunkattn_server.service import dataplane
from chunkattn_server.service.auth import Credential, Tenant, token_digest
from chunkattn_server.service.sessions import Sessions
from tests.helpers.blockapi import GLOBAL, POOL, TENANTS, TOKENS, Caller, batch, caller, client, close_enough, encode
from tests.helpers.certs import CA
from tests.helpers.rawrpc import Raw
from tests.helpers.rawzmq import RawZmq, code_of, open_session
from tests.helpers.server_process import SMALL, ServerProcess, counter
from tests.helpers.tensors import qkv
from tests.service.test_block_api_hostile import HOSTILE, Live, live  # noqa: F401 (live: the fixture)
from tests.service.test_hostile import MALFORMED, attend_bytes, refused

pytestmark = pytest.mark.server

H, HKV, D = 4, 2, 16
INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DOOMED = "doomed"  # a tenant the revocation test removes from the token file
TIGHT = "tight"  # may work on one call at a time (max_calls 1)
OPEN_TOKENS = {**TOKENS, DOOMED: "data-plane-token-of-doomed-0123456789", TIGHT: "data-plane-token-of-tight-0123456789"}


def write_tokens(path: Path, names: list[str]) -> None:
    spec: dict[str, dict[str, Any]] = {n: {"tokens_sha256": [token_digest(OPEN_TOKENS[n])]} for n in names}
    if TIGHT in spec:
        spec[TIGHT]["max_calls"] = 1
    path.write_text(json.dumps({"tenants": spec}))
    path.chmod(0o600)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    write_tokens(path, [*TENANTS, DOOMED, TIGHT])
    return path


@pytest.fixture(scope="module")
def server(tokens: Path) -> Iterator[ServerProcess]:
    """The module's server: tenants (tests/helpers/blockapi.py's, and DOOMED and TIGHT), a tcp and an ipc data
    plane (the block API's hostile fixture ``live`` runs on it too)."""
    flags = ["--num-blocks", str(POOL), "--idle-timeout-s", "0", "--auth-tokens", str(tokens)]
    with ServerProcess(*SMALL, *flags, "--data-plane-tcp", "127.0.0.1:0", "--data-plane-ipc", "auto") as s:
        yield s


def plane(server: ServerProcess, tenant: str = "a", transport: str = "tcp") -> RawZmq:
    """A DEALER on a fresh session of ``tenant``, whose info() is that tenant's gRPC Info."""
    info = Caller(server.target, tenant) if tenant in TOKENS else None
    return RawZmq.opened(server.target, OPEN_TOKENS[tenant], transport, info=info)


def request(
    seq: str, position: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, layer: int = 0, rid: int = 0
) -> bytes:
    entry = pb.SequenceEntry(seq_id=seq, position=position, num_tokens=len(q))
    return wire.encode_attend_request(layer, [entry], codec.to_raw(q), codec.to_raw(k), codec.to_raw(v), rid)


def output(response: pb.AttendResponse) -> np.ndarray:
    assert response.status.code == 0, response.status
    return np.frombuffer(response.output.data, np.float32).reshape(tuple(response.output.shape))


def pool(server: ServerProcess, tenant: str = "a") -> tuple[int, int]:
    with caller(server, tenant) as c:
        info = c.info()
    return info.free_blocks, info.active_sequences


# -- OpenDataPlane ----------------------------------------------------------------------------------------------


def test_open_data_plane_gives_a_session_key_the_endpoints_and_the_host(server: ServerProcess) -> None:
    session = open_session(server.target, TOKENS["a"])
    assert len(session.session_key) == KEY_BYTES
    assert [e.transport for e in session.endpoints] == ["tcp", "ipc"]
    assert session.endpoints[0].address.startswith("tcp://127.0.0.1:")
    assert not session.endpoints[0].address.endswith(":0")
    assert session.expires_in_s == 3600
    assert session.host_id == host_id()
    assert session.curve_server_key == ""
    assert open_session(server.target, TOKENS["a"]).session_key != session.session_key
    with pytest.raises(grpc.RpcError) as e:
        open_session(server.target, "not-a-token-of-anyone-0123456789")
    assert e.value.code() == UNAUTHENTICATED


def test_the_ipc_socket_is_the_servers_users_alone(server: ServerProcess) -> None:
    (address,) = [e.address for e in open_session(server.target, TOKENS["a"]).endpoints if e.transport == "ipc"]
    path = address.removeprefix("ipc://")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_a_server_without_a_data_plane_says_which_flags_turn_it_on() -> None:
    with ServerProcess(*SMALL) as s:
        with pytest.raises(grpc.RpcError) as e:
            open_session(s.target)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--data-plane-tcp" in (e.value.details() or "")
        with Raw(s.target) as raw:  # the rest of the service as ever
            assert raw.call("Attend", attend_bytes([("s", 0, 3)])).code == grpc.StatusCode.OK
        assert "data plane: off" in s.log()


# -- parity -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_prefill_across_a_chunk_boundary_then_decodes_match_the_reference(
    server: ServerProcess, transport: str
) -> None:
    rng = np.random.default_rng(37)
    seq = f"parity-{transport}"
    with plane(server, "a", transport) as z, client(server, "a") as c:
        ref = ReferenceModel.for_server(c.info())
        position = 0
        for n in (21, 1, 1, 1):  # C = 16: the prefill crosses it; the decodes go on in the second chunk
            for layer in (0, GLOBAL):
                q, k, v = qkv(rng, n)
                out = output(z.request(request(seq, position, q, k, v, layer, rid=position + 1)))
                close_enough(out, ref.attend(layer, [BatchEntry(seq, position, n)], q, k, v))
            position += n
        c.release([seq])


def test_a_block_call_matches_the_reference(server: ServerProcess) -> None:
    rng = np.random.default_rng(38)
    with plane(server, "a") as z, client(server, "a") as c:
        space = c.open_block_space(4)
        try:
            q, k, v = qkv(rng, 6)  # a row of 6 keys written to slots 0..5, then a decode row reading them
            prefill = BlockRows(space.space_id, np.arange(6), [0, 6], [6], [[0, 1]])
            out = output(z.request(encode(GLOBAL, batch(prefill), q, k, v, request_id=1)))
            close_enough(out, chunked_attention(q, k, v, np.arange(6), chunk_size=0, scale=0.25))
            qd, kd, vd = qkv(rng, 1)
            decode = BlockRows(space.space_id, [6], [0, 1], [7], [[0, 1]])
            out = output(z.request(encode(GLOBAL, batch(decode), qd, kd, vd, request_id=2)))
            keys, values = np.concatenate([k, kd]), np.concatenate([v, vd])
            close_enough(out, chunked_attention(qd, keys, values, [6], chunk_size=0, scale=0.25))
        finally:
            c.close_block_space(space.space_id)


def test_answers_are_byte_for_byte_those_of_grpc_attend(server: ServerProcess) -> None:
    rng = np.random.default_rng(39)
    steps = [(0, qkv(rng, 20)), (20, qkv(rng, 1)), (21, qkv(rng, 1))]
    with plane(server, "a") as z, caller(server, "a") as g:
        for position, (q, k, v) in steps:
            z.send(z.key, request("same-z", position, q, k, v, rid=position + 5))
            over_zmq = z.receive_bytes()
            over_grpc = g.call("Attend", request("same-g", position, q, k, v, rid=position + 5))
            assert over_grpc.code == grpc.StatusCode.OK, over_grpc
            assert over_zmq == over_grpc.data
        g.call("Release", pb.ReleaseRequest(seq_ids=["same-z", "same-g"]).SerializeToString())


# -- the hostile matrices of the gRPC tests, over the data plane --------------------------------------------------


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_attend_requests_are_refused_as_over_grpc(server: ServerProcess, case: str) -> None:
    data, words = MALFORMED[case]
    before = pool(server)
    with plane(server) as z, caller(server, "a") as g:
        over_zmq, over_grpc = z.call("Attend", data), g.call("Attend", data)
        refused(over_zmq, INVALID, "not a valid chunkattn.v1.AttendRequest", words)
        assert (over_zmq.code, over_zmq.details) == (over_grpc.code, over_grpc.details)
    assert pool(server) == before


def test_the_grpc_hostile_cases_are_refused_over_the_data_plane_and_change_nothing(server: ServerProcess) -> None:
    before = pool(server)
    with plane(server) as z:
        for entries, tokens, words in (
            ([("x" * 16384, 0, 1)], None, "too long: at most 256 bytes of UTF-8, got 16384"),
            ([("far", 0, 2**62)], 1, "past the longest sequence served, 2147483647 tokens"),
            ([("far", 2**31 - 1, 1)], 1, "past the longest sequence served"),
            ([("short", 0, 3)], 2, "q"),
        ):
            refused(z.call("Attend", attend_bytes(entries, tokens=tokens)), INVALID, words)
        entry = pb.AttendRequest(entries=[pb.SequenceEntry(seq_id="e", num_tokens=1)]).SerializeToString()
        refused(z.call("Attend", entry * 9000), INVALID, "at most 8192")
    assert pool(server) == before


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_block_api_hostile_cases_are_refused_over_the_data_plane_and_change_nothing(
    live: Live,  # noqa: F811
    case: str,
) -> None:
    mutate, code, words = HOSTILE[case]
    blocks, q, k, v = live.base()
    request = pb.AttendRequest.FromString(encode(GLOBAL, blocks, q, k, v))
    mutate(request, live)
    free = live.raw.info().free_blocks
    with plane(live.server, "a") as z:
        refused(z.call("Attend", request.SerializeToString()), code, *words)
    live.unchanged(free)


# -- tenants and quotas -------------------------------------------------------------------------------------------


def test_another_tenants_space_and_sequence_are_not_found(server: ServerProcess) -> None:
    rng = np.random.default_rng(40)
    with client(server, "a") as a, plane(server, "b") as zb:
        space = a.open_block_space(2)
        q, k, v = qkv(rng, 4)
        a.attend(0, [BatchEntry("mine", 0, 4)], q, k, v)
        before = pool(server)
        rows = BlockRows(space.space_id, np.arange(4), [0, 4], [4], [[0]])
        answer = zb.call("Attend", encode(GLOBAL, batch(rows), q, k, v))
        refused(answer, grpc.StatusCode.NOT_FOUND, "block space", "does not exist")
        qd, kd, vd = qkv(rng, 1)
        refused(zb.call("Attend", request("mine", 4, qd, kd, vd)), grpc.StatusCode.NOT_FOUND, "mine")
        assert pool(server) == before
        a.close_block_space(space.space_id)
        a.release(["mine"])


def test_a_tenants_max_calls_holds_over_the_data_plane(server: ServerProcess) -> None:
    """TIGHT may work on one call at a time: a long prefill, and decodes sent behind it at once, get
    RESOURCE_EXHAUSTED naming the quota while it runs; every answer comes, the refused ones write nothing."""
    rng = np.random.default_rng(41)
    with plane(server, TIGHT) as z:
        slow = request("slow", 0, *qkv(rng, 3000), rid=1)  # 1.5 MB: parsed in a thread, then 188 pieces
        decodes = [request(f"d{i}", 0, *qkv(rng, 1), rid=2 + i) for i in range(8)]
        answers = {a.request_id: a for a in z.many([slow, *decodes])}
    assert answers[1].status.code == 0, answers[1].status
    refusals = [a for a in answers.values() if a.status.code]
    assert refusals, "no decode was refused while the prefill held TIGHT's one call"
    for a in refusals:
        assert code_of(a) == grpc.StatusCode.RESOURCE_EXHAUSTED, a.status
        assert "max_calls 1" in a.status.message
    served = ["slow", *(f"d{rid - 2}" for rid, a in answers.items() if rid > 1 and not a.status.code)]
    with ChunkAttnClient(server.target, token=OPEN_TOKENS[TIGHT], timeout_s=30) as c:
        assert c.info().active_sequences == len(served)  # the refused decodes hold nothing
        c.release(served)


# -- sessions ----------------------------------------------------------------------------------------------------


def test_no_session_or_a_random_key_is_unauthenticated_and_runs_nothing(server: ServerProcess) -> None:
    rng = np.random.default_rng(42)
    before = pool(server)
    with plane(server) as z:
        for key in (os.urandom(KEY_BYTES), bytes(KEY_BYTES)):
            answer = z.request(request("nobody", 0, *qkv(rng, 2), rid=77), key=key)
            assert code_of(answer) == UNAUTHENTICATED
            assert answer.request_id == 77  # the client knows which request to send again
            assert "no live data-plane session for this key" in answer.status.message
            assert "OpenDataPlane" in answer.status.message
    assert pool(server) == before


def test_a_reload_that_drops_the_tenant_revokes_its_sessions_and_one_that_keeps_it_does_not(
    server: ServerProcess, tokens: Path
) -> None:
    rng = np.random.default_rng(43)
    with plane(server, DOOMED) as doomed, plane(server, "b") as kept:
        assert doomed.request(request("r", 0, *qkv(rng, 1))).status.code == 0
        write_tokens(tokens, [*TENANTS, TIGHT])
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while (answer := doomed.request(request("r", 1, *qkv(rng, 1)))).status.code == 0:
            assert time.monotonic() < deadline, "the session was not revoked"
            time.sleep(0.05)
        assert code_of(answer) == UNAUTHENTICATED
        assert "revoked" in answer.status.message
        assert kept.request(request("k", 0, *qkv(rng, 1))).status.code == 0
    write_tokens(tokens, [*TENANTS, DOOMED, TIGHT])
    server.proc.send_signal(signal.SIGHUP)


# -- frames -------------------------------------------------------------------------------------------------------


def test_malformed_frames_are_invalid_argument_with_request_id_0(server: ServerProcess) -> None:
    rng = np.random.default_rng(44)
    data = request("frames", 0, *qkv(rng, 1), rid=9)
    before = pool(server)
    with plane(server) as z:
        for frames, words in (
            ((data,), "2 frames"),
            ((z.key, data, b"more"), "2 frames"),
            ((z.key[:31], data), "32 bytes"),
            ((z.key + b"!", data), "32 bytes"),
        ):
            z.send(*frames)
            answer = z.receive()
            assert answer is not None, frames
            assert (code_of(answer), answer.request_id) == (INVALID, 0), answer
            assert words in answer.status.message
        garbage = z.request(b"\xff\xfe garbage")
        assert code_of(garbage) == INVALID
        assert "not a valid chunkattn.v1.AttendRequest" in garbage.status.message
    assert pool(server) == before


def test_a_message_over_the_limit_drops_its_peer_and_nobody_else(server: ServerProcess) -> None:
    rng = np.random.default_rng(45)
    with plane(server) as big, plane(server) as other:
        big.send(big.key, b"\0" * (17 << 20))  # past the server's 16 MiB
        assert big.receive(timeout_s=2) is None
        answer = other.request(request("bystander", 0, *qkv(rng, 1)))
        assert answer.status.code == 0
    with caller(server, "a") as g:
        g.call("Release", pb.ReleaseRequest(seq_ids=["bystander"]).SerializeToString())


def test_a_client_that_vanishes_mid_call_leaves_a_whole_call_or_nothing(server: ServerProcess) -> None:
    rng = np.random.default_rng(46)
    tokens = 1000
    served_before = counter(server.metrics(), "chunkattn_requests_total", rpc="Attend", transport="zmq")
    free, active = pool(server)
    z = plane(server)
    z.send(z.key, request("vanished", 0, *qkv(rng, tokens), layer=GLOBAL))
    z.socket.close(linger=5000)  # the message leaves, then the socket is gone
    z.context.term()
    deadline = time.monotonic() + 30
    while counter(server.metrics(), "chunkattn_requests_total", rpc="Attend", transport="zmq") <= served_before:
        assert time.monotonic() < deadline, "the vanished client's call was never counted"
        time.sleep(0.05)
    assert "Traceback" not in server.log()
    after = pool(server)
    whole = (free - tokens // 4, active + 1)  # a finished call of the global layer holds all its blocks
    assert after in (whole, (free, active)), (after, whole)
    with caller(server, "a") as g:
        g.call("Release", pb.ReleaseRequest(seq_ids=["vanished"], missing_ok=True).SerializeToString())
        assert g.info().free_blocks == free  # the server serves on
    assert counter(server.metrics(), "chunkattn_data_plane_sessions") >= 1


def test_the_transport_label_separates_the_data_plane_from_grpc(server: ServerProcess) -> None:
    samples = server.metrics()
    assert counter(samples, "chunkattn_requests_total", rpc="Attend", transport="zmq", code="OK") > 0
    assert counter(samples, "chunkattn_requests_total", rpc="Attend", transport="grpc", code="OK") > 0
    assert counter(samples, "chunkattn_requests_total", rpc="OpenDataPlane", transport="grpc", code="OK") > 0
    assert counter(samples, "chunkattn_rpc_duration_seconds_count", rpc="Attend", transport="zmq") > 0


# -- a short-lived session, then the drain ------------------------------------------------------------------------


def test_an_expired_session_is_told_so_and_the_drain_answers_unavailable() -> None:
    rng = np.random.default_rng(47)
    flags = ["--data-plane-tcp", "127.0.0.1:0", "--data-plane-ipc", "auto", "--data-plane-session-s", "1"]
    with ServerProcess(*SMALL, *flags, "--drain-delay-s", "1", "--idle-timeout-s", "0") as s:
        session = open_session(s.target)
        assert session.expires_in_s == 1
        ipc = next(e.address for e in session.endpoints if e.transport == "ipc").removeprefix("ipc://")
        with RawZmq(session.endpoints[0].address, session.session_key) as z:
            assert z.request(request("e", 0, *qkv(rng, 1))).status.code == 0
            time.sleep(1.1)
            answer = z.request(request("e", 1, *qkv(rng, 1)))
            assert code_of(answer) == UNAUTHENTICATED
            assert "expired" in answer.status.message
        with RawZmq.opened(s.target) as z:
            z.send(z.key, request("inflight", 0, *qkv(rng, 2500), layer=GLOBAL, rid=1))
            time.sleep(0.05)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            z.send(z.key, request("late", 0, *qkv(rng, 1), rid=2))
            answers = {a.request_id: a for a in (z.receive(), z.receive()) if a is not None}
        assert answers[1].status.code == 0, answers[1].status  # in flight at SIGTERM: finished and answered
        assert code_of(answers[2]) == grpc.StatusCode.UNAVAILABLE
        assert "draining" in answers[2].status.message
        assert s.proc.wait(30) == 0
    assert not os.path.exists(ipc)
    assert not os.path.exists(os.path.dirname(ipc))


# -- TLS -------------------------------------------------------------------------------------------------------


def test_a_tls_server_encrypts_the_data_plane_with_curve(tmp_path: Path) -> None:
    ca = CA(tmp_path)
    pair = ca.server()
    flags = ["--tls-cert", str(pair.cert_path), "--tls-key", str(pair.key_path), "--data-plane-tcp", "127.0.0.1:0"]
    rng = np.random.default_rng(48)
    with ServerProcess(*SMALL, *flags) as s:
        session = open_session(s.target, credentials=grpc.ssl_channel_credentials(ca.pem))
        assert len(session.curve_server_key) == 40
        address = session.endpoints[0].address
        with RawZmq(address, session.session_key, session.curve_server_key) as z:
            assert z.request(request("c", 0, *qkv(rng, 2))).status.code == 0
        with RawZmq(address, session.session_key) as plain:
            plain.send(plain.key, request("p", 0, *qkv(rng, 2)))
            assert plain.receive(timeout_s=1.5) is None
        assert "(CURVE;" in s.log()


def test_tls_without_curve_refuses_a_data_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    tls = ServerConfig(tls_cert="cert.pem", tls_key="key.pem", data_plane_tcp="127.0.0.1:0")
    dataplane.check(tls)  # (this libzmq has CURVE)
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(ConfigError, match="CURVE"):
        dataplane.check(tls)
    dataplane.check(ServerConfig(data_plane_tcp="127.0.0.1:0"))  # no TLS: plaintext, as gRPC
    dataplane.check(ServerConfig(tls_cert="cert.pem", tls_key="key.pem"))  # no data plane: nothing to refuse


# -- flags ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"data_plane_tcp": "127.0.0.1"}, "HOST:PORT"),
        ({"data_plane_tcp": "127.0.0.1:70000"}, "HOST:PORT"),
        ({"data_plane_tcp": "::1:5000"}, "[IPv6]:PORT"),
        ({"data_plane_ipc": ""}, "socket path"),
        ({"data_plane_advertise": "h"}, "give --data-plane-tcp"),
        ({"data_plane_tcp": "0.0.0.0:0", "data_plane_advertise": "tcp://h"}, "host name"),
        ({"data_plane_tcp": "0.0.0.0:0", "data_plane_session_s": 0.0}, "--data-plane-session-s"),
        ({"data_plane_tcp": "0.0.0.0:0", "data_plane_session_s": float("nan")}, "--data-plane-session-s"),
    ],
)
def test_bad_data_plane_flags_are_refused_naming_the_flag(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ServerConfig(**fields)


def test_an_ipc_socket_in_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="writable by other users"):
        dataplane.check(ServerConfig(data_plane_ipc="/tmp/chunkattn-data.sock"))  # /tmp: 1777
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    dataplane.check(ServerConfig(data_plane_ipc=str(private / "data.sock")))
    with pytest.raises(ConfigError, match="at most 107 bytes"):
        dataplane.check(ServerConfig(data_plane_ipc=str(private / ("x" * 120))))


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root (chown)")
def test_an_ipc_socket_in_another_users_folder_is_refused(tmp_path: Path) -> None:
    """A folder others cannot write but another user owns: its owner could replace the socket with theirs."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to another user"):
        dataplane.check(ServerConfig(data_plane_ipc=str(theirs / "data.sock")))


def test_an_ipc_path_another_process_listens_on_is_refused(tmp_path: Path) -> None:
    """Binding would take a live socket over (libzmq unlinks what is there); a stale one is reused."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    path = str(private / "data.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        with pytest.raises(ConfigError, match="another process is listening there"):
            dataplane.check(ServerConfig(data_plane_ipc=path))
    finally:
        listener.close()
    dataplane.check(ServerConfig(data_plane_ipc=path))  # the file is left, but nobody listens: stale


def test_many_messages_in_flight_at_once_are_each_answered(server: ServerProcess) -> None:
    """32 decodes of 32 sequences sent at once on one socket and 8 gRPC calls beside them: every answer, matched
    by request_id, is the reference's."""
    rng = np.random.default_rng(49)
    with plane(server, "e2e") as z, client(server, "e2e") as c:
        ref = ReferenceModel.for_server(c.info())
        sent = {i: qkv(rng, 1) for i in range(32)}
        with concurrent.futures.ThreadPoolExecutor(2) as pool_:
            beside = [pool_.submit(c.attend, 0, [BatchEntry(f"g{i}", 0, 1)], *qkv(rng, 1)) for i in range(8)]
            answers = z.many([request(f"m{i}", 0, *t, rid=i + 1) for i, t in sent.items()])
            assert all(np.isfinite(np.asarray(f.result())).all() for f in beside)
        assert sorted(a.request_id for a in answers) == list(range(1, 33))
        for a in answers:
            q, k, v = sent[a.request_id - 1]
            close_enough(output(a), ref.attend(0, [BatchEntry(f"m{a.request_id - 1}", 0, 1)], q, k, v))
        c.release([f"m{i}" for i in range(32)] + [f"g{i}" for i in range(8)])


# -- the session table on its own (service/sessions.py) --------------------------------------------------------------


def test_the_session_table_bounds_each_tenant_tells_why_a_key_fails_and_rechecks_on_reload() -> None:
    now = [100.0]
    table = Sessions(10.0, max_per_tenant=2, clock=lambda: now[0])
    a, b = Tenant("a"), Tenant("b", max_calls=1)
    alice, bob = Credential(token_sha256=b"A" * 32), Credential(subject="bob")
    first, second = table.open(a, alice), table.open(a, alice)
    other = table.open(b, bob)
    assert table.lookup(first.key) is a
    table.open(a, alice)  # a third of a's: its oldest ends, b's stays
    with pytest.raises(Unauthenticated, match="no live data-plane session"):
        table.lookup(first.key)
    assert table.lookup(second.key) is a
    assert table.lookup(other.key) is b
    assert (len(table), table.live()) == (3, 3)
    # a reload that keeps a's token (with new quotas) and drops b's subject
    a2 = Tenant("a", max_calls=5)
    assert table.recheck(lambda c: a2 if c == alice else Tenant("someone-else")) == 1
    assert table.lookup(second.key) is a2
    with pytest.raises(Unauthenticated, match="revoked"):
        table.lookup(other.key)
    now[0] += 10.0
    with pytest.raises(Unauthenticated, match=r"expired \(sessions live 10 s\)"):
        table.lookup(second.key)
    assert table.live() == 0
    now[0] += 600.0
    table.sweep()  # ended more than KEPT_S ago: forgotten
    assert len(table) == 0
    with pytest.raises(Unauthenticated, match="no live data-plane session"):
        table.lookup(second.key)
