"""Drives a server as a model runner would (Bench: the phases, the closed and open loops, each sequence's
calls over unary Attend or an AttendStream), recording every call in a Recorder.

Closed loop (``concurrency`` N): N workers, each running one sequence after another. Open loop (``rate``
R): sequences arrive as a Poisson process of R per second, at most ``max_concurrency`` in flight. Each
sequence is its own server sequence id; its last call carries end_of_sequence, so a finished sequence
holds no KV. A sequence whose call fails is released (best effort) and recorded; the run goes on, and
stops early once ``max_errors`` calls have failed.

A duration-bounded run starts no sequence after the deadline and cuts the ones in flight before their
next call (they are released and counted as cut). Its window runs to the later of the deadline and the
last answer, so it overshoots the duration by at most one call per sequence, and those calls are
counted. A run of a given number of sequences runs them all to the end. Latencies leave out --verify's
reference computation; in the open loop a sequence's latency counts from its arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy.typing as npt

from chunkattn_client._stream import AsyncPlaneStream
from chunkattn_client.aio import AsyncAttendStream, AsyncChunkAttnClient, AsyncStream
from chunkattn_client.batch import BatchEntry
from chunkattn_client.bench import promtext
from chunkattn_client.bench.config import BenchConfig as BenchConfig  # "as": still importable from here
from chunkattn_client.bench.recorder import Progress
from chunkattn_client.bench.recorder import Recorder as Recorder
from chunkattn_client.bench.recorder import RunResult as RunResult
from chunkattn_client.bench.servermetrics import MetricsWatch
from chunkattn_client.bench.verify import Verifier as Verifier
from chunkattn_client.bench.workload import (
    LengthSource,
    RandomTensors,
    SequenceSpec,
    Speculation,
    Step,
    WorkloadError,
    call_bytes,
    choose_layers,
    steps,
)
from chunkattn_client.client import ChunkAttnError, ServerInfo
from chunkattn_client.split import message_limit, tokens_per_call


class Bench:
    """One run against one server: an optional warm-up phase, then the measured phase."""

    def __init__(self, config: BenchConfig, client: AsyncChunkAttnClient, info: ServerInfo) -> None:
        config.check()
        self.config, self.client, self.info = config, client, info
        self.layers = choose_layers(info, config.layers)
        self._lengths = LengthSource(config.prompt, config.output, config.trace, config.seed)
        if config.dtype not in info.dtypes:
            raise WorkloadError(f"--dtype {config.dtype}: the server takes {', '.join(info.dtypes)}")
        self._prepare()
        self._run_id = uuid.uuid4().hex[:8]
        self._arrivals = random.Random(config.seed + 1)
        self._seq_no = 0
        self._stop_at: float | None = None
        self._max_sequences: int | None = None
        self._started = 0
        self._aborted: str | None = None
        self.interrupted = False
        self._rec = Recorder()
        self._checking: Verifier | None = None

    def _prepare(self) -> None:
        """The workload's own checks and state (here: one model runner per sequence)."""
        config, info, client = self.config, self.info, self.client
        biggest = min(config.prefill_chunk or self._lengths.max_prompt, self._lengths.max_prompt)
        biggest = max(biggest, config.spec_tokens + 1)  # a verify call's tokens
        self._speculation = Speculation(config.spec_tokens, config.accept_rate) if config.spec_tokens else None
        self._drafts = random.Random(config.seed + 2)
        chunked = [i for i in self.layers if info.layers[i].chunk_size]
        if config.spec_tokens > info.spec_window and chunked:
            raise WorkloadError(
                f"--spec-tokens {config.spec_tokens}: a verify call may roll back {config.spec_tokens} tokens, and the"
                f" server keeps {info.spec_window} before a chunked layer's current chunk, so a verify call across"
                f" a chunk boundary could not be truncated: start it with --spec-window {config.spec_tokens} or more"
            )
        per_token, _ = call_bytes(info, config.dtype, 1, writes_kv=True)
        limit = message_limit(info.max_message_bytes, client.max_message_bytes)
        if tokens_per_call(per_token, limit) < biggest:
            raise WorkloadError(
                f"a {biggest}-token call carries {biggest * per_token} bytes of tensors, over the message limit of"
                f" {limit}"
                f" (server {info.max_message_bytes}, client {client.max_message_bytes}); pass a smaller"
                " --prefill-chunk"
            )
        self._data = RandomTensors(info, config.dtype, biggest, config.seed)
        self._verifier = (
            Verifier(info, config.dtype, config.verify, config.seed, client.info) if config.verify else None
        )

    async def run(self, progress: Progress | None = None, progress_interval_s: float = 1.0) -> RunResult:
        """The run: the warm-up, then the measured phase (and the server's metrics around it)."""
        try:
            await self._open()
            return await self._run(progress, progress_interval_s)
        finally:
            await self._close()  # whatever _open took, also when it failed part way

    async def _open(self) -> None:
        """What the workload holds on the server for the whole run (nothing here: each sequence is its own)."""

    async def _close(self) -> None:
        """Give back what ``_open`` took."""

    async def _run(self, progress: Progress | None, progress_interval_s: float) -> RunResult:
        cfg = self.config
        watch = MetricsWatch(cfg.metrics_url) if cfg.metrics_url else None
        if watch:
            await watch.scrape()  # a wrong URL fails here (MetricsError), before any load
        if cfg.warmup_s:
            await self._phase(Recorder(), cfg.warmup_s, None, None)
        if watch:
            watch.before = await watch.scrape()
        rec = Recorder()
        tasks = [asyncio.create_task(watch.watch(rec))] if watch else []
        if progress:
            tasks.append(asyncio.create_task(_every(progress_interval_s, lambda: progress(rec, False))))
        try:
            await self._phase(rec, cfg.duration_s, cfg.max_sequences(), self._verifier)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # The window: to the last answer (clean-up of cut sequences is not load), and at least to the deadline
        # of a timed run that was not stopped early.
        window = min(rec.now(), cfg.duration_s) if cfg.duration_s else 0.0
        rec.end = max(rec.last_answer, window, 1e-9)
        server = None
        if watch:
            try:
                watch.after = await watch.scrape()
                server = watch.summary()
            except promtext.MetricsError as e:
                server = {"error": str(e)}
        if progress:
            progress(rec, True)
        return RunResult(
            cfg,
            self.info,
            self.layers,
            rec,
            self._verifier.result() if self._verifier else None,
            server,
            watch.series if watch else [],
            self._aborted,
            self.layout(),
        )

    def layout(self) -> dict[str, Any] | None:
        """What the workload's engines were, for the report (none here)."""
        return None

    def stop(self, reason: str) -> None:
        """End the run early (e.g. on Ctrl-C): no new sequences; those in flight are cut before their next call."""
        self.interrupted = True
        self._aborted = self._aborted or reason

    # -- one phase ---------------------------------------------------------------------------------

    async def _phase(
        self,
        rec: Recorder,
        duration_s: float | None,
        max_sequences: int | None,
        verifier: Verifier | None,
    ) -> None:
        self._rec = rec
        self._stop_at = None if duration_s is None else time.perf_counter() + duration_s
        self._max_sequences, self._started = max_sequences, 0
        self._checking = verifier  # none in the warm-up
        async with asyncio.TaskGroup() as tasks:
            if self.config.rate is None:
                for _ in range(self.config.concurrency):
                    tasks.create_task(self._worker())
            else:
                await self._arrive(self.config.rate, tasks)

    def _may_start(self) -> bool:
        if self._cut():
            return False
        return self._max_sequences is None or self._started < self._max_sequences

    def _cut(self) -> bool:
        return bool(self._aborted) or (self._stop_at is not None and time.perf_counter() >= self._stop_at)

    async def _worker(self) -> None:
        while self._may_start():
            self._started += 1
            await self._sequence(self._lengths.next(), time.perf_counter())

    async def _arrive(self, rate: float, tasks: asyncio.TaskGroup) -> None:
        """Poisson arrivals; a sequence that finds no free slot waits, and its latency counts from arrival."""
        slots = asyncio.Semaphore(self.config.max_concurrency)
        due = time.perf_counter()

        async def one(spec: SequenceSpec, arrived: float) -> None:
            await slots.acquire()
            try:
                self._rec.arrival_wait.append(time.perf_counter() - arrived)
                if self._cut():  # the run ended while it waited: it never reached the server
                    self._rec.sequences_cut += 1
                    return
                await self._sequence(spec, arrived)
            finally:
                slots.release()

        while True:
            due += self._arrivals.expovariate(rate)
            while (wait := due - time.perf_counter()) > 0 and self._may_start():
                await asyncio.sleep(min(wait, 0.05))  # wake at the deadline, not at an arrival past it
            if not self._may_start():
                break
            self._started += 1
            tasks.create_task(one(self._lengths.next(), due))

    # -- one sequence ------------------------------------------------------------------------------

    async def _sequence(self, spec: SequenceSpec, arrived: float) -> None:
        rec = self._rec
        self._seq_no += 1
        seq_id = f"bench-{self._run_id}-{self._seq_no}"
        # Behind Envoy, each sequence's calls reach the replica that holds its KV; sequences spread.
        client = self.client.with_route(seq_id if self.config.route is None else self.config.route)
        plan = steps(spec, self.config.prefill_chunk, self._speculation, self._drafts)
        check = self._checking.sample(len(plan) * len(self.layers)) if self._checking else None
        stream = client.stream() if self.config.transport == "stream" else None
        verifying = 0.0  # seconds spent on the reference, left out of every latency
        finished = False  # the last call (end_of_sequence) was answered: nothing is left on the server
        failed = False
        rec.in_flight += 1
        rec.max_in_flight = max(rec.max_in_flight, rec.in_flight)
        try:
            for i, step in enumerate(plan):
                t = time.perf_counter()
                answered = []
                for j, layer in enumerate(self.layers):
                    if self._cut():
                        rec.sequences_cut += 1
                        return
                    last = i == len(plan) - 1 and j == len(self.layers) - 1
                    answered.append(await self._call(client, stream, layer, seq_id, step, last))
                truncated = step.keep is not None and i < len(plan) - 1  # the last step ends the sequence
                if truncated:
                    await self._truncate(client, seq_id, step)
                rec.steps.append((rec.now(), step.kind, step.tokens, time.perf_counter() - t))
                rec.tokens[step.kind] += step.tokens
                if step.keep is not None:
                    rec.drafts += step.num_tokens - 1
                    rec.accepted += step.keep - 1
                if check is not None:
                    t = time.perf_counter()
                    for call in answered:
                        await check.check(*call)
                    if truncated:
                        check.truncate(seq_id, step.position + step.tokens)
                    verifying += time.perf_counter() - t
            finished = True
            rec.sequences += 1
            rec.sequence_latency.append(time.perf_counter() - arrived - verifying)
        except ChunkAttnError as e:
            failed = True
            rec.sequences_failed += 1
            rec.error(e.code.name, e.message)
            if sum(rec.errors.values()) >= self.config.max_errors and not self._aborted:
                self._aborted = f"stopped after {self.config.max_errors} failed calls (--max-errors)"
        finally:
            rec.in_flight -= 1
            if check is not None:
                check.finish()
            if stream is not None:
                await _close(stream, failed)
            if not finished:
                await self._release(client, seq_id)
            await client.close()  # its data-plane socket (the channel is the bench's)

    async def _call(
        self,
        client: AsyncChunkAttnClient,
        stream: Stream | None,
        layer: int,
        seq_id: str,
        step: Step,
        last: bool,
    ) -> tuple[int, BatchEntry, Any, Any, Any, Any]:
        """One layer's call for one step; returns what --verify needs: (layer, entry, q, k, v, output)."""
        writes = self.info.layers[layer].kv_source is None
        n = step.num_tokens
        q = self._data.take(n, self.info.num_heads)
        k = self._data.take(n, self.info.num_kv_heads) if writes else None
        v = self._data.take(n, self.info.num_kv_heads) if writes else None
        entry = BatchEntry(seq_id, step.position, n)
        kw: dict[str, Any] = {"end_of_sequence": [seq_id] if last else (), "dtype": self.config.dtype}
        call: Awaitable[npt.NDArray[Any]]
        if stream is None:
            call = client.attend(layer, [entry], q, k, v, **kw)  # the client's deadline: --timeout
        else:
            call = asyncio.wait_for(stream.attend(layer, [entry], q, k, v, **kw), self.config.timeout_s)
        try:
            out = await call
        except TimeoutError:
            raise ChunkAttnError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on the stream within {self.config.timeout_s} s"
            ) from None
        rec = self._rec
        rec.last_answer = rec.now()
        rec.calls += 1
        rec.layer_tokens["decode" if n == 1 else "prefill"] += n
        sent, received = call_bytes(self.info, self.config.dtype, n, writes)
        rec.bytes_sent += sent
        rec.bytes_received += received
        return layer, entry, q, k, v, out

    async def _truncate(self, client: AsyncChunkAttnClient, seq_id: str, step: Step) -> None:
        """Drop a verify step's rejected drafts (Truncate: part of the step's latency)."""
        await client.truncate(seq_id, step.position + step.tokens)
        rec = self._rec
        rec.last_answer = rec.now()
        rec.truncations += 1

    async def _release(self, client: AsyncChunkAttnClient, seq_id: str) -> None:
        """Free a sequence that did not finish (best effort, short deadline); a failure is counted apart."""
        try:
            await asyncio.wait_for(client.release([seq_id], missing_ok=True), min(self.config.timeout_s, 5.0))
        except ChunkAttnError as e:
            self._rec.release_errors[e.code.name] += 1
        except TimeoutError:
            self._rec.release_errors[grpc.StatusCode.DEADLINE_EXCEEDED.name] += 1


Stream = AsyncAttendStream | AsyncPlaneStream | AsyncStream  # over gRPC, over the data plane, not chosen yet


async def _close(stream: Stream, failed: bool) -> None:
    """End a sequence's stream: cancelled after a failure (it may be stuck), else closed, or cancelled
    when that takes over 5 s."""
    if failed:
        stream.cancel()
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stream.close(), 5.0)
        return
    stream.cancel()


async def _every(interval_s: float, fn: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        fn()
