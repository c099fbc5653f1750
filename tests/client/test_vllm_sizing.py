"""The vLLM plugin sizing vLLM's KV cache (chunkattn_client.vllm.offload, issue 37.2), without vLLM:
CHUNKATTN_VLLM_KV_BLOCKS / _KV_BYTES read strictly, a byte budget turned into blocks with the server's Info,
and the bounds: the server's free pool (checked before vLLM sizes anything) and the tenant's quota (the
server's refusal when the space opens), each error naming the bound and what to set. Also the data plane
setting (CHUNKATTN_DATA_PLANE) the plugin hands its client."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import pytest

from chunkattn_client import ChunkAttnClient
from chunkattn_client.vllm.offload import (
    Offload,
    OffloadError,
    PluginConfig,
    space_blocks,
)
from tests.helpers.server_process import SMALL, ServerProcess
from tests.helpers.vllm_layers import LAYERS, PLANES

POOL = 64
TOKEN = "secret-vllm"  # tenant "small": 8 blocks at most
BIG = "secret-big"  # tenant "big": no quota


def _config(**env: str) -> PluginConfig:
    config = PluginConfig.from_env({"CHUNKATTN_VLLM_TARGET": "x:1", **env})
    assert config is not None
    return config


@pytest.mark.parametrize("name", ["CHUNKATTN_VLLM_KV_BLOCKS", "CHUNKATTN_VLLM_KV_BYTES"])
@pytest.mark.parametrize("bad", ["0", "-3", "1.5", "lots"])
def test_a_size_that_is_not_a_positive_whole_number_is_refused_naming_the_variable(name: str, bad: str) -> None:
    with pytest.raises(OffloadError, match=f"{name} must be a whole number > 0, got"):
        _config(**{name: bad})


def test_the_sizes_are_read_and_one_of_them_at_most() -> None:
    assert not _config().sizes_kv
    sized = _config(CHUNKATTN_VLLM_KV_BLOCKS="200")
    assert (sized.kv_blocks, sized.sizes_kv) == (200, True)
    assert _config(CHUNKATTN_VLLM_KV_BYTES="1048576").kv_bytes == 1 << 20
    with pytest.raises(OffloadError, match="CHUNKATTN_VLLM_KV_BLOCKS or CHUNKATTN_VLLM_KV_BYTES, not both"):
        _config(CHUNKATTN_VLLM_KV_BLOCKS="1", CHUNKATTN_VLLM_KV_BYTES="1")


def test_the_data_plane_setting_is_read_strictly() -> None:
    assert _config().data_plane == "auto"
    assert _config(CHUNKATTN_DATA_PLANE="grpc").data_plane == "grpc"
    with pytest.raises(OffloadError, match="CHUNKATTN_DATA_PLANE must be one of auto, grpc, zmq, got 'ZMQ'"):
        _config(CHUNKATTN_DATA_PLANE="ZMQ")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A pool of POOL blocks; tenant "small" (token TOKEN) may hold 8 of them, tenant "big" (BIG) any."""
    tokens = tmp_path_factory.mktemp("auth") / "tokens.json"
    small, big = (hashlib.sha256(t.encode()).hexdigest() for t in (TOKEN, BIG))
    tenants = {"small": {"tokens_sha256": [small], "max_kv_blocks": 8}, "big": {"tokens_sha256": [big]}}
    tokens.write_text(json.dumps({"tenants": tenants}))
    with ServerProcess(*SMALL, "--num-blocks", str(POOL), "--auth-tokens", str(tokens)) as s:
        yield s


@pytest.mark.server
def test_a_byte_budget_is_whole_space_blocks_of_the_servers_bytes(server: ServerProcess) -> None:
    with ChunkAttnClient(server.target, token=TOKEN) as c:
        info = c.info()
    planes = max(PLANES) + 1
    per_block = info.pool_blocks_per_space_block(planes)
    cost = per_block * info.bytes_per_block
    config = _config(CHUNKATTN_VLLM_TARGET=server.target, CHUNKATTN_VLLM_KV_BYTES=str(5 * cost + cost - 1))
    assert space_blocks(config, info, planes) == 5
    assert space_blocks(_config(CHUNKATTN_VLLM_KV_BLOCKS="7"), info, planes) == 7
    with pytest.raises(OffloadError, match=f"less than one KV block .* \\({cost} bytes"):
        space_blocks(_config(CHUNKATTN_VLLM_KV_BYTES=str(cost - 1)), info, planes)


@pytest.mark.server
def test_a_space_past_the_servers_free_pool_is_refused_before_vllm_sizes_anything(server: ServerProcess) -> None:
    with ChunkAttnClient(server.target, token=TOKEN) as c:
        info = c.info()
    planes = max(PLANES) + 1
    per_block = info.pool_blocks_per_space_block(planes)
    fits = info.free_blocks // per_block
    with pytest.raises(OffloadError) as e:
        space_blocks(_config(CHUNKATTN_VLLM_KV_BLOCKS=str(fits + 1)), info, planes)
    message = str(e.value)
    assert f"has {info.free_blocks} free of {POOL}" in message
    assert f"set CHUNKATTN_VLLM_KV_BLOCKS to at most {fits}" in message
    assert "--kv-memory-mib" in message
    assert space_blocks(_config(CHUNKATTN_VLLM_KV_BLOCKS=str(fits)), info, planes) == fits


@pytest.mark.server
def test_a_space_past_the_tenants_quota_is_refused_naming_the_quota(server: ServerProcess) -> None:
    config = _config(CHUNKATTN_VLLM_TARGET=server.target, CHUNKATTN_VLLM_TOKEN=TOKEN, CHUNKATTN_VLLM_KV_BLOCKS="9")
    with pytest.raises(OffloadError) as e:
        Offload(config, LAYERS, 9, 4, PLANES)
    message = str(e.value)
    assert "your tenant's block quota (max_kv_blocks)" in message
    assert "set CHUNKATTN_VLLM_KV_BLOCKS (or _KV_BYTES) smaller" in message
    assert "ask the operator for a larger max_kv_blocks" in message
    with ChunkAttnClient(server.target, token=TOKEN) as c:
        assert c.list_block_spaces() == []  # nothing held
        assert c.info().free_blocks == POOL


@pytest.mark.server
def test_a_space_past_the_pool_when_vllm_sizes_says_how_to_size_either_side(server: ServerProcess) -> None:
    config = _config(CHUNKATTN_VLLM_TARGET=server.target, CHUNKATTN_VLLM_TOKEN=BIG)
    with pytest.raises(OffloadError) as e:
        Offload(config, LAYERS, POOL, 4, PLANES)  # POOL space blocks of 4 planes: more than the pool
    message = str(e.value)
    assert "past the server's pool" in message
    assert "give vLLM a smaller KV cache (--kv-cache-memory-bytes" in message
    assert "or set CHUNKATTN_VLLM_KV_BLOCKS" in message
    assert "start the server with a larger pool (--kv-memory-mib)" in message
    with ChunkAttnClient(server.target, token=BIG) as c:
        assert c.list_block_spaces() == []
