"""What every API's handlers share: the scheduler (their one way to the engine: each engine job runs through
it, on the engine's thread), the RPC scaffolding, the metrics, the server's configuration, and the event that
tells the idle sweep (server.py) of a new deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from chunkattn_server.config import ServerConfig
from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.scheduler import Scheduler
from chunkattn_server.engine.types import EngineStats
from chunkattn_server.metrics import Metrics
from chunkattn_server.service.rpc import Rpcs

T = TypeVar("T")


@dataclass(frozen=True)
class Edge:
    """The service's parts that every handler module takes (service/app.py builds it once). ``deadline`` is set
    whenever something opens that the sweep must end in time: a block space with a lease, a grant (its ttl)."""

    scheduler: Scheduler
    rpcs: Rpcs
    metrics: Metrics
    config: ServerConfig
    deadline: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, rpc: str, fn: Callable[[Engine], T]) -> T:
        """``fn(engine)`` as a control job (Scheduler.run), counted in flight; what it returns or raises."""
        with self.metrics.in_flight.track_inprogress():
            return await self.scheduler.run(rpc, fn)

    def observe_pool(self, stats: EngineStats) -> None:
        """The KV-in-use and active-sequence gauges, from the pool as a job left it."""
        self.metrics.observe_pool(stats)
