"""The vLLM plugin's block space lease (chunkattn_client.vllm.offload, issue 35.5), without vLLM: the worker's
Offload opens its space with CHUNKATTN_VLLM_LEASE_S and renews it every third of the lease, so an idle vLLM
keeps its KV on a server that never evicts idle KV (--idle-timeout-s 0), and a worker killed with SIGKILL
leaves its space there for one lease at most."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkattn_client import ChunkAttnClient
from chunkattn_client.vllm.offload import Offload, OffloadError, PluginConfig
from tests.helpers.server_process import SMALL, ServerProcess, counter
from tests.helpers.vllm_layers import LAYERS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "256", "--idle-timeout-s", "0") as s:
        yield s


@pytest.mark.server
def test_an_idle_worker_keeps_its_space_by_renewing_it(server: ServerProcess) -> None:
    config = PluginConfig(target=server.target, lease_s=1.0, transport="unary")
    offload = Offload(config, LAYERS, 16, 4, [0, 1, 2, 3])
    try:
        with ChunkAttnClient(server.target) as c:
            (listed,) = c.list_block_spaces()
            assert (listed.space_id, listed.lease_s) == (offload.space_id, 1.0)
            time.sleep(3)  # three leases without a call
            (listed,) = c.list_block_spaces()
            assert listed.space_id == offload.space_id
            assert listed.idle_s < 1.0
    finally:
        offload.close()
    with ChunkAttnClient(server.target) as c:
        assert c.list_block_spaces() == []


WORKER = """
import sys, time
from chunkattn_client.vllm.offload import Offload, PluginConfig
sys.path.insert(0, sys.argv[2])
from tests.helpers.vllm_layers import LAYERS
offload = Offload(PluginConfig(target=sys.argv[1], lease_s=1.0), LAYERS, 16, 4, [0, 1, 2, 3])
print(offload.space_id, flush=True)
time.sleep(600)
"""


@pytest.mark.server
def test_a_killed_workers_space_goes_after_its_lease(server: ServerProcess) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, server.target, str(ROOT)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        space_id = worker.stdout.readline().strip()
        assert len(space_id) == 32, server.log()
        with ChunkAttnClient(server.target) as c:
            time.sleep(2)  # alive: renewed
            assert [x.space_id for x in c.list_block_spaces()] == [space_id]
            evicted = counter(server.metrics(), "chunkattn_block_spaces_evicted_total")
            worker.kill()  # SIGKILL: no close, no renewal
            worker.wait()
            deadline = time.monotonic() + 10
            while c.list_block_spaces():
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.1)
            assert counter(server.metrics(), "chunkattn_block_spaces_evicted_total") == evicted + 1
            assert c.info().free_blocks == c.info().num_blocks
    finally:
        worker.kill()


def test_a_lease_out_of_range_is_refused_naming_the_variable() -> None:
    for bad in ("0", "0.5", "1e9", "soon"):
        with pytest.raises(OffloadError, match="CHUNKATTN_VLLM_LEASE_S"):
            PluginConfig.from_env({"CHUNKATTN_VLLM_TARGET": "x:1", "CHUNKATTN_VLLM_LEASE_S": bad})
    assert PluginConfig.from_env({"CHUNKATTN_VLLM_TARGET": "x:1"}).lease_s == 30.0  # type: ignore[union-attr]
