"""The engine worker: the one thread that owns the engine and its device.

The asyncio event loop never runs tensor math: it hands each job to this thread and awaits the result.
Jobs run one at a time, in arrival order; the caller can learn how long each waited and ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import TypeVar

from chunkattn_server.engine import Engine, EngineStats

T = TypeVar("T")


class EngineWorker:
    """Runs jobs ``fn(engine)`` on a single thread. ``stop()`` lets queued jobs finish first.

    The engine is built on that thread too, so exactly one thread ever runs torch's parallel CPU kernels:
    when the main thread had built it (and so started an OpenMP team of its own), each call on the
    worker thread ran about 2x slower on the 2-core dev machines.
    """

    def __init__(self, build: Callable[[], Engine]) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkattn-engine")
        try:
            self.engine = self._pool.submit(build).result()
        except BaseException:
            self._pool.shutdown(wait=False)
            raise
        # The pool and sequences after the last job, for readers that must not queue behind the jobs (Info):
        # replaced whole by the worker thread, so a reader sees one job's state or the next one's.
        self.stats: EngineStats = self.engine.stats()

    async def run(self, fn: Callable[[Engine], T], observe: Callable[[float, float], None] | None = None) -> T:
        """Run fn(engine) on the worker thread and return (or raise) what it does.

        ``observe(queue_s, compute_s)`` is called either way with the seconds the job waited and ran.
        """
        submitted = time.perf_counter()
        started: list[float] = []

        def job() -> T:
            started.append(time.perf_counter())
            try:
                return fn(self.engine)
            finally:
                self.stats = self.engine.stats()

        try:
            return await asyncio.wrap_future(self._pool.submit(job))
        finally:
            if observe is not None and started:
                observe(started[0] - submitted, time.perf_counter() - started[0])

    def stop(self) -> None:
        self._pool.shutdown(wait=True)
