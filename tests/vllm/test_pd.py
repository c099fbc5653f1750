"""Prefill/decode disaggregation through one chunkattn server (ChunkAttnConnector, docs/vllm.md): a prefill vLLM
instance computes each prompt (max_tokens 1, ``{"do_remote_decode": true}``, as vLLM's P/D proxies ask) and parks
its blocks under a grant; a decode vLLM instance, given the returned kv_transfer_params, has the server copy them
into its own blocks and decodes. Greedy, float32, on test_parity.py's scenario, the decode instance generates
vLLM alone's tokens (top-1 logprobs within 1e-4: the ``alone`` run is test_parity's, shared) through

- prompts crossing chunk boundaries (C = 64), split by chunked prefill on the prefill side (max_num_batched_tokens
  64, prompts up to 300 tokens), 10 concurrent requests in a pool of 32 blocks on either side;
- a decode prompt that extends the prefill prompt (the prefill side gets all but its last 10 tokens): the decode
  side claims those and computes the rest, from inside the grant's last block;
- prefix caching on the prefill side (a batch sharing a 130-token prefix with the one before, handed over while
  that one's blocks are cached), and on the decode side (it copies only the blocks its own cache lacks);
- a decode instance that preempts (its 32 blocks cannot hold the 10 requests: a resumed request recomputes from
  its prefix cache, never claims again);
- a prefill instance SIGKILLed (its whole process group) once its handoffs are parked: the decode instance takes
  every grant regardless;
- params naming a grant that does not exist (a prefill instance killed before its handoff): the copy is refused,
  vLLM recomputes the prompt; params naming another server: claimed here, refused, the prompt recomputed;

and afterwards the server holds no block and no space (every grant taken, the killed instance's space gone with
its lease), its metrics counting each grant parked and taken, the missing one refused, no byte over the
network. Two vLLM starts in all (one prefill run of four batches, one decode run).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.server_process import counter
from tests.vllm.conftest import BLOCK_SIZE, GENERATE, generate, plugin_free_env

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from chunkattn_client import ChunkAttnClient
from chunkattn_client.vllm.connector import ChunkAttnConnector, GrantSettings, Handoff, grant_settings, prompt_hash
from chunkattn_client.vllm.offload import OffloadError
from tests.vllm.test_parity import LOGPROB_BOUND, _compare, _empty, _plane, _scenario, _server

pytestmark = [pytest.mark.vllm]

CONNECTOR = {
    "kv_connector": "ChunkAttnConnector",
    "kv_connector_module_path": "chunkattn_client.vllm.connector",
    "kv_role": "kv_both",
}
PD_SERVER_BLOCKS = 2048  # both instances' spaces (32 blocks each) and every parked grant at once
MISSING_GRANT = (1, 3)  # (batch, prompt): params naming a grant never parked
OTHER_SERVER = (1, 7)  # params naming another server (claimed there: refused, recomputed)
EXTENDED = (0, 4)  # a decode prompt that extends the prefill prompt (300 tokens; the prefill side gets 290)
EXTENSION = 10
SHARED_PREFIX = 130  # tokens batches 2 and 3 share (test_parity's scenario)
PREFILL_LEASE_S = "2"  # the killed prefill instance's space leaves the server this soon
# Each instance's KV cache, in blocks (CHUNKATTN_VLLM_KV_BLOCKS): with a connector that does not support it, vLLM
# turns its hybrid KV cache manager off, so a block takes a page per layer, and test_parity's
# kv_cache_memory_bytes (32 blocks of one page) would give 8, too few for max_model_len.
KV_BLOCKS = "32"


def _prefill_and_kill(args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """generate.py holding after its result, in a session of its own; its result, then SIGKILL to its process
    group (vLLM's engine process and its worker with it: no clean shutdown, the space stays until its lease)."""
    proc = subprocess.Popen(
        [sys.executable, str(GENERATE), json.dumps({**args, "hold": True})],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    said: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # vLLM logs here too
            if line.startswith("RESULT "):
                result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
                return result
            said.append(line)
        raise AssertionError("the prefill instance ended without a result:\n" + "".join(said[-80:]))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


def _failing_params(prompt: list[int], target: str, server: str | None = None) -> dict[str, Any]:
    """Params of the connector's shape for ``prompt``, naming a grant that was never parked (on ``server``)."""
    return {
        "do_remote_prefill": True,
        "chunkattn_grant": secrets.token_hex(16),
        "num_tokens": len(prompt),
        "block_size": BLOCK_SIZE,
        "server": server or target,
        "prompt_hash": prompt_hash(prompt),
    }


@pytest.mark.slow
@pytest.mark.server
def test_prefill_and_decode_through_one_server_generate_vllm_alones_tokens(
    checkpoint: Path, alone: dict[str, Any]
) -> None:
    scenario = _scenario(checkpoint)
    batches: list[list[list[int]]] = scenario["batches"]
    failing = {MISSING_GRANT, OTHER_SERVER}
    handed = [(b, i) for b, batch in enumerate(batches) for i in range(len(batch)) if (b, i) not in failing]
    flags, plane = _plane()
    with _server(checkpoint, *flags, num_blocks=PD_SERVER_BLOCKS) as server:
        plane = {**plane, "CHUNKATTN_VLLM_KV_BLOCKS": KV_BLOCKS}
        env = {**plugin_free_env(), **plane, "CHUNKATTN_VLLM_TARGET": server.target}
        prefill_env = {**env, "CHUNKATTN_VLLM_LEASE_S": PREFILL_LEASE_S, "CHUNKATTN_VLLM_GRANT_TTL_S": "600"}
        asks = [[None if (b, i) in failing else {"do_remote_decode": True} for i in range(len(batch))]
                for b, batch in enumerate(batches)]  # fmt: skip
        sent = [[p[:-EXTENSION] if (b, i) == EXTENDED else p for i, p in enumerate(batch)]
                for b, batch in enumerate(batches)]  # fmt: skip
        prefill = _prefill_and_kill(
            {**scenario, "batches": sent, "max_tokens": 1, "kv_transfer_config": CONNECTOR, "kv_transfer_params": asks},
            prefill_env,
        )
        given = _by_prompt(batches, prefill["outputs"])
        params = [[given[(b, i)]["kv_transfer_params"] for i in range(len(batch))] for b, batch in enumerate(batches)]
        for (b, i), elsewhere in ((MISSING_GRANT, None), (OTHER_SERVER, "elsewhere:50051")):
            params[b][i] = _failing_params(batches[b][i], server.target, elsewhere)
        decode = generate(
            {**scenario, "kv_transfer_config": CONNECTOR, "kv_transfer_params": params},
            target=server.target,
            env=plane,
        )
        _empty(server)
        calls = server.metrics()
    for b, i in handed:
        out = given[(b, i)]["kv_transfer_params"]
        assert out is not None, f"prompt {(b, i)}: the prefill side handed nothing over"
        described = (out["num_tokens"], out["block_size"], out["server"], out["prompt_hash"])
        assert described == (len(sent[b][i]), BLOCK_SIZE, server.target, prompt_hash(sent[b][i]))
    assert all(given[p]["kv_transfer_params"] is None for p in failing), "asked for no handoff, it made one"
    worst = _compare(alone, decode, LOGPROB_BOUND)
    assert prefill["profile"]["grants"] == len(handed)
    assert "grant_failures" not in prefill["profile"]
    assert prefill["counters"].get("vllm:prefix_cache_hits", 0) > 0, "the shared prefix was meant to hit the cache"
    # The decode side took every parked grant (the prefill instance dead by then), copying each prompt's blocks but
    # those its own prefix cache held (the shared prefix's full blocks, for the second of its two prompts).
    assert decode["profile"]["claims"] == len(handed)
    blocks = sum(math.ceil(len(batches[b][i]) / BLOCK_SIZE) for b, i in handed)
    assert decode["profile"]["claimed_blocks"] == blocks - SHARED_PREFIX // BLOCK_SIZE
    assert decode["profile"]["claim_failures"] == len(failing)
    assert decode["counters"].get("vllm:num_preemptions", 0) > 0, "the pool was meant to make vLLM preempt"
    assert decode["counters"].get("vllm:prefix_cache_hits", 0) > 0
    # The server's side: every grant parked and taken, the missing one refused, nothing over the network.
    assert counter(calls, "chunkattn_handoffs_total", op="grant", code="OK") == len(handed)
    assert counter(calls, "chunkattn_handoffs_total", op="take", code="OK") == len(handed)
    assert counter(calls, "chunkattn_handoffs_total", op="take", code="NOT_FOUND") == len(failing)
    assert counter(calls, "chunkattn_handoff_blocks_total", op="take") == decode["profile"]["claimed_blocks"]
    assert counter(calls, "chunkattn_handoff_bytes_total", where="network") == 0
    assert counter(calls, "chunkattn_grants_expired_total") == 0
    parked, copied = prefill["profile"], decode["profile"]
    print(
        f"worst logprob difference {worst:.2e}; {len(handed)} handoffs: parked in {parked['grant_s'] * 1e3:.1f} ms,"
        f" {copied['claimed_blocks']:.0f} blocks copied in {copied['claim_s'] * 1e3:.1f} ms; prefill"
        f" {prefill['llm_s']:.0f} + {prefill['generate_s']:.1f} s, decode {decode['llm_s']:.0f} +"
        f" {decode['generate_s']:.1f} s (vLLM alone {alone['generate_s']:.1f} s); preemptions: prefill"
        f" {prefill['counters'].get('vllm:num_preemptions', 0):.0f}, decode"
        f" {decode['counters']['vllm:num_preemptions']:.0f}"
    )


@pytest.mark.slow
@pytest.mark.server
def test_prefill_and_decode_through_two_servers_generate_vllm_alones_tokens(
    checkpoint: Path, alone: dict[str, Any]
) -> None:
    """The prefill instance on one server, the decode instance on another: the prefill side's grants go to the
    decode side's server (CHUNKATTN_VLLM_GRANT_TARGET), their blocks whole on the network."""
    scenario = _scenario(checkpoint)
    batches: list[list[list[int]]] = scenario["batches"]
    flags, plane = _plane()
    plane = {**plane, "CHUNKATTN_VLLM_KV_BLOCKS": KV_BLOCKS}
    asks = [[{"do_remote_decode": True} for _ in batch] for batch in batches]
    with (
        _server(checkpoint, *flags, num_blocks=PD_SERVER_BLOCKS) as first,
        _server(checkpoint, *flags, num_blocks=PD_SERVER_BLOCKS) as second,
    ):
        prefill = generate(
            {**scenario, "max_tokens": 1, "kv_transfer_config": CONNECTOR, "kv_transfer_params": asks},
            target=first.target,
            env={**plane, "CHUNKATTN_VLLM_GRANT_TARGET": second.target, "CHUNKATTN_VLLM_GRANT_TTL_S": "600"},
        )
        params = [[out["kv_transfer_params"] for out in outs] for outs in _batched(batches, prefill["outputs"])]
        decode = generate(
            {**scenario, "kv_transfer_config": CONNECTOR, "kv_transfer_params": params},
            target=second.target,
            env=plane,
        )
        _empty(first)
        _empty(second)
        sent, took = first.metrics(), second.metrics()
        with ChunkAttnClient(second.target) as c:
            info = c.info()
    handed = sum(len(batch) for batch in batches)
    assert all(p is not None and p["server"] == second.target for outs in params for p in outs)
    worst = _compare(alone, decode, LOGPROB_BOUND)
    assert prefill["profile"]["grants"] == decode["profile"]["claims"] == handed
    assert "claim_failures" not in decode["profile"]
    network = counter(sent, "chunkattn_handoff_bytes_total", op="grant", where="network")
    assert network == prefill["profile"]["grant_network_bytes"] > 0
    # Every block's every plane travels (the decode instance's prefix cache may serve the blocks' earlier chunks to
    # other prompts: CHUNKATTN_VLLM_GRANT_LIVE_ONLY is off): the prompts' blocks, one page per layer, float32.
    blocks = sum(math.ceil(len(p) / BLOCK_SIZE) for batch in batches for p in batch)
    assert network == blocks * len(info.layers) * 2 * BLOCK_SIZE * info.num_kv_heads * info.head_size * 4
    assert counter(sent, "chunkattn_grants_expired_total") == counter(took, "chunkattn_grants_expired_total") == 0
    assert counter(took, "chunkattn_handoffs_total", op="take", code="OK") == handed
    assert counter(took, "chunkattn_kv_transfers_total", direction="in", code="OK") == handed
    print(f"two servers: worst logprob difference {worst:.2e}; {handed} handoffs, {network:.0f} bytes on the network")


def _batched(batches: list[list[list[int]]], outputs: list[Any]) -> list[list[Any]]:
    """generate.py's outputs cut back into ``batches``' shape."""
    out, at = [], 0
    for batch in batches:
        out.append(outputs[at : at + len(batch)])
        at += len(batch)
    return out


def _by_prompt(batches: list[list[list[int]]], outputs: list[dict[str, Any]]) -> dict[tuple[int, int], Any]:
    """generate.py's outputs (batch after batch, in prompt order) by (batch, prompt)."""
    places = [(b, i) for b, batch in enumerate(batches) for i in range(len(batch))]
    assert len(outputs) == len(places)
    return dict(zip(places, outputs, strict=True))


# The connector's own decisions, without a vLLM instance: vLLM's config, requests and blocks as the few fields
# the connector reads.


def _connector(monkeypatch: pytest.MonkeyPatch, *, target: str | None = "srv:1", hybrid: bool = False) -> Any:
    monkeypatch.delenv("CHUNKATTN_VLLM_TARGET", raising=False)
    if target is not None:
        monkeypatch.setenv("CHUNKATTN_VLLM_TARGET", target)
    transfer = SimpleNamespace(kv_load_failure_policy="fail", is_kv_producer=True, is_kv_consumer=True)
    config = SimpleNamespace(
        kv_transfer_config=transfer, scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid)
    )
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK_SIZE))]
    return ChunkAttnConnector(config, KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=groups))


def _request(req_id: str, prompt: list[int], params: dict[str, Any] | None) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
        num_computed_tokens=0,
        kv_transfer_params=params,
    )


def _blocks(ids: list[int], cached: int) -> Any:
    """vLLM's KVCacheBlocks of one group: ``ids``, the first ``cached`` of them a prefix-cache hit (hashed)."""
    group = [
        SimpleNamespace(block_id=b, block_hash=b"h" if n < cached else None, is_null=False) for n, b in enumerate(ids)
    ]
    return SimpleNamespace(blocks=(group,))


def test_the_connector_starts_only_with_the_plugin_and_without_the_hybrid_kv_cache_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(OffloadError, match="set CHUNKATTN_VLLM_TARGET"):
        _connector(monkeypatch, target=None)
    with pytest.raises(OffloadError, match="--disable-hybrid-kv-cache-manager"):
        _connector(monkeypatch, hybrid=True)
    connector = _connector(monkeypatch)
    assert connector._vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_TTL_S", "0.5")
    with pytest.raises(OffloadError, match="CHUNKATTN_VLLM_GRANT_TTL_S must be 1 to 3600"):
        grant_settings()
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_TTL_S", "120")
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_TO_TENANT", "decode")
    assert grant_settings() == GrantSettings(120.0, "decode")
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_TARGET", "decode-server:50051")
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_TARGET_TOKEN", "t" * 40)
    assert grant_settings() == GrantSettings(120.0, "decode", "decode-server:50051", "t" * 40)
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_LIVE_ONLY", "1")
    assert grant_settings().live_only
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_LIVE_ONLY", "yes")
    with pytest.raises(OffloadError, match="CHUNKATTN_VLLM_GRANT_LIVE_ONLY must be 0 or 1"):
        grant_settings()
    monkeypatch.delenv("CHUNKATTN_VLLM_GRANT_LIVE_ONLY")
    monkeypatch.setenv("CHUNKATTN_VLLM_GRANT_TARGET", "no port")
    with pytest.raises(OffloadError, match="CHUNKATTN_VLLM_GRANT_TARGET"):
        grant_settings()


def test_a_handoff_is_claimed_once_for_its_prompt_past_the_local_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode side claims the grant's tokens past vLLM's own hit (copying only the blocks it lacks), once;
    params for another prompt are declined (counted on the worker), never claimed; params naming another server
    are claimed (one server has many names: the copy finds the grant, or is refused and the prompt recomputed)."""
    connector = _connector(monkeypatch)
    prompt = list(range(3, 103))  # 100 tokens: grant blocks 0..3
    params = Handoff("g" * 32, 100, BLOCK_SIZE, "srv:1", prompt_hash(prompt)).to_params()
    request = _request("a", prompt, params)
    assert connector.get_num_new_matched_tokens(request, 64) == (36, True)
    connector.update_state_after_alloc(request, _blocks([7, 8, 9, 10], cached=2), 36)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # preempted and resumed: recomputes
    longer = _request("b", [*prompt, 5, 6], params)  # a decode prompt extending the prefill prompt
    assert connector.get_num_new_matched_tokens(longer, 0) == (100, True)
    elsewhere = _request("c", prompt, {**params, "server": "elsewhere:1"})
    assert connector.get_num_new_matched_tokens(elsewhere, 0) == (100, True)
    others = [_request("d", [9, *prompt[1:]], params), _request("e", prompt[:99], params)]
    for other in others:
        assert connector.get_num_new_matched_tokens(other, 0) == (0, False)
        connector.update_state_after_alloc(other, _blocks([1, 2, 3, 4], cached=0), 0)
    meta = connector.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    (claim,) = meta.claims
    assert (claim.req_id, claim.grant_id, claim.source, claim.dest, claim.reason, claim.tag) == (
        "a",
        "g" * 32,
        (2, 3),
        (9, 10),
        "",
        prompt_hash(prompt),
    )
    assert len(meta.declined) == 2
    assert "another prompt" in meta.declined[0]
    assert connector.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).claims == []


def test_a_prefill_request_is_parked_once_in_the_step_its_prompt_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    connector = _connector(monkeypatch)
    prompt = list(range(70))
    request = _request("p", prompt, {"do_remote_decode": True})
    aborted = _request("q", prompt, {"do_remote_decode": True})
    for r in (request, aborted):
        connector.update_state_after_alloc(r, _blocks([4, 5, 6], cached=0), 0)
    tables = {"p": ([4, 5, 6, 11],), "q": ([1, 2, 3],)}
    state = SimpleNamespace(get_block_ids=tables.get)

    def step(scheduled: dict[str, int]) -> Any:
        return connector.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens=scheduled, kv_connector_block_state=state)
        )

    assert step({"p": 64, "q": 64}).grants == []  # chunked prefill: 64 of 70 tokens
    request.num_computed_tokens = aborted.num_computed_tokens = 64
    (grant,) = step({"p": 6}).grants
    assert (grant.req_id, grant.block_ids, grant.num_tokens, grant.tag) == ("p", (4, 5, 6), 70, prompt_hash(prompt))
    request.num_computed_tokens = 70
    assert step({"p": 1}).grants == []  # parked once
    delay, params = connector.request_finished(request, [4, 5, 6])
    assert not delay
    assert params == Handoff(grant.grant_id, 70, BLOCK_SIZE, "srv:1", prompt_hash(prompt)).to_params()
    assert connector.request_finished(aborted, [1, 2, 3]) == (False, None)
