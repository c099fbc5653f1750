"""Start-up configuration: every mistake is refused with a message that says what to change."""

from __future__ import annotations

import re

import pytest

from chunkattn_client import AsyncChunkAttnClient, ChunkAttnClient
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.config import demo_model
from chunkattn_server.errors import ConfigError
from chunkattn_server.flags import check, parse


def _model(*layers: LayerSpec, heads: int = 4, kv: int = 2, dim: int = 8) -> ModelShape:
    return ModelShape(num_heads=heads, num_kv_heads=kv, head_size=dim, layers=layers)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: _model(LayerSpec(16), heads=6, kv=4), "num_heads \\(6\\) must be a multiple of num_kv_heads \\(4\\)"),
        (lambda: _model(LayerSpec(16), dim=0), "head_size must be a positive integer"),
        (lambda: _model(), "at least one layer"),
        (lambda: _model(LayerSpec(-16)), "chunk_size must be >= 0"),
        (lambda: _model(LayerSpec(16, scale=0.0)), r"scale must be a number in \(0, 256\]"),
        (lambda: _model(LayerSpec(16, alibi_slopes=(1.0,))), "one slope per query head \\(4\\)"),
        (lambda: _model(LayerSpec(16, kv_source=0)), "kv_source must be another layer"),
        (lambda: _model(LayerSpec(16), LayerSpec(16, kv_source=5)), "kv_source must be another layer in \\[0, 2\\)"),
        (lambda: _model(LayerSpec(16), LayerSpec(0, kv_source=0)), "must have its source's chunk size \\(16\\)"),
        (
            lambda: _model(LayerSpec(16), LayerSpec(16, kv_source=0), LayerSpec(16, kv_source=1)),
            "is itself a KV-sharing layer; point at the layer that writes the cache \\(0\\)",
        ),
        (lambda: EngineConfig(_model(LayerSpec(24))), "chunk_size 24 is not a multiple of block_size 16"),
        (lambda: EngineConfig(_model(LayerSpec(16)), device="tpu"), "device must be auto, cpu, cuda or cuda:N"),
        (lambda: CacheConfig(block_size=0), "block_size must be positive"),
        (lambda: CacheConfig(num_blocks=None, memory_bytes=0), "give num_blocks or a positive memory_bytes"),
        (lambda: CacheConfig(dtype="float8"), "cache dtype must be one of"),
        (
            lambda: Engine(EngineConfig(_model(LayerSpec(16)), CacheConfig(memory_bytes=100), device="cpu")),
            "holds no block of 2048 bytes",
        ),
    ],
)
def test_bad_config_is_refused_clearly(build: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()  # type: ignore[operator]


def test_llama4_scout_groups_into_four_equal_kv_groups() -> None:
    """48 layers, every 4th global: 36 chunked + 12 global -> 3 chunked groups and 1 global group of 12."""
    scout = ModelShape.interleaved(
        num_layers=48, chunk_size=8192, global_every=4, num_heads=40, num_kv_heads=8, head_size=128
    )
    assert [s.chunk_size for s in scout.layers[:8]] == [8192, 8192, 8192, 0, 8192, 8192, 8192, 0]
    config = EngineConfig(scout, CacheConfig(memory_bytes=1 << 30), device="cpu")
    groups = config.kv_groups
    assert [(g.chunk_size, len(g.layers)) for g in groups] == [(8192, 12)] * 3 + [(0, 12)]
    assert sorted(layer for g in groups for layer in g.layers) == list(range(48))
    assert config.group_size == 12


def test_sharers_join_their_source_group_and_pool_is_sized_from_the_budget() -> None:
    model = _model(LayerSpec(16), LayerSpec(16, kv_source=0), LayerSpec(0), LayerSpec(16))
    config = EngineConfig(model, CacheConfig(block_size=16, memory_bytes=1 << 20, dtype="bfloat16"), device="cpu")
    assert [(g.chunk_size, g.layers, g.sharers) for g in config.kv_groups] == [
        (16, (0,), (1,)),
        (16, (3,), ()),
        (0, (2,), ()),
    ]
    engine = Engine(config)
    # one plane per group layer: 2 (K, V) x 16 tokens x 2 KV heads x 8 dims x 2 bytes
    assert engine.bytes_per_block == 2 * 16 * 2 * 8 * 2
    assert engine.stats().num_blocks == (1 << 20) // engine.bytes_per_block


def test_demo_model_is_llama4_interleaved() -> None:
    assert [s.chunk_size for s in demo_model().layers] == [1024, 1024, 1024, 0]


@pytest.mark.parametrize("value", ["2", "-1", "nan", "inf", "1e7"])
def test_a_keepalive_servers_would_refuse_or_grpc_cannot_take_is_refused_up_front(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        check(parse(["--transfer-keepalive-s", value]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--transfer-keepalive-s: keepalive must be None or 0 (no pings), or from 5 s (chunkattn servers" in err
    assert f"to 86400 s; got {float(value)!r}" in err
    for client in (ChunkAttnClient, AsyncChunkAttnClient):
        with pytest.raises(ValueError, match=re.escape(f"s; got {float(value)!r}")):
            client("127.0.0.1:1", keepalive_s=float(value))


@pytest.mark.parametrize(
    ("flag", "value"),
    [(f, v) for f in ("--idle-timeout-s", "--stream-idle-s", "--grace-s") for v in ("-1", "nan", "inf")]
    + [("--max-call-work", "-1")],  # an integer flag: argparse itself refuses nan and inf
)
def test_a_duration_or_limit_that_is_not_a_finite_number_is_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--idle-timeout-s inf was taken and made every space's lease inf, which a client renewing every third of
    its lease cannot wait for (found by the review of issue 35). 0 says "never" where a flag has a never."""
    with pytest.raises(SystemExit) as e:
        check(parse([flag, value]))
    assert e.value.code == 2
    assert f"{flag} must be a finite number >= 0" in capsys.readouterr().err


def test_a_work_bound_past_what_info_holds_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the review of issue 35: 2^63 passed the flags and stopped the start with a protobuf traceback."""
    with pytest.raises(SystemExit) as e:
        check(parse(["--max-call-work", str(2**63)]))
    assert e.value.code == 2
    assert "--max-call-work must be at most 2^62" in capsys.readouterr().err
    check(parse(["--max-call-work", str(2**62)]))


@pytest.mark.parametrize("value", [0.0, 5.0, 86_400.0])
def test_keepalives_servers_accept_are_taken(value: float) -> None:
    check(parse(["--transfer-keepalive-s", str(value)]))
    ChunkAttnClient("127.0.0.1:1", keepalive_s=value).close()


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("0", False), ("Off", False), ("yes", True)])
def test_an_on_off_flag_from_the_environment_is_read_as_a_boolean(
    value: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --no-batching sets batching: CHUNKATTN_BATCHING=false is the same (a plain string "false" was true).
    monkeypatch.setenv("CHUNKATTN_BATCHING", value)
    assert parse([]).batching is expected


def test_an_on_off_flag_from_the_environment_that_is_not_a_boolean_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHUNKATTN_BATCHING", "maybe")
    with pytest.raises(SystemExit):
        parse([])
    assert "CHUNKATTN_BATCHING='maybe': expected one of 1, true, yes, on, 0, false, no, off" in capsys.readouterr().err
