"""The block API at the service edge: OpenBlockSpace, CloseBlockSpace, RenewBlockSpace and ListBlockSpaces,
GrantBlocks and CopyBlocks (block handoff between spaces: kv/grants.py), and an AttendRequest's BlockBatch
read into the engine's BlockCall (the integer arrays as they came; engine/blocks.py checks them against the
space)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import grpc
import numpy as np
import torch

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_server.config import ModelShape
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.scheduler import Scheduler
from chunkattn_server.engine.types import BlockCall, EngineStats, GrantAsk, Handoff
from chunkattn_server.errors import InvalidArgument, InvalidBatch
from chunkattn_server.kv.grants import DEFAULT_TTL_S
from chunkattn_server.kv.spaces import SPACE_ID_CHARS, SpaceState, lease
from chunkattn_server.service.auth import Tenant
from chunkattn_server.service.edge import Edge
from chunkattn_server.service.rpc import SMALL_REQUEST_BYTES, Context, message
from chunkattn_server.service.status import outcome_code
from chunkattn_server.service.transfer import DEFAULT_TRANSFER_TIMEOUT_S, Pushed


class BlockArgs(NamedTuple):
    """A block-addressed Attend request as the scheduler takes it: its layer and call."""

    layer: int
    call: BlockCall

    async def submit(self, scheduler: Scheduler, rpc: str, tenant: str) -> torch.Tensor:
        """The call's output (Scheduler.attend_blocks; the call carries its ``tenant``)."""
        return await scheduler.attend_blocks(rpc, self.layer, self.call)


def block_args(
    request: pb.AttendRequest,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    model: ModelShape,
    tenant: str,
) -> BlockArgs:
    """The request's BlockBatch as arrays; InvalidArgument naming the field whose bytes cannot be read (the
    values are the engine's to check)."""
    if request.entries:
        raise InvalidBatch("the request has entries and blocks; send one: entries (sequence API) or blocks (block API)")
    model.spec(request.layer)
    b = request.blocks
    if not 1 <= len(b.space_id) <= SPACE_ID_CHARS:
        raise InvalidArgument(
            f"blocks.space_id has {len(b.space_id)} characters; expected OpenBlockSpace's id ({SPACE_ID_CHARS})"
        )
    starts = _ints("blocks.query_start_loc", b.query_start_loc, "<i4")
    seq_lens = _ints("blocks.seq_lens", b.seq_lens, "<i4")
    table = _ints("blocks.block_table", b.block_table, "<i4")
    width = b.block_table_width
    if width < 0 or len(table) != len(seq_lens) * width:
        raise InvalidBatch(
            f"blocks.block_table has {len(table)} entries; expected rows ({len(seq_lens)}, seq_lens' count) x"
            f" block_table_width ({width})"
        )
    tables = table.reshape(len(seq_lens), width)
    slots = _ints("blocks.slot_mapping", b.slot_mapping, "<i8")
    return BlockArgs(request.layer, BlockCall(b.space_id, q, k, v, slots, starts, seq_lens, tables, tenant))


def grant_ask(r: pb.GrantBlocksRequest) -> GrantAsk:
    """A GrantBlocks request's fields as the engine takes them (the engine checks them)."""
    return GrantAsk(r.space_id, list(r.block_ids), r.grant_id, r.num_tokens, r.ttl_s, r.to_tenant, r.tag)


def _ints(field: str, data: bytes, dtype: str) -> np.ndarray:
    """A little-endian integer field's values, int64."""
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise InvalidBatch(f"{field} has {len(data)} bytes; expected {size}-byte little-endian integers")
    return np.frombuffer(data, dtype=dtype).astype(np.int64)


PushGrant = Callable[..., Awaitable[Pushed]]  # KVService.push_grant


class BlockService:
    """The block-space RPCs, over ``edge``; ``push_grant`` sends a grant to another server (KVService's). A
    space's lease is never longer than the server's --idle-timeout-s. Opening a space or a grant sets the edge's
    ``deadline``, so that whoever closes spaces past their lease and ends grants past their ttl (server.py's
    sweep) learns of it."""

    def __init__(self, edge: Edge, push_grant: PushGrant) -> None:
        self._push_grant = push_grant
        self._run = edge.run
        self._observe_pool = edge.observe_pool
        self._edge = edge
        self._idle_timeout_s = edge.config.idle_timeout_s
        # The longest list of block ids a request may carry: the pool's, at most 10 bytes each (varints).
        self._ids_bytes = SMALL_REQUEST_BYTES + 10 * edge.scheduler.stats.num_blocks

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        r, small = self._edge.rpcs, SMALL_REQUEST_BYTES
        return {
            "OpenBlockSpace": r.unary("OpenBlockSpace", self.OpenBlockSpace, message(pb.OpenBlockSpaceRequest, small)),
            "CloseBlockSpace": r.unary(
                "CloseBlockSpace", self.CloseBlockSpace, message(pb.CloseBlockSpaceRequest, small)
            ),
            "RenewBlockSpace": r.unary(
                "RenewBlockSpace", self.RenewBlockSpace, message(pb.RenewBlockSpaceRequest, small)
            ),
            "ListBlockSpaces": r.unary(
                "ListBlockSpaces", self.ListBlockSpaces, message(pb.ListBlockSpacesRequest, small)
            ),
            "GrantBlocks": r.unary("GrantBlocks", self.GrantBlocks, message(pb.GrantBlocksRequest, self._ids_bytes)),
            "CopyBlocks": r.unary("CopyBlocks", self.CopyBlocks, message(pb.CopyBlocksRequest, 2 * self._ids_bytes)),
        }

    def _lease(self, space: SpaceState) -> float:
        return lease(space.lease_s, self._idle_timeout_s)

    async def OpenBlockSpace(  # noqa: N802
        self, request: pb.OpenBlockSpaceRequest, context: Context, tenant: Tenant
    ) -> pb.OpenBlockSpaceResponse:
        num_blocks, planes, lease_s, name = request.num_blocks, list(request.layer_planes), request.lease_s, tenant.name

        def open_space(e: Engine) -> tuple[pb.OpenBlockSpaceResponse, EngineStats]:
            space = e.open_space(num_blocks, planes, tenant=name, lease_s=lease_s)
            return pb.OpenBlockSpaceResponse(
                space_id=space.space_id,
                num_blocks=space.num_blocks,
                block_size=e.block_size,
                num_planes=space.num_planes,
                pool_blocks=int(space.blocks.size),
                lease_s=self._lease(space),
            ), e.stats()

        response: pb.OpenBlockSpaceResponse
        response, stats = await self._run("OpenBlockSpace", open_space)
        self._edge.metrics.spaces_opened.inc()
        self._observe_pool(stats)
        self._edge.deadline.set()  # its lease: a new deadline
        return response

    async def CloseBlockSpace(  # noqa: N802
        self, request: pb.CloseBlockSpaceRequest, context: Context, tenant: Tenant
    ) -> pb.CloseBlockSpaceResponse:
        space_id, name = request.space_id, tenant.name
        freed, stats = await self._run("CloseBlockSpace", lambda e: (e.close_space(space_id, tenant=name), e.stats()))
        self._observe_pool(stats)
        return pb.CloseBlockSpaceResponse(pool_blocks=freed)

    async def RenewBlockSpace(  # noqa: N802
        self, request: pb.RenewBlockSpaceRequest, context: Context, tenant: Tenant
    ) -> pb.RenewBlockSpaceResponse:
        space_id, name = request.space_id, tenant.name
        space: SpaceState = await self._run("RenewBlockSpace", lambda e: e.renew_space(space_id, tenant=name))
        return pb.RenewBlockSpaceResponse(lease_s=self._lease(space))

    async def ListBlockSpaces(  # noqa: N802
        self, request: pb.ListBlockSpacesRequest, context: Context, tenant: Tenant
    ) -> pb.ListBlockSpacesResponse:
        name = tenant.name

        def listed(e: Engine) -> pb.ListBlockSpacesResponse:
            now = time.monotonic()
            return pb.ListBlockSpacesResponse(
                spaces=[
                    pb.BlockSpaceInfo(
                        space_id=s.space_id,
                        num_blocks=s.num_blocks,
                        num_planes=s.num_planes,
                        pool_blocks=int(s.blocks.size),
                        lease_s=self._lease(s),
                        idle_s=now - s.last_used,
                        age_s=now - s.opened,
                    )
                    for s in e.spaces_of(tenant=name)
                ]
            )

        response: pb.ListBlockSpacesResponse = await self._run("ListBlockSpaces", listed)
        return response

    async def GrantBlocks(  # noqa: N802
        self, request: pb.GrantBlocksRequest, context: Context, tenant: Tenant
    ) -> pb.GrantBlocksResponse:
        if request.target:
            return await self._push(request, context, tenant)
        ask, name = grant_ask(request), tenant.name

        def grant(e: Engine) -> tuple[Handoff, EngineStats]:
            return e.grant_blocks(ask, tenant=name), e.stats()

        try:
            done = await self._handoff("grant", grant)
        finally:  # the grant's ttl, a new deadline, even when the call was cancelled while the grant was made
            self._edge.deadline.set()
        return pb.GrantBlocksResponse(
            blocks=done.blocks, pool_blocks=done.pool_blocks, bytes=done.bytes, ttl_s=ask.ttl_s or DEFAULT_TTL_S
        )

    async def _push(self, request: pb.GrantBlocksRequest, context: Context, tenant: Tenant) -> pb.GrantBlocksResponse:
        """GrantBlocks with a target (KVService.push_grant), counted as a grant whose bytes went over the
        network."""
        m = self._edge.metrics
        remaining = context.time_remaining()
        r, timeout = request, DEFAULT_TRANSFER_TIMEOUT_S if remaining is None else max(0.0, remaining)
        try:
            pushed = await self._push_grant(
                r.target, r.target_token, grant_ask(r), whole=r.whole, timeout=timeout, tenant=tenant
            )
        except BaseException as e:
            m.handoffs.labels("grant", outcome_code(e).name).inc()
            raise
        m.handoffs.labels("grant", "OK").inc()
        m.handoff_blocks.labels("grant").inc(pushed.parked.blocks)
        m.handoff_bytes.labels("grant", "network").inc(pushed.network_bytes)
        return pb.GrantBlocksResponse(
            blocks=pushed.parked.blocks,
            pool_blocks=pushed.parked.pool_blocks,
            bytes=pushed.parked.bytes,
            ttl_s=request.ttl_s or DEFAULT_TTL_S,
            records=pushed.records,
            network_bytes=pushed.network_bytes,
        )

    async def CopyBlocks(  # noqa: N802
        self, request: pb.CopyBlocksRequest, context: Context, tenant: Tenant
    ) -> pb.CopyBlocksResponse:
        r, name = request, tenant.name
        source = r.WhichOneof("source")
        if source is None:
            raise InvalidArgument("CopyBlocks needs a source: space_id (one of your spaces) or grant_id (a grant)")

        def copy(e: Engine) -> tuple[Handoff, EngineStats]:
            done = e.copy_blocks(
                r.dest_space_id,
                r.dest_block_ids,
                r.source_block_ids,
                space_id=r.space_id,
                grant_id=r.grant_id if source == "grant_id" else None,  # an empty name is still a grant's
                expect_tag=r.expect_tag,
                tenant=name,
            )
            return done, e.stats()

        done = await self._handoff("take" if source == "grant_id" else "copy", copy)
        return pb.CopyBlocksResponse(blocks=done.blocks, bytes=done.bytes, num_tokens=done.num_tokens)

    async def _handoff(self, op: str, job: Callable[[Engine], tuple[Handoff, EngineStats]]) -> Handoff:
        """Run a handoff's engine job, counted (chunkattn_handoffs_total and its blocks and bytes) and the
        pool gauges set after."""
        m = self._edge.metrics
        try:
            done, stats = await self._run("GrantBlocks" if op == "grant" else "CopyBlocks", job)
        except BaseException as e:
            m.handoffs.labels(op, outcome_code(e).name).inc()
            raise
        m.handoffs.labels(op, "OK").inc()
        m.handoff_blocks.labels(op).inc(done.blocks)
        m.handoff_bytes.labels(op, "local").inc(done.bytes)
        self._observe_pool(stats)
        return done
