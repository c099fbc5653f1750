"""Info: what the server serves (the model's shape, the cache, the limits a client must know) and the pool as
of the last engine step, answered without queueing behind the engine's jobs."""

from __future__ import annotations

from typing import Any

import grpc

from chunkattn_client import dtypes
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from chunkattn_server import __version__, torchtypes
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.serve import Scales
from chunkattn_server.engine.types import EngineStats
from chunkattn_server.service.auth import Tenant
from chunkattn_server.service.edge import Edge
from chunkattn_server.service.rpc import Context, message

# An InfoRequest has no fields: no valid one comes near this.
MAX_INFO_REQUEST_BYTES = 1024


class InfoService:
    """The Info RPC. Its fixed part is built once; the pool, the caller's sequences and spaces, and (while a
    float8 layer calibrates) the layers' KV scales come from what the scheduler published after its last step."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        scheduler = edge.scheduler
        self._info = _static_info(scheduler.engine, edge.config.max_message_bytes, scheduler.stats)
        _set_scales(self._info, scheduler.kv_scales)
        self._calibrating = None in scheduler.kv_scales  # a float8 layer's scales are set by its first write

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        """Info is never admitted (rpc.Admission): it holds nothing, and a full server still answers it."""
        parse = message(pb.InfoRequest, MAX_INFO_REQUEST_BYTES)
        return {"Info": self._edge.rpcs.unary("Info", self.Info, parse, admit=False)}

    async def Info(self, request: pb.InfoRequest, context: Context, tenant: Tenant) -> pb.InfoResponse:  # noqa: N802
        """Never queued behind the engine's jobs: the pool as of the last one that finished. The pool's
        totals, and the caller's own sequences only."""
        scheduler = self._edge.scheduler
        stats = scheduler.stats
        self._edge.observe_pool(stats)
        response = pb.InfoResponse()
        response.CopyFrom(self._info)
        response.free_blocks = stats.free_blocks
        response.active_sequences = stats.sequences_by_tenant.get(tenant.name, 0)
        response.block_spaces = stats.spaces_by_tenant.get(tenant.name, 0)
        if self._calibrating:  # as of now
            _set_scales(response, scheduler.kv_scales)
        return response


def _set_scales(info: pb.InfoResponse, scales: Scales) -> None:
    """Each layer's (k_scale, v_scale) in ``info``: ``scales``' (0 while a layer calibrates)."""
    for layer in info.layers:
        layer.k_scale, layer.v_scale = scales[layer.index] or (0.0, 0.0)


def _static_info(engine: Engine, max_message_bytes: int, stats: EngineStats | None = None) -> pb.InfoResponse:
    """What Info says that never changes (the layers' KV scales left 0: _set_scales); the pool's size from
    ``stats`` (None: the engine's own, where no step can run meanwhile)."""
    model = engine.config.model
    group_of = {layer: g.index for g in engine.config.kv_groups for layer in (*g.layers, *g.sharers)}
    stats = engine.stats() if stats is None else stats
    return pb.InfoResponse(
        version=__version__,
        backend=engine.backend.name,
        device=str(engine.device),
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        layers=[
            pb.LayerInfo(
                index=i,
                chunk_size=spec.chunk_size,
                kv_group=group_of[i],
                kv_source=spec.kv_source,
                scale=engine.scale(i),
                alibi=spec.alibi_slopes is not None,
                alibi_slopes=spec.alibi_slopes or (),
            )
            for i, spec in enumerate(model.layers)
        ],
        block_size=stats.block_size,
        num_blocks=stats.num_blocks,
        bytes_per_block=stats.bytes_per_block,
        cache_dtype=torchtypes.OF_TORCH[engine.cache_dtype].wire,  # type: ignore[arg-type]
        compute_dtype=torchtypes.OF_TORCH[engine.dtype].wire,  # type: ignore[arg-type]
        dtypes=[d.wire for d in dtypes.WIRE],  # type: ignore[misc]
        max_message_bytes=max_message_bytes,
        max_call_work=engine.max_call_work,
        spec_window=engine.config.cache.spec_window,
        planes_per_block=engine.config.group_size,
    )
