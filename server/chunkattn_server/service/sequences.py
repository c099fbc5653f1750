"""The sequence API's KV handlers: Release, Fork and Truncate (each one engine job through the door the
Engine's control plane gives). Attend is attend.py's; moving a sequence's KV (ExportKV, ImportKV, TransferKV)
is transfer.py's."""

from __future__ import annotations

from typing import Any

import grpc

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_client.limits import MAX_BATCH, MAX_ID_BYTES
from chunkattn_server.service.auth import Tenant
from chunkattn_server.service.edge import Edge
from chunkattn_server.service.rpc import SMALL_REQUEST_BYTES, Context, message

# A ReleaseRequest of MAX_BATCH ids of MAX_ID_BYTES, with room for their keys and lengths, and its fields:
# the ids and missing_ok, with room to spare (a field may come more than once).
MAX_RELEASE_BYTES = MAX_BATCH * (MAX_ID_BYTES + 4) + 64
MAX_RELEASE_FIELDS = MAX_BATCH + 16


class SequenceService:
    """Release, Fork and Truncate of the caller's tenant's sequences."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        r, small = self._edge.rpcs, SMALL_REQUEST_BYTES  # a few ids
        return {
            "Release": r.unary(
                "Release", self.Release, message(pb.ReleaseRequest, MAX_RELEASE_BYTES, MAX_RELEASE_FIELDS)
            ),
            "Fork": r.unary("Fork", self.Fork, message(pb.ForkRequest, small)),
            "Truncate": r.unary("Truncate", self.Truncate, message(pb.TruncateRequest, small)),
        }

    async def Release(self, request: pb.ReleaseRequest, context: Context, tenant: Tenant) -> pb.ReleaseResponse:  # noqa: N802
        ids, missing_ok, name = request.seq_ids, request.missing_ok, tenant.name
        released, stats = await self._edge.run(
            "Release", lambda e: (e.release(ids, missing_ok=missing_ok, tenant=name), e.stats())
        )
        self._edge.metrics.released.inc(released)
        self._edge.observe_pool(stats)
        return pb.ReleaseResponse(released=released)

    async def Fork(self, request: pb.ForkRequest, context: Context, tenant: Tenant) -> pb.ForkResponse:  # noqa: N802
        parent, child, name = request.parent, request.child, tenant.name
        shared, stats = await self._edge.run("Fork", lambda e: (e.fork(parent, child, tenant=name), e.stats()))
        self._edge.metrics.forked.inc()
        self._edge.observe_pool(stats)
        return pb.ForkResponse(shared_blocks=shared)

    async def Truncate(self, request: pb.TruncateRequest, context: Context, tenant: Tenant) -> pb.TruncateResponse:  # noqa: N802
        seq_id, length, name = request.seq_id, request.length, tenant.name
        done, stats = await self._edge.run("Truncate", lambda e: (e.truncate(seq_id, length, tenant=name), e.stats()))
        self._edge.metrics.truncated.inc()
        self._edge.metrics.truncated_tokens.inc(done.dropped_tokens)
        self._edge.observe_pool(stats)
        return pb.TruncateResponse(released_blocks=done.released_blocks, min_length=done.min_length)
