"""The service, wired: the one place that builds the chunkattn.v1.ChunkAttn service from its APIs' handler
modules (info.py, attend.py, sequences.py, transfer.py, blocks.py, dataplane.py), all through the one RPC
scaffolding (rpc.py), and registers every handler with gRPC; and the data plane (dataplane.py, its sessions in
sessions.py), which serves Attend through the same scaffolding. server.py builds the rest of the server around
it."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_server.config import ServerConfig
from chunkattn_server.engine.scheduler import Scheduler
from chunkattn_server.metrics import Metrics
from chunkattn_server.service.attend import AttendService
from chunkattn_server.service.auth import Authenticator, Tenant
from chunkattn_server.service.blocks import BlockService
from chunkattn_server.service.dataplane import DataPlane, DataPlaneService
from chunkattn_server.service.edge import Edge
from chunkattn_server.service.info import InfoService
from chunkattn_server.service.rpc import Admission, Rpcs
from chunkattn_server.service.sequences import SequenceService
from chunkattn_server.service.sessions import Sessions
from chunkattn_server.service.transfer import KVService

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ChunkAttn"].full_name


class API(Protocol):
    """One API's handler module: its RPCs' gRPC handlers, by method name (built with rpc.Rpcs)."""

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]: ...


class ChunkAttnService:
    """Every RPC of chunkattn.v1.ChunkAttn over one scheduler: the handlers of each API, their admission
    (--max-concurrent-rpcs, --max-inflight-mib, the tenants' quotas) and their counts."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, config: ServerConfig, auth: Authenticator) -> None:
        self._metrics = metrics
        self._auth = auth
        self._rpcs = Rpcs(self._count, Admission(config.max_concurrent_rpcs, config.inflight_bytes), auth)
        edge = self._edge = Edge(scheduler, self._rpcs, metrics, config)
        self._kv = KVService(edge)
        self._blocks = BlockService(edge, self._kv.push_grant)
        attend = AttendService(edge)
        self.sessions = Sessions(config.data_plane_session_s)
        self.data_plane = (
            DataPlane(config, self._rpcs, self.sessions, attend.data_plane_answer, curve=config.tls_cert is not None)
            if config.data_plane
            else None
        )
        self._apis: tuple[API, ...] = (
            InfoService(edge),
            attend,
            SequenceService(edge),
            self._kv,
            self._blocks,
            DataPlaneService(edge, self.data_plane),
        )
        metrics.kv_blocks_total.set(scheduler.stats.num_blocks)
        metrics.data_plane_sessions.set_function(self.sessions.live)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register every RPC of chunkattn.v1.ChunkAttn."""
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for api in self._apis:
            handlers.update(api.handlers())
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

    @property
    def spaces_opened(self) -> asyncio.Event:
        """Set whenever a block space or a grant opens (a new deadline for the idle sweep: Edge.deadline)."""
        return self._edge.deadline

    def drain(self) -> None:
        """From now on, new calls are refused, open streams end before their next request and data-plane messages
        are answered UNAVAILABLE."""
        self._rpcs.draining = True

    def recheck_sessions(self) -> int:
        """After the token file was reloaded: data-plane sessions whose credentials no longer name their tenant
        end (revoked), the others take their tenant's new quotas. Returns how many ended."""
        return self.sessions.recheck(self._auth.tenant_by) if self._auth.enabled else 0

    def open_calls(self) -> int:
        """Calls open in the service now (idle streams included; health and reflection are not its)."""
        return sum(self._rpcs.open_calls.values())

    async def close(self) -> None:
        """Release what the service holds besides the engine (after the server stopped)."""
        self._rpcs.close()
        await self._kv.close()

    def _count(
        self, rpc: str, code: grpc.StatusCode, seconds: float | None, tenant: Tenant | None, transport: str = "grpc"
    ) -> None:
        """rpc.Count: every answer by RPC, status and transport, its time, and by tenant when there are tenants."""
        m = self._metrics
        m.of(m.requests, rpc, code.name, transport).inc()
        if seconds is not None:
            m.of(m.rpc_seconds, rpc, transport).observe(seconds)
        if tenant is not None and self._auth.enabled:
            m.of(m.tenant_requests, tenant.name, rpc, code.name).inc()
