"""The vLLM plugin's layer call (chunkattn_client.vllm.offload.Offload.attend) against a real server, without
vLLM: a step larger than the client's message limit (smaller than the server's) goes in several calls, and
gives what one call gives."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from chunkattn_client import ChunkAttnClient
from chunkattn_client.split import MESSAGE_HEADROOM
from chunkattn_client.vllm import offload as plugin
from tests.helpers.server_process import SMALL, ServerProcess
from tests.helpers.vllm_layers import LAYERS

pytestmark = pytest.mark.server

TOKENS, BLOCK = 40, 4  # one row: a prefill of 40 tokens over 10 blocks
PER_TOKEN = (4 + 2 * 2) * 16 * 4 + 8  # q, k, v of float32 and the slot
TABLES = 4 * (TOKENS // BLOCK) + 16  # the row's block table and fields


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "256") as s:
        yield s


def _step(offload: plugin.Offload, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(TOKENS, h, 16, generator=g) for h in (4, 2, 2))
    metadata = SimpleNamespace(
        num_actual_tokens=TOKENS,
        seq_lens=torch.tensor([TOKENS]),
        query_start_loc=torch.tensor([0, TOKENS]),
        slot_mapping=torch.arange(TOKENS),
        block_table=torch.arange(TOKENS // BLOCK)[None],
    )
    output = torch.zeros(TOKENS, 4, 16)
    offload.attend(0, q, k, v, metadata, output)
    return output


def test_a_step_over_the_clients_message_limit_goes_in_several_calls(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = plugin.PluginConfig(target=server.target, transport="unary")
    whole = plugin.Offload(config, LAYERS, 16, BLOCK, [0, 1, 2, 3])
    try:
        expected = _step(whole)
        assert whole.profile["calls"] == 1
    finally:
        whole.close()
    # the worker's client takes 16 tokens' worth of messages; the server, its default (far more)
    small = functools.partial(ChunkAttnClient, max_message_bytes=MESSAGE_HEADROOM + TABLES + 16 * PER_TOKEN)
    monkeypatch.setattr(plugin, "ChunkAttnClient", small)
    cut = plugin.Offload(config, LAYERS, 16, BLOCK, [0, 1, 2, 3])
    try:
        assert cut.info.max_message_bytes > cut.client.max_message_bytes
        got = _step(cut)
        assert cut.profile["calls"] == 3  # 16 + 16 + 8 tokens
    finally:
        cut.close()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with ChunkAttnClient(server.target) as c:
        assert c.list_block_spaces() == []
