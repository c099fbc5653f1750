"""vLLM's KV connector for disaggregated prefill/decode whose KV never leaves chunkattn (docs/vllm.md, #38).

With the plugin on, a vLLM instance's KV lives in its block space on the chunkattn server, so handing a request
from a prefill instance to a decode instance is a copy inside the server, with no KV bytes on the network (or,
when the two instances use two servers, a push of the prompt's live blocks from one server to the other):

- **Prefill side** (a request whose ``kv_transfer_params`` has ``"do_remote_decode": true``): in the step where
  the request's prompt is complete, the worker parks the blocks that hold it (every layer's plane) under a fresh
  grant (GrantBlocks, after the step's forward: every layer's K/V is on the server by then; with
  CHUNKATTN_VLLM_GRANT_TARGET, on that server, its live blocks sent there by this instance's server), and the
  request's output carries ``{"do_remote_prefill": true, "chunkattn_grant": <id>, "num_tokens": n,
  "block_size": bs, "server": <where the grant is>, "prompt_hash": <hex>}``. The grant is a copy, so vLLM frees
  (or caches) the request's blocks at once; the grant waits CHUNKATTN_VLLM_GRANT_TTL_S for its taker, then the
  server ends it.
- **Decode side** (a request carrying those params, whose prompt is the prefill prompt or starts with it): the
  scheduler reports the grant's tokens past vLLM's own prefix-cache hit as loadable, asynchronously (the request
  waits in WAITING_FOR_REMOTE_KVS while its blocks are filled); the worker has its server copy those of the
  grant's blocks into the blocks vLLM allocated (CopyBlocks, which takes the grant) before the request's first
  step. vLLM computes the rest of the prompt (at least its last token) and decodes.
- **Failures** recompute, never decode from wrong KV: a grant the server refuses (taken, expired, never parked,
  a restarted server, a grant on another server) reports the blocks it was to fill as load errors
  (``get_block_ids_with_load_errors``), and vLLM recomputes the prompt from its last valid block; params naming
  another block size or another prompt are never claimed (the prompt is computed as if they were absent). The
  connector runs vLLM's ``kv_load_failure_policy`` as ``recompute`` (vLLM's default ``fail`` would end such a
  request with an error). Each request claims once: preempted and resumed, it recomputes from vLLM's prefix
  cache.

Loaded with ``kv_transfer_config={"kv_connector": "ChunkAttnConnector", "kv_connector_module_path":
"chunkattn_client.vllm.connector", "kv_role": "kv_both"}`` in both instances, with the plugin on
(CHUNKATTN_VLLM_TARGET). One KV cache group only: vLLM turns its hybrid KV cache manager off for a connector
without ``SupportsHMA``. Environment, besides the plugin's (offload.PluginConfig), read on the prefill side:

    CHUNKATTN_VLLM_GRANT_TTL_S         seconds a grant waits to be taken, 1 to 3600 (default 60)
    CHUNKATTN_VLLM_GRANT_TO_TENANT     the tenant that may take the grants besides the grantor's (a decode
                                       instance under other credentials); default: the grantor's alone
    CHUNKATTN_VLLM_GRANT_TARGET        host:port of the decode instances' chunkattn server as this instance's
                                       server reaches it, when it is another server; default: the same server
    CHUNKATTN_VLLM_GRANT_TARGET_TOKEN  the token this instance's server presents there (its tenant there owns
                                       the grants); default: that server's --transfer-token
    CHUNKATTN_VLLM_GRANT_LIVE_ONLY     1: send that server only the live blocks (a chunked layer's last chunk),
                                       for decode instances without prefix caching; default 0: every block (a
                                       prefix cache may serve a block's earlier chunks to another prompt)

Counters in the worker's Offload ``profile`` (written with CHUNKATTN_VLLM_PROFILE): grants, granted_blocks,
grant_s, grant_network_bytes, grant_failures on the prefill side; claims, claimed_blocks, claim_s,
claim_failures on the decode side.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from chunkattn_client.client import ChunkAttnError
from chunkattn_client.limits import target_problem, token_problem
from chunkattn_client.vllm.offload import OffloadError, PluginConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from chunkattn_client.vllm.offload import Offload

log = logging.getLogger("chunkattn_client.vllm")

GRANT_TTL_ENV = "CHUNKATTN_VLLM_GRANT_TTL_S"
GRANT_TO_TENANT_ENV = "CHUNKATTN_VLLM_GRANT_TO_TENANT"
GRANT_TARGET_ENV = "CHUNKATTN_VLLM_GRANT_TARGET"
GRANT_TARGET_TOKEN_ENV = "CHUNKATTN_VLLM_GRANT_TARGET_TOKEN"
GRANT_LIVE_ONLY_ENV = "CHUNKATTN_VLLM_GRANT_LIVE_ONLY"
DEFAULT_GRANT_TTL_S = 60.0
MAX_GRANT_TTL_S = 3600.0  # the server's bound (GrantBlocksRequest.ttl_s)
GRANT_KEY = "chunkattn_grant"


@dataclass(frozen=True)
class GrantSettings:
    """The prefill side's grants: their ttl, the tenant they also go to, and the server they are parked on
    (empty: the plugin's own) with the token this instance's server presents there."""

    ttl_s: float = DEFAULT_GRANT_TTL_S
    to_tenant: str = ""
    target: str = ""
    target_token: str = ""
    live_only: bool = False


def grant_settings(env: Mapping[str, str] = os.environ) -> GrantSettings:
    """CHUNKATTN_VLLM_GRANT_TTL_S (1 to 3600 s, default 60), CHUNKATTN_VLLM_GRANT_TO_TENANT (default empty: its
    own tenant alone), CHUNKATTN_VLLM_GRANT_TARGET (host:port of the decode instances' chunkattn server, as this
    instance's server reaches it; default empty: the grants stay on this instance's server) and
    CHUNKATTN_VLLM_GRANT_TARGET_TOKEN (the token its server presents there; default: the server's own
    --transfer-token), CHUNKATTN_VLLM_GRANT_LIVE_ONLY (1: send another server only the live blocks; default 0:
    every block, as a decode instance with prefix caching needs). OffloadError naming the variable for a value
    the server would refuse."""
    raw = env.get(GRANT_TTL_ENV, "").strip()
    try:
        ttl_s = float(raw) if raw else DEFAULT_GRANT_TTL_S
    except ValueError:
        raise OffloadError(f"{GRANT_TTL_ENV} must be a number of seconds, got {raw!r}") from None
    if not 1.0 <= ttl_s <= MAX_GRANT_TTL_S:
        raise OffloadError(f"{GRANT_TTL_ENV} must be 1 to {MAX_GRANT_TTL_S:.0f} seconds, got {raw}")
    to_tenant = env.get(GRANT_TO_TENANT_ENV, "").strip()
    if len(to_tenant.encode()) > 256:
        raise OffloadError(f"{GRANT_TO_TENANT_ENV} is at most 256 bytes")
    target = env.get(GRANT_TARGET_ENV, "").strip()
    problem = target and target_problem(target)
    if problem:
        raise OffloadError(f"{GRANT_TARGET_ENV}: {problem}")
    token = env.get(GRANT_TARGET_TOKEN_ENV, "").strip()
    problem = token and token_problem(token, GRANT_TARGET_TOKEN_ENV)
    if problem:
        raise OffloadError(problem)
    live_only = env.get(GRANT_LIVE_ONLY_ENV, "").strip()
    if live_only not in ("", "0", "1"):
        raise OffloadError(f"{GRANT_LIVE_ONLY_ENV} must be 0 or 1, got {live_only!r}")
    return GrantSettings(ttl_s, to_tenant, target, token, live_only == "1")


def prompt_hash(token_ids: Sequence[int]) -> str:
    """What the decode side checks its prompt against: sha256 of the prompt's token ids (int64, little-endian),
    32 hex digits."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class Handoff:
    """A prefill instance's handed-over request, as its ``kv_transfer_params`` name it: the grant holding the
    prompt's blocks (grant block i holds prompt tokens [i * block_size, (i + 1) * block_size)), the prompt's
    length and hash, the blocks' size, and the server holding the grant."""

    grant_id: str
    num_tokens: int
    block_size: int
    server: str
    prompt_hash: str

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` the prefill side's output carries (the proxy hands them to the decode side)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            GRANT_KEY: self.grant_id,
            "num_tokens": self.num_tokens,
            "block_size": self.block_size,
            "server": self.server,
            "prompt_hash": self.prompt_hash,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> Handoff | None:
        """The handoff a request's params ask the decode side to claim; None when they ask for none (no
        ``do_remote_prefill``, no grant) or are malformed (logged: the prompt is then computed)."""
        if not params or not params.get("do_remote_prefill") or GRANT_KEY not in params:
            return None
        try:
            return cls(
                grant_id=str(params[GRANT_KEY]),
                num_tokens=int(params["num_tokens"]),
                block_size=int(params["block_size"]),
                server=str(params["server"]),
                prompt_hash=str(params.get("prompt_hash", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            log.warning("chunkattn: malformed kv_transfer_params (%s: %s): the prompt is computed", type(e).__name__, e)
            return None

    def refusal(self, request: Request, block_size: int) -> str | None:
        """Why this vLLM instance cannot take the handoff for ``request`` (another block size, or KV that is not
        of the request's first ``num_tokens`` prompt tokens), or None. The server it names is not compared with
        this instance's (one server has many names: the copy finds the grant, or is refused and recomputed)."""
        if self.block_size != block_size:
            return f"its blocks hold {self.block_size} tokens, this instance's {block_size}"
        tokens = request.prompt_token_ids
        if not 0 < self.num_tokens <= request.num_prompt_tokens or tokens is None:
            return f"it holds {self.num_tokens} prompt tokens, the request has {request.num_prompt_tokens}"
        if prompt_hash(tokens[: self.num_tokens]) != self.prompt_hash:
            return "it holds another prompt's KV (its prompt_hash differs)"
        return None


@dataclass(frozen=True)
class GrantItem:
    """Prefill side, one request: park ``block_ids`` (the prompt's blocks, in order) under ``grant_id``, tagged
    with the prompt's hash."""

    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    grant_id: str
    tag: str = ""


@dataclass(frozen=True)
class ClaimItem:
    """Decode side, one request: copy the grant's blocks ``source`` (indices into it) into this space's blocks
    ``dest``; with ``reason`` set, copy nothing and report ``dest`` as load errors (the scheduler found the plan
    inconsistent)."""

    req_id: str
    grant_id: str
    source: tuple[int, ...]
    dest: tuple[int, ...]
    reason: str = ""
    tag: str = ""  # the prompt's hash: the server gives the grant only if it was parked for this prompt


@dataclass
class ChunkAttnConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM's class: Any to mypy
    """One step's work for the worker: grants to park after the forward, claims to copy, and the handoffs the
    scheduler declined (counted as claim failures)."""

    grants: list[GrantItem] = field(default_factory=list)
    claims: list[ClaimItem] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)


class ChunkAttnConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM's class: Any to mypy
    """vLLM's connector for prefill/decode through chunkattn (module docstring). Scheduler side:
    which requests to park and claim, per step; worker side: the GrantBlocks and CopyBlocks calls, on the
    plugin's client (the model runner's thread, between its layer calls)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = PluginConfig.from_env()
        if config is None:
            raise OffloadError(
                "ChunkAttnConnector hands requests over inside the chunkattn server, where the plugin keeps vLLM's"
                " KV: set CHUNKATTN_VLLM_TARGET to the server (docs/vllm.md), or use another kv_connector"
            )
        if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
            raise OffloadError(
                "ChunkAttnConnector does not support vLLM's hybrid KV cache manager: turn it off"
                " (--disable-hybrid-kv-cache-manager; vLLM turns it off itself unless told otherwise)"
            )
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise OffloadError(f"ChunkAttnConnector needs one KV cache group, vLLM made {len(groups)}")
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            # Read by the scheduler right after it creates this connector (vllm/v1/core/sched/scheduler.py).
            log.info("chunkattn: a handoff the server refuses is recomputed (kv_load_failure_policy=recompute)")
            transfer.kv_load_failure_policy = "recompute"
        self._target = config.target
        self._block_size = int(groups[0].kv_cache_spec.block_size)
        self._grants = grant_settings()
        # Scheduler side: prefill requests to park (by id) and those parked; decode requests that claimed once;
        # the next step's claims and declined handoffs.
        self._producing: dict[str, Request] = {}
        self._granted: dict[str, Handoff] = {}
        self._claimed: set[str] = set()
        self._claims: list[ClaimItem] = []
        self._declined: list[str] = []
        # Worker side: this step's finished claims and the blocks that failed to load.
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()

    # ----- scheduler side -----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The grant's tokens past vLLM's own (block-aligned) hit, loaded asynchronously, for a request whose
        params hand it over, that this instance can take and that has not claimed yet; else none. No side effects
        (vLLM may ask again)."""
        handoff = Handoff.from_params(request.kv_transfer_params)
        if handoff is None or request.request_id in self._claimed:
            return 0, False
        if handoff.refusal(request, self._block_size) is not None:
            return 0, False
        count = handoff.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """A request got its blocks: a prefill request to park is noted; a handoff becomes this step's claim
        (the blocks past vLLM's own hit, copied from the grant's same blocks), or is declined; either way it is
        claimed once."""
        params = request.kv_transfer_params
        req_id = request.request_id
        if params and params.get("do_remote_decode") and request.prompt_token_ids is not None:
            self._producing[req_id] = request
        handoff = Handoff.from_params(params)
        if handoff is None or req_id in self._claimed:
            return
        self._claimed.add(req_id)
        if num_external_tokens == 0:
            reason = handoff.refusal(request, self._block_size) or "vLLM loads nothing for it"
            self._declined.append(f"request {req_id}: {reason}")
            return
        self._claims.append(self._claim_plan(req_id, handoff, blocks, num_external_tokens))

    def _claim_plan(self, req_id: str, handoff: Handoff, blocks: KVCacheBlocks, num_external: int) -> ClaimItem:
        """The copy for ``num_external`` tokens after the request's leading cached blocks (vLLM's own hit, which
        hold hashes; the loaded ones get theirs once loaded): grant blocks first..end into the request's same
        blocks. A plan past the grant's tokens copies nothing and fails those blocks (vLLM recomputes them)."""
        (group,) = blocks.blocks
        ids = [int(b.block_id) for b in group]
        first = 0
        while first < len(group) and group[first].block_hash is not None and not group[first].is_null:
            first += 1
        start = first * self._block_size
        end = math.ceil((start + num_external) / self._block_size)
        dest = tuple(ids[first:end])
        if start + num_external > handoff.num_tokens or len(dest) != end - first:
            reason = f"vLLM asks for tokens {start}..{start + num_external} of a grant of {handoff.num_tokens}"
            return ClaimItem(req_id, handoff.grant_id, (), tuple(ids[first:]), reason)
        return ClaimItem(req_id, handoff.grant_id, tuple(range(first, end)), dest, tag=handoff.prompt_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkAttnConnectorMetadata:
        """This step's work: grants for the prefill requests whose prompt completes in it (computed before the
        step + scheduled >= prompt length; vLLM calls this before advancing num_computed_tokens), each once, of
        the blocks holding the prompt; and the claims and declined handoffs since the last step."""
        meta = ChunkAttnConnectorMetadata(claims=self._claims, declined=self._declined)
        self._claims, self._declined = [], []
        for req_id, request in self._producing.items():
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            prompt = request.num_prompt_tokens
            if req_id in self._granted or not scheduled or request.num_computed_tokens + scheduled < prompt:
                continue
            needed = math.ceil(prompt / self._block_size)
            block_ids = self._block_ids(scheduler_output, req_id)
            if len(block_ids) < needed:
                log.error("chunkattn: request %s holds %d blocks for %d prompt tokens", req_id, len(block_ids), prompt)
                continue
            handoff = Handoff(
                grant_id=secrets.token_hex(16),
                num_tokens=prompt,
                block_size=self._block_size,
                server=self._grants.target or self._target,
                prompt_hash=prompt_hash(request.prompt_token_ids),
            )
            self._granted[req_id] = handoff
            item = GrantItem(req_id, tuple(block_ids[:needed]), prompt, handoff.grant_id, handoff.prompt_hash)
            meta.grants.append(item)
        return meta

    def _block_ids(self, scheduler_output: SchedulerOutput, req_id: str) -> list[int]:
        """The request's block ids now (its one KV cache group): from the scheduler output's block state where
        vLLM offers it, else from the KV cache manager."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        found = state.get_block_ids(req_id) if state is not None else None
        if found is None:
            assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager to the connector"
            found = self._kv_cache_manager.get_block_ids(req_id)
        return [int(b) for b in found[0]]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A finished request: a parked one's params name its grant (its blocks are free at once: the grant is
        a copy); any other, none (a prefill request aborted before its prompt completed parked nothing)."""
        req_id = request.request_id
        self._producing.pop(req_id, None)
        self._claimed.discard(req_id)
        handoff = self._granted.pop(req_id, None)
        return False, None if handoff is None else handoff.to_params()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The groups a claim restores: every one (the request's own blocks, all planes)."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ----- worker side -----

    def _metadata(self) -> ChunkAttnConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkAttnConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """This step's claims, each a CopyBlocks from its grant (the requests wait in WAITING_FOR_REMOTE_KVS,
        outside this step's forward); a refused copy reports its blocks as load errors."""
        meta = self._metadata()
        if not meta.claims and not meta.declined:
            return
        offload = _offload()
        for reason in meta.declined:
            log.warning("chunkattn: handoff not claimed, the prompt is computed: %s", reason)
            _count(offload, claim_failures=1)
        for claim in meta.claims:
            self._claim(offload, claim)

    def _claim(self, offload: Offload | None, claim: ClaimItem) -> None:
        self._recved.add(claim.req_id)
        started = time.perf_counter()
        problem = claim.reason or ("the chunkattn plugin has no block space" if offload is None else "")
        if not problem and claim.dest:
            assert offload is not None
            try:
                offload.client.copy_blocks(
                    offload.space_id,
                    claim.dest,
                    grant_id=claim.grant_id,
                    source_block_ids=claim.source,
                    expect_tag=claim.tag,
                )
            except ChunkAttnError as e:
                problem = f"the server refused the copy: {e}"
        if problem:
            log.warning("chunkattn: request %s's handoff failed, vLLM recomputes its prompt: %s", claim.req_id, problem)
            self._load_errors.update(claim.dest)
            _count(offload, claim_failures=1)
            return
        _count(offload, claims=1, claimed_blocks=len(claim.dest), claim_s=time.perf_counter() - started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: claims complete before their request's first step."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: each layer's K/V is on the server once its call returns."""

    def wait_for_save(self) -> None:
        """After the step's forward: park each grant (GrantBlocks). A failed park is logged and counted, never
        raised (the decode side finds no grant and recomputes)."""
        meta = self._metadata()
        if not meta.grants:
            return
        offload = _offload()
        for grant in meta.grants:
            started = time.perf_counter()
            try:
                if offload is None:
                    raise OffloadError("the chunkattn plugin has no block space")
                g = self._grants
                sent = offload.client.grant_blocks(
                    offload.space_id,
                    grant.block_ids,
                    grant.grant_id,
                    num_tokens=grant.num_tokens,
                    ttl_s=g.ttl_s,
                    to_tenant=g.to_tenant,
                    target=g.target,
                    target_token=g.target_token,
                    whole=bool(g.target) and not g.live_only,
                    tag=grant.tag,
                )
            except (ChunkAttnError, OffloadError) as e:
                log.error("chunkattn: could not park request %s's blocks (its decode recomputes): %s", grant.req_id, e)
                _count(offload, grant_failures=1)
                continue
            _count(
                offload,
                grants=1,
                granted_blocks=len(grant.block_ids),
                grant_s=time.perf_counter() - started,
                grant_network_bytes=sent.network_bytes,
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose claim ended this step, loaded or not (a failed one's blocks are load errors)."""
        done, self._recved = self._recved, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks refused claims were to fill, since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors


def _offload() -> Offload | None:
    """The worker's Offload, or None (logged) when the plugin opened none."""
    from chunkattn_client.vllm import backend

    try:
        return backend.current()
    except OffloadError as e:
        log.error("chunkattn: %s", e)
        return None


def _count(offload: Offload | None, **amounts: float) -> None:
    """Add to the Offload's profile counters."""
    if offload is None:
        return
    for key, amount in amounts.items():
        offload.profile[key] = offload.profile.get(key, 0) + amount
