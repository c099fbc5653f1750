"""The token file, the authenticator, tenants' block accounts and quotas, in-process (no server)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkattn_client import BatchEntry, ChunkAttnClient
from chunkattn_server import CacheConfig, Engine, EngineConfig
from chunkattn_server.__main__ import main
from chunkattn_server.errors import ConfigError, QuotaExceeded, SequenceExists, Unauthenticated, UnknownSequence
from chunkattn_server.kv.block_pool import BlockPool
from chunkattn_server.kv.records import Quota
from chunkattn_server.service.auth import ANONYMOUS, Authenticator, Tenants, token_digest
from tests.helpers.harness import MODELS

DIGEST = token_digest("secret-a")


def write(tmp_path: Path, data: Any) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{", "is not valid JSON"),
        ({"tenant": {}}, 'expected {"tenants"'),
        ({"tenants": {"bad name": {"tokens_sha256": [DIGEST]}}}, "must be 1-64 of A-Z a-z 0-9 _ . -"),
        ({"tenants": {"a": {}}}, "needs a token (tokens_sha256) or a certificate subject"),
        ({"tenants": {"a": {"tokens_sha256": ["secret-a"]}}}, "token 0 of tenant 'a' is not a SHA-256 in hex"),
        (
            {"tenants": {"a": {"tokens_sha256": [DIGEST]}, "b": {"tokens_sha256": [DIGEST.upper()]}}},
            "token 0 of tenant 'b' is also token 0 of tenant 'a'",
        ),
        (
            {"tenants": {"a": {"tokens_sha256": [DIGEST, DIGEST]}}},
            "token 1 of tenant 'a' is also token 0 of tenant 'a'",
        ),
        (
            {"tenants": {"a": {"subjects": ["x"]}, "b": {"subjects": ["x"]}}},
            "subject 'x' names two tenants, 'a' and 'b'",
        ),
        ({"tenants": {"a": {"subjects": ["x", "x"]}}}, "subject 'x' is listed twice for tenant 'a'"),
        (
            {"tenants": {"a": {"tokens_sha256": [DIGEST], "max_kv_blocks": 0}}},
            "max_kv_blocks of tenant 'a' must be a positive",
        ),
        (
            {"tenants": {"a": {"tokens_sha256": [DIGEST], "max_calls": True}}},
            "max_calls of tenant 'a' must be a positive",
        ),
        ({"tenants": {"a": {"tokens_sha256": [DIGEST], "max_blocks": 3}}}, "unknown fields ['max_blocks']"),
        (
            {"tenants": {"a": {"tokens_sha256": DIGEST}}},
            "tokens_sha256 of tenant 'a' must be a list of non-empty strings",
        ),
    ],
)
def test_a_bad_token_file_is_refused_saying_what_is_wrong(tmp_path: Path, data: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        Tenants.load(write(tmp_path, data))
    assert message in str(e.value)
    assert "secret-a" not in str(e.value)


A = f'"a": {{"tokens_sha256": ["{DIGEST}"]}}'
B = f'"b": {{"tokens_sha256": ["{token_digest("secret-b")}"]}}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f'{{"tenants": {{{A}, {A}}}}}', "'a' is given twice in 'tenants'"),
        (f'{{"tenants": {{{A}, "a": {{"subjects": ["x"]}}}}}}', "'a' is given twice in 'tenants'"),
        (f'{{"tenants": {{{A}}}, "tenants": {{{B}}}}}', "'tenants' is given twice at the top level"),
        (
            f'{{"tenants": {{{B}, "a": {{"tokens_sha256": ["{DIGEST}"], "max_sequences": 2, "max_sequences": 9}}}}}}',
            "'max_sequences' is given twice in 'tenants' > 'a'",
        ),
        (
            f'{{"tenants": {{"a": {{"tokens_sha256": ["{DIGEST}"], "tokens_sha256": ["{token_digest("x")}"]}}}}}}',
            "'tokens_sha256' is given twice in 'tenants' > 'a'",
        ),
    ],
)
def test_a_key_given_twice_in_the_token_file_is_refused_not_last_wins(tmp_path: Path, text: str, message: str) -> None:
    """json.load alone would keep the last of each: a tenant's first entry (its token, its quotas) or the
    first "tenants" block would vanish without a word."""
    json.loads(text)  # valid JSON, each of them
    auth = Authenticator(write(tmp_path, {"tenants": {"old": {"tokens_sha256": [token_digest("secret-old")]}}}))
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        Tenants.load(path)
    assert str(e.value) == f"{path}: {message}; give each once (JSON readers keep only the last)"
    assert not auth.reload()  # as on SIGHUP: refused, the old tenants stay
    assert auth.tenant_of([("authorization", "Bearer secret-old")], {}).name == "old"


def test_tokens_and_subjects_name_tenants_and_nothing_else_does(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "tenants": {
                "a": {"tokens_sha256": [DIGEST], "max_sequences": 3, "max_calls": 2},
                "b": {"tokens_sha256": [token_digest("secret-b")], "subjects": ["runner-b"]},
            }
        },
    )
    auth = Authenticator(path)
    a = auth.tenant_of([("authorization", "Bearer secret-a")], {})
    assert (a.name, a.quota, a.max_calls) == ("a", Quota(None, 3), 2)
    assert auth.tenant_of([("x-other", "1"), ("authorization", b"bearer  secret-b ")], {}).name == "b"
    assert auth.tenant_of(None, {"x509_common_name": [b"runner-b"]}).name == "b"
    refusals = {
        "nothing": ([], {}),
        "a wrong token": ([("authorization", "Bearer secret-c")], {}),
        "another scheme": ([("authorization", "Basic secret-a")], {}),
        "an empty bearer": ([("authorization", "Bearer ")], {}),
        "an unknown subject": ([], {"x509_common_name": [b"runner-c"]}),
        "a wrong token with a good certificate": (
            [("authorization", "Bearer no")],
            {"x509_common_name": [b"runner-b"]},
        ),
    }
    for what, (metadata, peer) in refusals.items():
        with pytest.raises(Unauthenticated) as e:
            auth.tenant_of(metadata, peer)
        assert "secret" not in str(e.value), what
    assert Authenticator(None).tenant_of(None, {}) is ANONYMOUS


def test_a_reload_takes_a_good_file_and_keeps_the_old_one_over_a_bad_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, {"tenants": {"a": {"tokens_sha256": [DIGEST]}}})
    auth = Authenticator(path)
    write(tmp_path, {"tenants": {"a2": {"tokens_sha256": [token_digest("secret-a2")]}}})
    assert auth.reload()
    with pytest.raises(Unauthenticated):  # revoked
        auth.tenant_of([("authorization", "Bearer secret-a")], {})
    assert auth.tenant_of([("authorization", "Bearer secret-a2")], {}).name == "a2"
    write(tmp_path, "{ broken")
    with caplog.at_level(logging.ERROR):
        assert not auth.reload()
    assert "the previous one stays in force" in caplog.text
    assert auth.tenant_of([("authorization", "Bearer secret-a2")], {}).name == "a2"


def test_a_token_file_others_can_read_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, {"tenants": {"a": {"tokens_sha256": [DIGEST]}}})
    Path(path).chmod(0o644)
    with caplog.at_level(logging.WARNING):
        Authenticator(path)
    assert "chmod 600" in caplog.text


def test_hash_token_prints_the_digest_the_file_wants(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("secret-a\n"))
    assert main(["--hash-token"]) == 0
    assert capsys.readouterr().out.strip() == DIGEST
    monkeypatch.setattr("sys.stdin", io.StringIO("t\u00f6k\u00e9n\n"))  # a token no client could send
    with pytest.raises(SystemExit):
        main(["--hash-token"])
    assert "must be printable ASCII" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "x.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca (mutual TLS) needs TLS"),
        (["--auth-tokens", "/nonexistent/tokens.json"], "cannot read the token file /nonexistent/tokens.json"),
        (["--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"], "cannot read --tls-cert"),
        (
            ["--transfer-tls-cert", "c.pem", "--transfer-targets", "t:1"],
            "--transfer-tls-cert and --transfer-tls-key go",
        ),
        (["--transfer-token", "tok"], "name the targets they may go to with --transfer-targets"),
        (["--transfer-targets", "no-port"], "--transfer-targets: the target 'no-port' is not an address"),
    ],
)
def test_the_server_does_not_start_with_unusable_credentials(
    flags: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["--port", "0", "--metrics-port", "0", "--num-blocks", "8", *flags]) == 2
    assert message in caplog.text


# -- accounts and quotas in the KV layer ----------------------------------------------------------------------


def test_the_pool_charges_each_block_to_the_account_that_took_it() -> None:
    pool = BlockPool(10)
    a = pool.allocate(3, account="a")
    b = pool.allocate(2, account="b")
    pool.share(a[:2])  # a fork: still a's blocks
    assert (pool.used_by("a"), pool.used_by("b"), pool.usage()) == (3, 2, {"a": 3, "b": 2})
    pool.free(a)  # the shared two keep an owner
    assert pool.usage() == {"a": 2, "b": 2}
    pool.free(a[:2] + b)
    assert (pool.usage(), pool.num_free) == ({}, 10)


def test_quotas_hold_one_tenant_and_not_another() -> None:
    model = MODELS["gqa"]  # 6 layers, block size 4 below; layer 2 is global
    engine = Engine(EngineConfig(model, CacheConfig(block_size=4, num_blocks=64), device="cpu"))
    engine.kv.quotas = {"small": Quota(max_blocks=3, max_sequences=2)}

    def call(tenant: str, seq: str, position: int, n: int) -> None:
        q = torch.randn(n, model.num_heads, model.head_size)
        kv = torch.randn(n, model.num_kv_heads, model.head_size)
        engine.attend(2, [BatchEntry(seq, position, n)], q, kv, kv, tenant=tenant)

    call("small", "s", 0, 6)  # blocks 0 and 1 (half full)
    before = engine.kv.sequence("s", tenant="small")
    with pytest.raises(QuotaExceeded, match="max_kv_blocks"):
        call("small", "s", 6, 7)  # blocks 2 and 3 more: 4 > 3
    assert engine.kv.sequence("s", tenant="small") == before
    engine.kv.fork("s", "t", tenant="small")  # shares both: still 2 blocks
    call("small", "t", 6, 1)  # writes into the shared block 1: its copy is the third block
    with pytest.raises(QuotaExceeded, match="max_kv_blocks"):
        call("small", "s", 6, 3)  # in place in block 1, then block 2: a fourth
    assert (engine.stats().blocks_by_tenant, engine.kv.sequence_ids(tenant="small")) == ({"small": 3}, ["s", "t"])
    with pytest.raises(QuotaExceeded, match="max_sequences"):
        engine.kv.fork("s", "u", tenant="small")
    call("big", "s", 0, 40)  # another tenant: its own "s", no quota
    assert engine.kv.sequence("s", tenant="small") == before
    assert engine.stats().sequences_by_tenant == {"small": 2, "big": 1}
    with pytest.raises(UnknownSequence):
        engine.kv.release(["u"], tenant="small")
    with pytest.raises(SequenceExists):
        engine.kv.fork("s", "t", tenant="small")
    assert engine.kv.release(["s", "t"], tenant="small") == 2
    call("small", "v", 0, 12)  # 3 blocks: at the quota, not past it
    assert engine.stats().blocks_by_tenant == {"small": 3, "big": 10}


def test_imports_under_way_count_against_the_sequence_quota() -> None:
    """An import reserves at its header and commits at its trailer: the sequences to come count meanwhile, so
    concurrent imports cannot pass max_sequences."""
    model = MODELS["gqa"]
    source = Engine(EngineConfig(model, CacheConfig(block_size=4, num_blocks=64), device="cpu"))
    q = torch.randn(3, model.num_heads, model.head_size)
    kv = torch.randn(3, model.num_kv_heads, model.head_size)
    for layer in range(model.num_layers):
        source.attend(layer, [BatchEntry("s", 0, 3)], q, kv, kv, tenant="")
    manifest = source.transfer.export_manifest("s", tenant="")
    engine = Engine(EngineConfig(model, CacheConfig(block_size=4, num_blocks=64), device="cpu"))
    engine.kv.quotas = {"t": Quota(max_sequences=1)}
    first = engine.transfer.begin_import(manifest, tenant="t")
    with pytest.raises(QuotaExceeded, match="max_sequences"):
        engine.transfer.begin_import(manifest, tenant="t")
    with pytest.raises(QuotaExceeded, match="max_sequences"):
        engine.attend(0, [BatchEntry("other", 0, 3)], q, kv, kv, tenant="t")
    engine.transfer.abort_import(first)
    engine.transfer.abort_import(first)  # idempotent: counted off once
    second = engine.transfer.begin_import(manifest, tenant="t")
    engine.transfer.import_records(
        second, [v.copy() for v in source.transfer.export_views(manifest, manifest.expected())]
    )
    engine.transfer.commit_import(second)
    engine.transfer.abort_import(second)  # after a commit: nothing
    assert engine.stats().sequences_by_tenant == {"t": 1}
    with pytest.raises(QuotaExceeded, match="max_sequences"):
        engine.transfer.begin_import(dataclasses.replace(manifest, seq_id="s2"), tenant="t")


def test_a_token_that_cannot_travel_in_a_header_is_refused_by_the_client() -> None:
    for token in ("", " padded", "t\u00f6k\u00e9n", "line\nbreak", "x" * 4097):
        with pytest.raises(ValueError, match="travels in a header") as e:
            ChunkAttnClient("127.0.0.1:1", token=token)
        assert token not in str(e.value) or not token
    ChunkAttnClient("127.0.0.1:1", token="x" * 4096).close()
