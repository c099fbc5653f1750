"""TLS, mutual TLS, tokens, tenants and quotas, through real servers, with certificates made by the tests.

One TLS server with a token file serves most tests; a mutual-TLS one the certificate tests; the reload and
transfer tests start their own. Tenants: a1/b1 and a2/b2 play the isolation matrix twice (with and without
b's attempts on a's ids), "small" has quotas, "importer" is TransferKV's tenant on the target.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from chunkattn_client import BatchEntry, ChunkAttnClient, ChunkAttnError, ReferenceModel
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.cli import main
from chunkattn_client.reference import within_tolerance
from chunkattn_server.service.auth import token_digest
from tests.helpers.certs import CA
from tests.helpers.server_process import SMALL, ServerProcess
from tests.helpers.tensors import qkv

pytestmark = pytest.mark.server

TOKENS = {
    name: f"token-of-{name}-0123456789" for name in ("a1", "b1", "a2", "b2", "small", "streams", "importer", "other")
}
QUOTA = {"max_kv_blocks": 24, "max_sequences": 2, "max_calls": 1}
FLAGS = [*SMALL, "--num-blocks", "4096", "--idle-timeout-s", "0"]
ROOT = Path(__file__).resolve().parents[2]
GLOBAL = 3  # SMALL's layers: 3 chunked (C = 16), then a global one, which keeps every block


def token_file(path: Path, tenants: dict[str, dict[str, Any]]) -> Path:
    """Write a token file: each tenant's "token" or "tokens" (plain, as a test knows them) become SHA-256s."""
    spec = {}
    for name, fields in tenants.items():
        fields = dict(fields)
        tokens = [fields.pop("token")] if "token" in fields else fields.pop("tokens", [])
        spec[name] = {**({"tokens_sha256": [token_digest(t) for t in tokens]} if tokens else {}), **fields}
    path.write_text(json.dumps({"tenants": spec}))
    path.chmod(0o600)
    return path


class PKI:
    def __init__(self, directory: Path) -> None:
        self.ca = CA(directory, "ca")
        self.other = CA(directory, "other")  # trusted by nobody
        self.server = self.ca.server()
        self.runner_a = self.ca.client("runner-a")  # its CN names tenant a1
        self.stranger = self.ca.client("stranger")  # a valid certificate that names no tenant
        self.forged = self.other.client("runner-a")  # the right name from the wrong CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tokens(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tenants: dict[str, dict[str, Any]] = {name: {"token": TOKENS[name]} for name in ("a1", "b1", "a2", "b2", "other")}
    tenants["a1"]["subjects"] = ["runner-a"]
    tenants["small"] = {"token": TOKENS["small"], **QUOTA}
    tenants["streams"] = {"token": TOKENS["streams"], "max_open_calls": 2}
    return token_file(tmp_path_factory.mktemp("auth") / "tokens.json", tenants)


def tls_flags(pki: PKI) -> list[str]:
    return ["--tls-cert", str(pki.server.cert_path), "--tls-key", str(pki.server.key_path)]


@pytest.fixture(scope="module")
def server(pki: PKI, tokens: Path) -> Iterator[ServerProcess]:
    """TLS and tokens; TransferKV reaches its targets over TLS trusting the test CA."""
    with ServerProcess(
        *FLAGS, *tls_flags(pki), "--auth-tokens", str(tokens), "--transfer-tls-ca", str(pki.ca.path)
    ) as s:
        yield s


@pytest.fixture(scope="module")
def mtls(pki: PKI, tokens: Path) -> Iterator[ServerProcess]:
    with ServerProcess(*FLAGS, *tls_flags(pki), "--tls-client-ca", str(pki.ca.path), "--auth-tokens", str(tokens)) as s:
        yield s


def connect(server: ServerProcess, pki: PKI, tenant: str | None, **kw: Any) -> ChunkAttnClient:
    """A client of ``tenant`` (None: no token) that trusts the test CA."""
    root = kw.pop("root_certificates", pki.ca.pem)
    token = None if tenant is None else TOKENS.get(tenant, tenant)
    kw.setdefault("timeout_s", 20)
    return ChunkAttnClient(server.target, root_certificates=root, token=token, **kw)


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(ChunkAttnError) as e:
        call()
    return e.value.code


# -- TLS --------------------------------------------------------------------------------------------------


def test_tls_refuses_plaintext_and_a_client_that_trusts_another_ca(server: ServerProcess, pki: PKI) -> None:
    with ChunkAttnClient(server.target, token=TOKENS["a1"], timeout_s=10) as plain:
        assert code_of(plain.info) == grpc.StatusCode.UNAVAILABLE
    with connect(server, pki, "a1", root_certificates=pki.other.pem) as wrong:
        assert code_of(wrong.info) == grpc.StatusCode.UNAVAILABLE
    with connect(server, pki, "a1") as right:
        assert right.info().num_heads == 4
        assert right.health() == "SERVING"


def test_mutual_tls_wants_a_certificate_of_its_ca_and_its_subject_can_name_the_tenant(
    mtls: ServerProcess, pki: PKI
) -> None:
    with connect(mtls, pki, "a1") as no_certificate:  # a valid token is not enough: the handshake fails first
        assert code_of(no_certificate.info) == grpc.StatusCode.UNAVAILABLE
    with connect(mtls, pki, None, certificate_chain=pki.forged.cert, private_key=pki.forged.key) as forged:
        assert code_of(forged.info) == grpc.StatusCode.UNAVAILABLE
    with connect(mtls, pki, None, certificate_chain=pki.stranger.cert, private_key=pki.stranger.key) as stranger:
        with pytest.raises(ChunkAttnError) as e:
            stranger.info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "CN 'stranger'" in e.value.message
    q, k, v = qkv(np.random.default_rng(0), 3)
    runner = {"certificate_chain": pki.runner_a.cert, "private_key": pki.runner_a.key}
    with connect(mtls, pki, None, **runner) as by_subject:
        by_subject.attend(0, [BatchEntry("via-cert", 0, 3)], q, k, v)
    with connect(mtls, pki, "a1", **runner) as by_token:  # the same tenant: it sees the sequence
        assert by_token.info().active_sequences == 1
        by_token.release(["via-cert"])
    with connect(mtls, pki, "b1", **runner) as token_decides:  # a token, when sent, names the tenant
        assert token_decides.info().active_sequences == 0
    with connect(mtls, pki, "a wrong token", **runner) as wrong:  # and a wrong one is refused outright
        assert code_of(wrong.info) == grpc.StatusCode.UNAUTHENTICATED


# -- tokens -----------------------------------------------------------------------------------------------


def every_rpc(c: ChunkAttnClient, target: str) -> dict[str, Callable[[], Any]]:
    q, k, v = qkv(np.random.default_rng(1), 1)
    header = pb.KVChunk(header=pb.KVHeader(seq_id="x"))

    def stream() -> Any:
        with c.stream() as s:
            return s.attend(0, [BatchEntry("x", 0, 1)], q, k, v)

    return {
        "Info": c.info,
        "Attend": lambda: c.attend(0, [BatchEntry("x", 0, 1)], q, k, v),
        "AttendStream": stream,
        "Release": lambda: c.release(["x"], missing_ok=True),
        "Fork": lambda: c.fork("x", "y"),
        "Truncate": lambda: c.truncate("x", 0),
        "ExportKV": lambda: list(c.export_kv("x")),
        "ImportKV": lambda: c.import_kv(iter([header])),
        "TransferKV": lambda: c.transfer_kv("x", target),
    }


@pytest.mark.parametrize("token", [None, "not-a-token", TOKENS["a1"] + "x", " " + TOKENS["a1"][1:]])
def test_every_rpc_without_a_valid_token_is_unauthenticated(server: ServerProcess, pki: PKI, token: str | None) -> None:
    if token is not None and token != token.strip():
        with pytest.raises(ValueError, match="printable ASCII without surrounding spaces"):
            connect(server, pki, token)  # the client refuses to send it
        return
    with connect(server, pki, token) as c:
        for rpc, call in every_rpc(c, server.target).items():
            with pytest.raises(ChunkAttnError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, rpc
            assert token is None or token not in e.value.message
        assert c.health() == "SERVING"  # health stays open
    assert token is None or token not in server.log()


def test_an_authorization_that_is_not_a_bearer_token_is_unauthenticated(server: ServerProcess, pki: PKI) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.pem)
    with grpc.secure_channel(server.target, creds) as channel:
        info = channel.unary_unary(
            "/chunkattn.v1.ChunkAttn/Info",
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.InfoResponse.FromString,
        )
        for value in (f"Basic {TOKENS['a1']}", "Bearer", "Bearer   "):
            with pytest.raises(grpc.RpcError) as e:
                info(pb.InfoRequest(), metadata=(("authorization", value),), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "must be 'Bearer <token>'" in (e.value.details() or "")
        bearer = (("authorization", f"bearer {TOKENS['a1']}"),)  # the scheme's case does not matter
        assert info(pb.InfoRequest(), metadata=bearer, timeout=10).num_heads == 4


# -- tenants ----------------------------------------------------------------------------------------------


def isolation_run(server: ServerProcess, pki: PKI, a: str, b: str, attempts: bool) -> tuple[list[bytes], list[Any]]:
    """Tenant ``a`` prefills and decodes two sequences; ``b`` makes its own "s1" (allowed: ids are per tenant)
    and, with ``attempts``, names a's ids in every RPC. Returns a's outputs and the refusals' codes."""
    rng = np.random.default_rng(7)
    outputs: list[bytes] = []
    codes: list[Any] = []
    with connect(server, pki, a) as ca, connect(server, pki, b) as cb:

        def a_step(entries: list[BatchEntry]) -> None:
            for layer in range(4):
                q, k, v = qkv(rng, sum(e.num_tokens for e in entries))
                outputs.append(ca.attend(layer, entries, q, k, v).tobytes())

        def b_tries(call: Callable[[], Any]) -> None:
            if attempts:
                with pytest.raises(ChunkAttnError) as e:
                    call()
                codes.append((e.value.code, e.value.message))

        a_step([BatchEntry("s1", 0, 20), BatchEntry("s2", 0, 5)])  # s1 crosses a chunk boundary
        qb, kb, vb = qkv(np.random.default_rng(8), 3)
        for layer in range(4):
            cb.attend(layer, [BatchEntry("s1", 0, 3)], qb, kb, vb)  # b's own s1
        q1, k1, v1 = qkv(np.random.default_rng(9), 1)
        b_tries(lambda: cb.attend(0, [BatchEntry("s2", 5, 1)], q1, k1, v1))  # a's s2, continued
        b_tries(lambda: cb.attend(0, [BatchEntry("s1", 20, 1)], q1, k1, v1))  # "s1" is b's own: 3 tokens
        with cb.stream() as stream:
            b_tries(lambda: stream.attend(0, [BatchEntry("s2", 5, 1)], q1, k1, v1))
        b_tries(lambda: cb.release(["s2"]))
        b_tries(lambda: cb.fork("s2", "mine"))
        b_tries(lambda: cb.truncate("s2", 4))
        b_tries(lambda: list(cb.export_kv("s2")))
        b_tries(lambda: cb.transfer_kv("s2", server.target, new_seq_id="stolen", target_token=TOKENS[b]))
        if attempts:
            assert cb.release(["s2"], missing_ok=True) == 0
            exported = list(ca.export_kv("s2"))  # b imports a copy of a's export under a's id: its own s2
            assert cb.import_kv(iter(exported)).seq_id == "s2"
            cb.release(["s2"])
            assert cb.info().active_sequences == 1  # its own s1 alone
        a_step([BatchEntry("s1", 20, 1), BatchEntry("s2", 5, 1)])
        a_step([BatchEntry("s1", 21, 1)])
        assert ca.info().active_sequences == 2
        assert ca.release(["s1", "s2"]) == 2
        assert cb.release(["s1"]) == 1
    return outputs, codes


def test_a_tenant_cannot_name_another_tenants_sequences_in_any_rpc(server: ServerProcess, pki: PKI) -> None:
    clean, _ = isolation_run(server, pki, "a2", "b2", attempts=False)
    attacked, codes = isolation_run(server, pki, "a1", "b1", attempts=True)
    assert [code for code, _ in codes] == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION] + [
        grpc.StatusCode.NOT_FOUND
    ] * 6
    assert "has 3 tokens in layer 0" in codes[1][1]  # b's own s1, nothing of a's
    assert attacked == clean  # a's outputs bit for bit as without b's attempts


def test_info_and_metrics_speak_of_the_callers_own_sequences(server: ServerProcess, pki: PKI) -> None:
    q, k, v = qkv(np.random.default_rng(2), 2)
    with connect(server, pki, "a1") as a, connect(server, pki, "b1") as b:
        total = a.info().num_blocks
        a.attend(
            GLOBAL,
            [BatchEntry("p", 0, 2), BatchEntry("r", 0, 2)],
            np.concatenate([q, q]),
            *(np.concatenate([t, t]) for t in (k, v)),
        )
        assert (a.info().active_sequences, b.info().active_sequences) == (2, 0)
        assert b.info().free_blocks == total - 2  # the pool's totals are everyone's
        m = server.metrics()
        assert m[("chunkattn_tenant_sequences", (("tenant", "a1"),))] == 2
        assert m[("chunkattn_tenant_kv_blocks", (("tenant", "a1"),))] == 2
        assert m[("chunkattn_tenant_sequences", (("tenant", "b1"),))] == 0
        assert {dict(labels)["tenant"] for (name, labels) in m if name == "chunkattn_tenant_sequences"} <= set(TOKENS)
        a.release(["p", "r"])


# -- quotas -----------------------------------------------------------------------------------------------


def test_a_tenant_at_its_quota_is_refused_while_others_go_on(server: ServerProcess, pki: PKI) -> None:
    rng = np.random.default_rng(3)
    with connect(server, pki, "small") as s, connect(server, pki, "b1") as b:
        q, k, v = qkv(rng, 2)
        for seq in ("q1", "q2"):
            s.attend(GLOBAL, [BatchEntry(seq, 0, 2)], q, k, v)  # 2 sequences, 1 block each (the global layer)
        with pytest.raises(ChunkAttnError) as e:
            s.attend(GLOBAL, [BatchEntry("q3", 0, 2)], q, k, v)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sequences" in e.value.message
        assert code_of(lambda: s.fork("q1", "q4")) == grpc.StatusCode.RESOURCE_EXHAUSTED
        exported = list(s.export_kv("q1"))
        with pytest.raises(ChunkAttnError) as e:
            s.import_kv(iter(exported), seq_id="q5")
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sequences" in e.value.message
        for seq in ("q3", "q4", "q5"):  # another tenant is not held back
            b.attend(GLOBAL, [BatchEntry(seq, 0, 2)], q, k, v)
        # 24 blocks of 4 tokens: a global layer holds 96 tokens, so a long prefill is refused, changing nothing
        qq, kk, vv = qkv(rng, 100)
        free = s.info().free_blocks
        with pytest.raises(ChunkAttnError) as e:
            s.attend(GLOBAL, [BatchEntry("q1", 2, 100)], qq, kk, vv)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_kv_blocks" in e.value.message
        assert s.info().free_blocks == free
        s.attend(GLOBAL, [BatchEntry("q1", 2, 80)], qq[:80], kk[:80], vv[:80])  # within the quota
        assert s.release(["q2"]) == 1
        s.attend(GLOBAL, [BatchEntry("q3", 0, 2)], q, k, v)  # room for a sequence again
        assert s.release(["q1", "q3"]) == 2
        assert b.release(["q3", "q4", "q5"]) == 3


def test_a_tenant_at_its_calls_quota_is_refused_until_its_call_ends(server: ServerProcess, pki: PKI) -> None:
    """A TransferKV to a target that accepts the connection and never answers holds the tenant's one call
    (max_calls 1) until its deadline; meanwhile its next call is refused, and another tenant's is not."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        q, k, v = qkv(np.random.default_rng(4), 1)
        with connect(server, pki, "small") as s, connect(server, pki, "b1") as b:
            s.attend(2, [BatchEntry("held", 0, 1)], q, k, v)
            failed: list[BaseException] = []

            def hold() -> None:
                with ChunkAttnClient(
                    server.target, root_certificates=pki.ca.pem, token=TOKENS["small"], timeout_s=3
                ) as c:
                    try:
                        c.transfer_kv("held", target)
                    except ChunkAttnError as e:
                        failed.append(e)

            holder = threading.Thread(target=hold)
            holder.start()
            refusal = None
            deadline = time.monotonic() + 2.5  # within the held transfer's 3 s
            while refusal is None and time.monotonic() < deadline:
                try:
                    s.release(["nothing"], missing_ok=True)  # the tenant's second call, once the transfer runs
                    time.sleep(0.05)
                except ChunkAttnError as e:
                    refusal = e
            assert refusal is not None, "the tenant's second call was never refused"
            assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_calls 1" in refusal.message
            assert s.info().active_sequences == 1  # Info is never refused by the limits
            assert b.release(["nothing"], missing_ok=True) == 0
            holder.join()
            assert [getattr(x, "code", None) for x in failed] == [grpc.StatusCode.DEADLINE_EXCEEDED], failed
            assert s.release(["held"]) == 1


# -- TransferKV between two TLS servers with tokens --------------------------------------------------------


@pytest.mark.slow
def test_transfer_between_tls_token_servers_lands_with_the_tokens_tenant(
    server: ServerProcess, pki: PKI, tmp_path: Path
) -> None:
    tokens = token_file(
        tmp_path / "target.json", {"importer": {"token": TOKENS["importer"]}, "other": {"token": TOKENS["other"]}}
    )
    rng = np.random.default_rng(5)
    target = ServerProcess(*FLAGS, *tls_flags(pki), "--auth-tokens", str(tokens))
    with target, connect(server, pki, "a1") as src, connect(target, pki, "importer") as dst:
        ref = ReferenceModel.for_server(src.info())
        entry = [BatchEntry("moved", 0, 21)]
        for layer in range(4):
            q, k, v = qkv(rng, 21)
            src.attend(layer, entry, q, k, v)
            ref.attend(layer, entry, q, k, v)
        free = dst.info().free_blocks
        for token in ("", "not-the-importers"):  # no token, a wrong one: the target's refusal, passed on
            with pytest.raises(ChunkAttnError) as e:
                src.transfer_kv("moved", target.target, target_token=token)
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, e.value
            assert (dst.info().active_sequences, dst.info().free_blocks) == (0, free)  # nothing left there
            assert src.info().active_sequences == 1  # nor lost here
        done = src.transfer_kv("moved", target.target, target_token=TOKENS["importer"], release_after=True)
        assert done.released
        assert src.info().active_sequences == 0
        assert dst.info().active_sequences == 1
        with connect(target, pki, "other") as stranger:  # it is the importer's, no one else's
            assert code_of(lambda: list(stranger.export_kv("moved"))) == grpc.StatusCode.NOT_FOUND
        for layer in range(4):  # and it decodes on as it would have at the source
            q, k, v = qkv(rng, 1)
            ok, err = within_tolerance(
                dst.attend(layer, [BatchEntry("moved", 21, 1)], q, k, v),
                ref.attend(layer, [BatchEntry("moved", 21, 1)], q, k, v),
                "float32",
            )
            assert ok, err
        dst.release(["moved"])


# -- SIGHUP -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sighup_reloads_the_certificate_and_the_tokens_keeping_open_streams_of_valid_tokens(
    pki: PKI, tmp_path: Path
) -> None:
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_bytes(pki.server.cert)
    key.write_bytes(pki.server.key)
    tokens = token_file(tmp_path / "tokens.json", {"t": {"tokens": [TOKENS["a1"], TOKENS["b1"]]}})
    flags = ["--tls-cert", str(cert), "--tls-key", str(key), "--auth-tokens", str(tokens)]
    successor = CA(tmp_path, "successor")
    q, k, v = qkv(np.random.default_rng(6), 1)

    def reloaded(line: str) -> None:
        before = s.log().count(line)
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while s.log().count(line) == before:
            assert time.monotonic() < deadline, s.log()
            time.sleep(0.1)

    with ServerProcess(*FLAGS, *flags) as s, connect(s, pki, "a1") as by_a1, connect(s, pki, "b1") as by_b1:
        kept, ended = by_b1.stream(), by_a1.stream()
        kept.attend(0, [BatchEntry("open", 0, 1)], q, k, v)
        ended.attend(0, [BatchEntry("other", 0, 1)], q, k, v)
        renewed = successor.server()
        cert.write_bytes(renewed.cert)
        key.write_bytes(renewed.key)
        token_file(tokens, {"t": {"tokens": [TOKENS["b1"], TOKENS["b2"]]}})  # a1's token revoked, b2's issued
        reloaded("token file reloaded")
        assert "TLS certificate reloaded" in s.log()
        with connect(s, pki, "b2", root_certificates=successor.pem) as after:
            assert after.info().active_sequences == 2  # the same tenant, under its new token
        with connect(s, pki, "a1", root_certificates=successor.pem) as revoked:
            assert code_of(revoked.info) == grpc.StatusCode.UNAUTHENTICATED
        with connect(s, pki, "b1") as old_ca:  # a new connection gets the new certificate
            assert code_of(old_ca.info) == grpc.StatusCode.UNAVAILABLE
        kept.attend(0, [BatchEntry("open", 1, 1)], q, k, v)  # a stream of a valid token goes on
        with pytest.raises(ChunkAttnError) as e:  # one of a revoked token ends at its next message
            ended.attend(0, [BatchEntry("other", 1, 1)], q, k, v)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        kept.close()
        key.write_bytes(pki.runner_a.key)  # a key that is not the certificate's: refused, the old pair stays
        reloaded("TLS files not reloaded")
        tokens.write_text("{ not json")  # a bad token file: refused, the old one stays
        reloaded("the token file was not reloaded")
        with connect(s, pki, "b2", root_certificates=successor.pem) as still:
            assert still.release(["open", "other"]) == 2


def test_a_stream_message_sent_under_a_revoked_token_is_refused_and_not_carried_out(tmp_path: Path) -> None:
    """The token is checked when a stream's message arrives, not before the server waits for it: a message
    that comes after the revocation is refused and changes nothing. Both ways a token stops naming the
    stream's tenant: revoked, and moved to another tenant."""
    tokens = token_file(tmp_path / "tokens.json", {"team-a": {"tokens": [TOKENS["a1"], TOKENS["a2"]]}})
    q, k, v = qkv(np.random.default_rng(11), 5)
    with ServerProcess(*FLAGS, "--auth-tokens", str(tokens)) as s:

        def reload(tenants: dict[str, dict[str, Any]]) -> None:
            before = s.log().count("token file reloaded")
            token_file(tokens, tenants)
            s.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while s.log().count("token file reloaded") == before:
                assert time.monotonic() < deadline, s.log()
                time.sleep(0.1)

        with ChunkAttnClient(s.target, token=TOKENS["a1"]) as t1, ChunkAttnClient(s.target, token=TOKENS["a2"]) as t2:
            stream = t1.stream()
            stream.attend(0, [BatchEntry("s", 0, 5)], q, k, v)
            reload({"team-a": {"token": TOKENS["a2"]}})  # T1 revoked
            with pytest.raises(ChunkAttnError) as e:
                stream.attend(0, [BatchEntry("s", 5, 1)], q[:1], k[:1], v[:1])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            t2.attend(0, [BatchEntry("s", 5, 1)], q[:1], k[:1], v[:1])  # position 5 is free: nothing was written

            moving = t2.stream()
            moving.attend(0, [BatchEntry("s", 6, 1)], q[:1], k[:1], v[:1])
            reload({"team-a": {"token": TOKENS["a1"]}, "team-b": {"token": TOKENS["a2"]}})  # T2 moved to team-b
            with pytest.raises(ChunkAttnError) as e:
                moving.attend(0, [BatchEntry("s", 7, 1)], q[:1], k[:1], v[:1])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with ChunkAttnClient(s.target, token=TOKENS["a1"]) as a:  # team-a's "s" still ends at 7
            a.attend(0, [BatchEntry("s", 7, 1)], q[:1], k[:1], v[:1])

            # An import whose stream ends after its token was revoked is not committed (its end is checked too).
            chunks = list(a.export_kv("s"))
            revoke = {"team-a": {"token": TOKENS["a2"]}, "team-b": {"token": TOKENS["b1"]}}

            def sent_then_revoked() -> Iterator[pb.KVChunk]:
                yield from chunks
                time.sleep(1)  # the server has read and written every message, the trailer too
                reload(revoke)  # and the stream ends after the revocation

            free = a.info().free_blocks
            with pytest.raises(ChunkAttnError) as e:
                a.import_kv(sent_then_revoked(), seq_id="imported")
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with ChunkAttnClient(s.target, token=TOKENS["a2"]) as a2:
            assert a2.info().free_blocks == free
            assert a2.release(["imported"], missing_ok=True) == 0


# -- the CLI, the bench and the transformers session ------------------------------------------------------


def test_the_cli_and_bench_run_against_a_tls_token_server(
    server: ServerProcess, pki: PKI, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secure = ["--target", server.target, "--tls-ca", str(pki.ca.path)]
    monkeypatch.setenv("CHUNKATTN_TOKEN", TOKENS["b1"])
    assert main(["info", *secure, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["active_sequences"] == 0
    out = tmp_path / "bench.json"
    short = ["--duration", "2", "--prompt-len", "20", "--output-len", "4", "--verify", "5", "--progress", "none"]
    assert main(["bench", *secure, *short, "--json", str(out), "--transport", "stream"]) == 0
    summary = json.loads(out.read_text())
    assert summary["verify"]["mismatches"] == 0
    assert summary["verify"]["checked"] == 5
    assert TOKENS["b1"] not in out.read_text()
    monkeypatch.delenv("CHUNKATTN_TOKEN")
    assert main(["bench", *secure, *short, "--token", "wrong"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


@pytest.mark.slow
def test_the_transformers_session_runs_against_a_tls_token_server(pki: PKI, tmp_path: Path) -> None:
    from chunkattn_client.hf import OffloadSession, generate_locally
    from examples.hf_offload import build_model, prompts_of

    model = build_model(seed=0)
    prompts = prompts_of([9, 18], model.config.vocab_size)
    model.config.save_pretrained(tmp_path)
    tokens = token_file(tmp_path / "tokens.json", {"hf": {"token": TOKENS["a1"]}})
    flags = ["--hf-config", str(tmp_path / "config.json"), "--kv-memory-mib", "8", "--auth-tokens", str(tokens)]
    local = generate_locally(model, prompts, 6)
    with ServerProcess(*flags, *tls_flags(pki)) as s, connect(s, pki, "a1") as client:
        with OffloadSession(client, model) as session:
            remote = session.generate(prompts, 6)
        assert remote.tokens == local.tokens


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("openssl") is None, reason="scripts/make-certs.sh needs openssl (apt-get install openssl)"
)
def test_the_documented_certificate_script_makes_a_working_mutual_tls_setup(tmp_path: Path) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "make-certs.sh"), str(tmp_path), "runner-a"], check=True)
    tokens = token_file(tmp_path / "tokens.json", {"a": {"subjects": ["runner-a"]}})
    files = {name: (tmp_path / name).read_bytes() for name in ("ca.pem", "runner-a.crt", "runner-a.key")}
    flags = ["--tls-cert", str(tmp_path / "server.crt"), "--tls-key", str(tmp_path / "server.key")]
    flags += ["--tls-client-ca", str(tmp_path / "ca.pem"), "--auth-tokens", str(tokens)]
    with ServerProcess(*FLAGS, *flags) as s:
        client = ChunkAttnClient(
            s.target,
            root_certificates=files["ca.pem"],
            certificate_chain=files["runner-a.crt"],
            private_key=files["runner-a.key"],
            timeout_s=20,
        )
        with client:
            assert client.info().active_sequences == 0


class FakeTarget:
    """A gRPC server that answers ImportKV (and Info) with UNAUTHENTICATED and notes each call's credentials."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            metadata = dict(context.invocation_metadata() or ())
            value = metadata.get("authorization")
            self.seen.append(value.decode() if isinstance(value, bytes) else value)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "fake target: no")

        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "ImportKV": grpc.stream_unary_rpc_method_handler(refuse),
            "Info": grpc.unary_unary_rpc_method_handler(refuse),
        }
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("chunkattn.v1.ChunkAttn", handlers),)
        )
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)


@pytest.mark.slow
def test_the_servers_own_transfer_token_goes_only_to_the_targets_it_names() -> None:
    allowed, other = FakeTarget(), FakeTarget()
    try:
        flags = ["--transfer-token", TOKENS["importer"], "--transfer-targets", f"{allowed.target}, unused:1"]
        with ServerProcess(*FLAGS, *flags) as s, ChunkAttnClient(s.target, timeout_s=20) as c:
            q, k, v = qkv(np.random.default_rng(10), 2)
            c.attend(0, [BatchEntry("x", 0, 2)], q, k, v)
            for fake in (allowed, other):
                with pytest.raises(ChunkAttnError) as refused:
                    c.transfer_kv("x", fake.target)
                assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: c.transfer_kv("x", other.target, target_token="its-own")) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            for bad in ("t\u00f6k\u00e9n", "x" * 5000):  # not ASCII; longer than a header holds
                with pytest.raises(ChunkAttnError) as e:
                    c.transfer_kv("x", other.target, target_token=bad)
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert bad not in e.value.message
            assert TOKENS["importer"] not in s.log()
        assert set(allowed.seen) == {f"Bearer {TOKENS['importer']}"}
        assert set(other.seen) == {None, "Bearer its-own"}
    finally:
        allowed.close()
        other.close()


def test_an_unauthenticated_call_is_refused_at_its_headers_not_after_its_message(
    server: ServerProcess, pki: PKI
) -> None:
    """A client without credentials that opens calls and never sends their message holds nothing: each is
    refused at once (gRPC would otherwise hold it, and its slot, waiting for the message)."""
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.pem)
    never = threading.Event()

    def silence() -> Iterator[bytes]:
        never.wait(30)
        yield b""

    with grpc.secure_channel(server.target, creds) as channel:
        attend: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary("/chunkattn.v1.ChunkAttn/Attend")
        started = time.monotonic()
        for metadata in (None, (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as e:
                attend(silence(), metadata=metadata, timeout=20)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert time.monotonic() - started < 10  # refused, not timed out
    never.set()
    key = ("chunkattn_requests_total", (("code", "UNAUTHENTICATED"), ("rpc", "Attend"), ("transport", "grpc")))
    assert server.metrics()[key] >= 2


def test_an_import_waiting_for_its_next_message_holds_no_call_of_its_tenant(server: ServerProcess, pki: PKI) -> None:
    """ "small" may work on one call at a time; an import whose client pauses between messages does not keep it."""
    with connect(server, pki, "small") as s:
        q, k, v = qkv(np.random.default_rng(11), 40)
        s.attend(GLOBAL, [BatchEntry("source", 0, 40)], q, k, v)
        chunks = list(s.export_kv("source", max_message_bytes=4096))  # header, several messages, trailer
        assert len(chunks) > 3
        s.release(["source"])
        go_on = threading.Event()
        result: list[Any] = []

        def paused() -> Iterator[pb.KVChunk]:
            yield from chunks[:2]
            go_on.wait(30)
            yield from chunks[2:]

        importer = threading.Thread(target=lambda: result.append(s.import_kv(paused(), seq_id="copy")))
        importer.start()
        time.sleep(1.0)  # the header and the first blocks are in
        assert s.release(["nothing"], missing_ok=True) == 0  # the tenant's one call is free
        go_on.set()
        importer.join(30)
        assert result[0].seq_id == "copy"
        assert s.release(["copy"]) == 1


def test_a_tenant_at_its_open_calls_quota_cannot_open_more_streams(server: ServerProcess, pki: PKI) -> None:
    """Idle streams hold no call slot, so max_calls does not bound them: max_open_calls does, per tenant."""
    q, k, v = qkv(np.random.default_rng(12), 1)
    with connect(server, pki, "streams") as c, connect(server, pki, "b1") as b:
        first, second = c.stream(), c.stream()
        first.attend(0, [BatchEntry("one", 0, 1)], q, k, v)
        second.attend(0, [BatchEntry("two", 0, 1)], q, k, v)
        with pytest.raises(ChunkAttnError) as e:
            c.info()  # a third call open: refused, whatever it is
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_open_calls 2" in e.value.message
        assert b.info().active_sequences == 0  # another tenant is not held back
        first.close()
        deadline = time.monotonic() + 10
        released = None
        while released is None:  # the server sees the stream end a moment after the client does
            try:
                released = c.release(["one", "two"])
            except ChunkAttnError as busy:
                if busy.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert released == 2
        second.close()
