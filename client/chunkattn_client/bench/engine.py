"""The engine workload: ``--engines`` simulated serving engines, each scheduling its requests as vLLM does and
sending one call per layer per step that carries every request it scheduled (docs/bench.md, "The engine
workload").

Each engine is a vLLM instance as the attention tier sees it: its own routing key and, with the block API
(``--api blocks``, as the vLLM plugin does), its own block space, laid out and managed as vLLM's KV cache manager
would (``kvblocks``), its steps decided by vLLM's scheduling (``scheduler``: a token budget, chunked prefill,
max_num_seqs, preemption), and each layer's rows cut into calls by the plugin's own code (``split.block_calls``).
With ``--api sequence`` the same steps go as sequence entries (the server keeps the KV and its blocks).

Requests come closed-loop (``--concurrency`` per engine in the system at once) or as a Poisson process
(``--rate`` per engine). ``--model-step-ms`` spreads the model's other work over each step (a pause before each
layer's call, slept once at least 2 ms is owed), so that what users see (time to first token, time per output
token) is an engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from chunkattn_client.aio import AsyncChunkAttnClient
from chunkattn_client.batch import BatchEntry
from chunkattn_client.bench.kvblocks import KVBlocks, LayerRows
from chunkattn_client.bench.recorder import Recorder
from chunkattn_client.bench.runner import Bench, Stream
from chunkattn_client.bench.runner import _close as close_stream
from chunkattn_client.bench.scheduler import Request, Scheduled, Scheduler
from chunkattn_client.bench.verify import EngineCheck, Verifier
from chunkattn_client.bench.workload import LengthSource, RandomTensors, WorkloadError, call_bytes
from chunkattn_client.client import ChunkAttnError
from chunkattn_client.limits import MAX_BLOCK_SPACES
from chunkattn_client.split import block_calls, entry_calls, message_limit, tokens_per_call

LEASE_S = 60.0  # each engine's space: renewed every third of it, gone that long after a bench that was killed


@dataclass(eq=False)
class Engine:
    """One simulated engine: its routed client, its space (block API), its scheduler and its requests."""

    index: int
    client: AsyncChunkAttnClient
    route: str
    blocks: KVBlocks
    space_id: str = ""
    stream: Stream | None = None
    scheduler: Scheduler | None = None
    check: EngineCheck | None = None
    arrivals: random.Random = field(default_factory=random.Random)
    next_arrival: float = 0.0  # open loop: perf_counter time of its next request's arrival
    verify_s: float = 0.0  # seconds its --verify checks took: left out of its clock (``EngineBench._clock``)
    model_owed_s: float = 0.0  # --model-step-ms not yet slept (sleeps are coarse: owed time is slept in lumps)
    lengths: LengthSource | None = None
    renewer: asyncio.Task[None] | None = None


class EngineBench(Bench):
    """One run of the engine workload against one server (or Envoy)."""

    def _prepare(self) -> None:
        config, info = self.config, self.info
        writers = [i for i in self.layers if info.layers[i].kv_source is None]
        if not writers:
            raise WorkloadError("--layers: an engine needs at least one layer that writes KV")
        self._model_step_s = config.model_step_ms / 1000
        per_token, _ = call_bytes(info, config.dtype, 1, writes_kv=True)
        self._per_token = {True: per_token, False: call_bytes(info, config.dtype, 1, writes_kv=False)[0]}
        self._limit = message_limit(info.max_message_bytes, self.client.max_message_bytes)
        if tokens_per_call(per_token + 8, self._limit, fixed=4096) < 1:
            raise WorkloadError(f"one token's tensors ({per_token} bytes) do not fit the message limit {self._limit}")
        self._data = RandomTensors(info, config.dtype, config.max_num_batched_tokens, config.seed)
        self._verifier = (
            Verifier(info, config.dtype, config.verify, config.seed, self.client.info) if config.verify else None
        )
        self._model_blocks = KVBlocks(
            [x.chunk_size for x in info.layers], [x.kv_source for x in info.layers], 2, info.block_size
        )
        outputs = max(s.output_len for s in config.trace) if config.trace else config.output.high
        self._longest = self._lengths.max_prompt + outputs
        self._engines: list[Engine] = []

    def _space_blocks(self) -> int:
        """Each engine's space in blocks: --kv-blocks, else what max_num_seqs (closed loop: at most --concurrency)
        requests of the longest length hold at once, and the null block; within the pool's free blocks."""
        cfg, info = self.config, self.info
        blocks = self._model_blocks
        one = blocks.blocks_for(self._longest, cfg.max_num_batched_tokens * (2 if cfg.async_scheduling else 1))
        running = cfg.max_num_seqs if cfg.rate else min(cfg.max_num_seqs, cfg.concurrency)
        want = cfg.kv_blocks or one * running + 1
        if want - 1 < one:
            raise WorkloadError(
                f"--kv-blocks {want}: one request of {self._longest} tokens takes {one} blocks of {info.block_size}"
                f" tokens (over the model's {len(blocks.groups)} KV cache group(s)), and block 0 is the null block:"
                f" pass --kv-blocks {one + 1} or more"
            )
        planes = max(blocks.planes) + 1
        cost = info.pool_blocks_per_space_block(planes)
        if want * cost * cfg.engines > info.free_blocks:
            if cfg.kv_blocks is None and (info.free_blocks // cost // cfg.engines) - 1 >= one:
                return info.free_blocks // cost // cfg.engines  # fewer running requests than asked: vLLM's preemption
            raise WorkloadError(
                f"{cfg.engines} engine(s) of {want} blocks (each {cost} of the server's, for {planes} plane(s)) need"
                f" {want * cost * cfg.engines} of the server's blocks, and it has {info.free_blocks} free of"
                f" {info.num_blocks}: pass fewer --engines or a smaller --kv-blocks (one request of {self._longest}"
                f" tokens needs {one + 1} with the null block), or start the server with a larger pool"
            )
        return want

    async def _open(self) -> None:
        cfg, info = self.config, self.info
        if cfg.api == "blocks" and cfg.engines + info.block_spaces > MAX_BLOCK_SPACES:
            raise WorkloadError(
                f"--engines {cfg.engines}: your tenant already has {info.block_spaces} block space(s) open on the"
                f" server, which holds at most {MAX_BLOCK_SPACES} per tenant"
            )
        num_blocks = self._space_blocks()
        run = uuid.uuid4().hex[:8]
        chunks, sources = [x.chunk_size for x in info.layers], [x.kv_source for x in info.layers]
        for i in range(cfg.engines):
            route = f"engine-{run}-{i}" if cfg.route is None else cfg.route
            engine = Engine(
                i, self.client.with_route(route), route, KVBlocks(chunks, sources, num_blocks, info.block_size)
            )
            engine.arrivals = random.Random(cfg.seed * 1000 + i)
            # Sampled lengths per engine (its own seed: engine 0 draws what the sequences workload draws with the
            # same --seed); a trace's lines in order over all of them.
            engine.lengths = (
                self._lengths if cfg.trace else LengthSource(cfg.prompt, cfg.output, None, cfg.seed + 7919 * i)
            )
            self._engines.append(engine)
            try:
                if cfg.api == "blocks":
                    await self._open_space(engine, num_blocks)
                if cfg.transport == "stream":
                    engine.stream = engine.client.stream()
            except (ChunkAttnError, WorkloadError) as e:  # the spaces opened so far: Bench.run closes them
                why = e.message if isinstance(e, ChunkAttnError) else str(e)
                raise WorkloadError(f"engine {i} could not open its block space: {why}") from None

    async def _open_space(self, engine: Engine, num_blocks: int) -> None:
        """The engine's space; a refusal for the tenant's opening rate ("retry in N s") waited out, up to a minute;
        one for its block quota said in the bench's words."""
        deadline = time.monotonic() + 60
        while True:
            try:
                space = await engine.client.open_block_space(
                    num_blocks, layer_planes=engine.blocks.planes, lease_s=LEASE_S
                )
                break
            except ChunkAttnError as e:
                wait = _retry_in(e.message) if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if wait is not None and time.monotonic() + wait < deadline and not self._aborted:
                    await asyncio.sleep(wait + 0.05)
                    continue
                if "max_kv_blocks" in e.message:
                    cost = self.info.pool_blocks_per_space_block(max(engine.blocks.planes) + 1)
                    raise WorkloadError(
                        f"{e.message}: each engine's space of {num_blocks} blocks takes {num_blocks * cost} of the"
                        f" server's, {self.config.engines * num_blocks * cost} for --engines {self.config.engines},"
                        " past what your tenant's block quota has left (spaces it already holds count too); pass"
                        " a smaller --kv-blocks or fewer --engines"
                    ) from None
                raise
        engine.space_id = space.space_id
        if space.lease_s:
            engine.renewer = asyncio.create_task(self._renew(engine, space.lease_s / 3))

    def layout(self) -> dict[str, Any] | None:
        """Each engine's KV cache: its blocks (the null block among them), KV cache groups (chunk size and layers,
        as vLLM's hybrid manager makes them) and planes; and the spaces' ids (block API)."""
        if not self._engines:
            return None
        blocks = self._engines[0].blocks
        return {
            "kv_blocks": blocks.num_blocks,
            "groups": [{"chunk_size": g.chunk_size, "layers": list(g.layers)} for g in blocks.groups],
            "planes": max(blocks.planes) + 1,
            "spaces": [e.space_id for e in self._engines if e.space_id],
        }

    async def _renew(self, engine: Engine, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(ChunkAttnError):
                await engine.client.renew_block_space(engine.space_id)

    async def _close(self) -> None:
        """Every engine's stream, lease renewal and space closed at once (a hung server costs one deadline, not one
        per engine)."""
        engines, self._engines = self._engines, []
        await asyncio.gather(*(self._close_engine(engine) for engine in engines))

    async def _close_engine(self, engine: Engine) -> None:
        if engine.stream is not None:
            await close_stream(engine.stream, failed=False)
        if engine.renewer is not None:
            engine.renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await engine.renewer
        if engine.space_id:
            with contextlib.suppress(ChunkAttnError, TimeoutError):
                await asyncio.wait_for(engine.client.close_block_space(engine.space_id), 10)
        await engine.client.close()

    # -- one phase ---------------------------------------------------------------------------------

    async def _phase(
        self, rec: Recorder, duration_s: float | None, max_sequences: int | None, verifier: Verifier | None
    ) -> None:
        cfg = self.config
        self._rec = rec
        self._stop_at = None if duration_s is None else time.perf_counter() + duration_s
        self._max_sequences, self._started = max_sequences, 0
        now = time.perf_counter()
        for engine in self._engines:
            engine.scheduler = Scheduler(
                engine.blocks, cfg.max_num_batched_tokens, cfg.max_num_seqs, async_scheduling=cfg.async_scheduling
            )
            engine.check = EngineCheck(verifier, cfg.api) if verifier else None
            engine.next_arrival = now
        async with asyncio.TaskGroup() as tasks:
            for engine in self._engines:
                tasks.create_task(self._engine(engine))

    def _clock(self, engine: Engine) -> float:
        """The engine's time: seconds since the phase started, less what its --verify checks took."""
        return self._rec.now() - engine.verify_s

    def _admit(self, engine: Engine) -> None:
        """New requests into the engine's queue: closed loop, up to --concurrency in the system; open loop, those
        whose Poisson arrival time has come (their latencies count from it)."""
        sched, cfg, rec = engine.scheduler, self.config, self._rec
        assert sched is not None
        while self._may_start():
            if cfg.rate is None:
                if sched.requests >= cfg.concurrency:
                    return
                arrived = self._clock(engine)
            else:
                if engine.next_arrival > time.perf_counter():
                    return
                arrived = engine.next_arrival - rec.t0 - engine.verify_s
                engine.next_arrival += engine.arrivals.expovariate(cfg.rate)
            self._started += 1
            self._seq_no += 1
            assert engine.lengths is not None
            spec = engine.lengths.next()
            sched.add(Request(self._seq_no, spec.prompt_len, spec.output_len, arrived=arrived))
            rec.in_flight += 1
            rec.max_in_flight = max(rec.max_in_flight, rec.in_flight)

    async def _engine(self, engine: Engine) -> None:
        """The engine's loop: admit, schedule a step, run it; until no request is left to start and none runs,
        or the run is cut (what is in flight then is counted cut)."""
        sched, rec = engine.scheduler, self._rec
        assert sched is not None
        try:
            while True:
                self._admit(engine)
                if self._cut():
                    break
                if sched.idle:
                    if not self._may_start():
                        break
                    await asyncio.sleep(min(max(0.0, engine.next_arrival - time.perf_counter()), 0.05))
                    continue
                step = sched.schedule()
                rec.preemptions += len(sched.preempted)
                await asyncio.gather(*(self._forget(engine, request) for request in sched.preempted))
                if not step:  # KVBlocks sizes a space to hold the longest request: never, unless that is wrong
                    self._aborted = self._aborted or f"engine {engine.index}: no request fits its space"
                    break
                await self._step(engine, step)
        finally:
            sched.drain()  # async scheduling: the finished that still hold their blocks
            left = [*sched.running, *sched.waiting, *sched.arriving]
            rec.sequences_cut += len(left)
            rec.in_flight -= len(left)
            for request in left:
                engine.blocks.free(request)  # the space outlives the phase (a warm-up's requests leave it)
            await asyncio.gather(*(self._forget(engine, request) for request in left))  # at once: one deadline
            sched.running.clear()
            sched.waiting.clear()
            sched.arriving.clear()

    async def _step(self, engine: Engine, step: list[Scheduled]) -> None:
        """One engine step: each layer's call(s), in layer order, after its share of --model-step-ms."""
        sched, rec, cfg = engine.scheduler, self._rec, self.config
        assert sched is not None
        started, verified = time.perf_counter(), engine.verify_s
        attention = 0.0
        entries = [(s.request, s.position, s.num_tokens) for s in step]
        rows_of: dict[int, Any] = {}
        rows = 0
        try:
            for j, layer in enumerate(self.layers):
                if self._model_step_s:
                    await self._model(engine)
                t, v = time.perf_counter(), engine.verify_s
                if cfg.api == "blocks":
                    group = engine.blocks.group_of[layer]
                    if group not in rows_of:
                        rows_of[group] = engine.blocks.rows(group, entries)
                    n = await self._block_layer(engine, layer, rows_of[group])
                else:
                    n = await self._entry_layer(engine, layer, step, last=j == len(self.layers) - 1)
                rows = rows or n
                attention += time.perf_counter() - t - (engine.verify_s - v)
        except ChunkAttnError as e:
            await self._failed(engine, step, e)
            return
        now = self._clock(engine)
        rec.last_answer = rec.now()
        finished = sched.finish(step, now)
        tokens = sum(s.num_tokens for s in step)
        decodes = sum(1 for s in step if s.decode)
        elapsed = time.perf_counter() - started - (engine.verify_s - verified)
        rec.engine_steps.append((rec.now(), engine.index, tokens, rows, decodes, attention, elapsed))
        rec.tokens["decode"] += decodes
        rec.tokens["prefill"] += tokens - decodes
        for request in finished:
            assert request.first_token_at is not None
            rec.sequences += 1
            rec.in_flight -= 1
            rec.sequence_latency.append(now - request.arrived)
            rec.ttft.append(request.first_token_at - request.arrived)
            if request.output_len > 1:
                rec.tpot.append((now - request.first_token_at) / (request.output_len - 1))
            await self._forget(engine, request, ended=True)

    async def _failed(self, engine: Engine, step: list[Scheduled], e: ChunkAttnError) -> None:
        """A call of the step failed: the step's requests fail (a serving engine would fail them), the rest go on;
        their blocks are freed (and, with the sequence API, the server's sequences released)."""
        sched, rec = engine.scheduler, self._rec
        assert sched is not None
        rec.error(e.code.name, e.message)
        if engine.check is not None:
            engine.check.stop()
        if engine.stream is not None:  # a failed call ends its stream: the engine goes on over a new one
            engine.stream.cancel()
            engine.stream = engine.client.stream()
        for s in step:
            if s.request in sched.running:
                sched.running.remove(s.request)
            engine.blocks.free(s.request)
            rec.sequences_failed += 1
            rec.in_flight -= 1
        await asyncio.gather(*(self._forget(engine, s.request) for s in step))  # at once: one deadline
        if sum(rec.errors.values()) >= self.config.max_errors and not self._aborted:
            self._aborted = f"stopped after {self.config.max_errors} failed calls (--max-errors)"

    async def _block_layer(self, engine: Engine, layer: int, rows: LayerRows) -> int:
        """One layer's step over the block API, in as many calls as the message and work limits need (the
        plugin's ``split.block_calls``). Returns its rows."""
        writes = self.info.layers[layer].kv_source is None
        calls = block_calls(
            engine.space_id,
            rows.slots,
            rows.starts,
            rows.seq_lens,
            rows.tables,
            block_size=self.info.block_size,
            per_token=self._per_token[writes],
            limit=self._limit,
            max_work=self.info.max_call_work,
        )
        q, k, v = self._tensors(rows.num_tokens, writes)
        for first, last, block_rows in calls:
            qs, ks, vs = (None if x is None else x[first:last] for x in (q, k, v))
            out = await self._send(engine, "attend_blocks", layer, block_rows, qs, ks, vs)
            self._count(np.diff(np.asarray(block_rows.query_start_loc)).tolist(), writes)
            if engine.check is not None and engine.check.take():
                await self._verify(engine, engine.check.check_blocks(engine.index, layer, block_rows, qs, ks, vs, out))
        return len(rows.seq_lens)

    async def _entry_layer(self, engine: Engine, layer: int, step: list[Scheduled], last: bool) -> int:
        """One layer's step over the sequence API: each scheduled request an entry (the server keeps its KV and
        frees it: the last layer's call of a request's last step ends it). Returns its entries."""
        writes = self.info.layers[layer].kv_source is None
        n = sum(s.num_tokens for s in step)
        q, k, v = self._tensors(n, writes)
        starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in step])])
        budget = max(1, tokens_per_call(self._per_token[writes], self._limit, fixed=len(step) * 320))
        lengths, positions = [s.num_tokens for s in step], [s.position for s in step]
        chunk = self.info.layers[layer].chunk_size
        for call in entry_calls(lengths, budget, positions, chunk, self.info.max_call_work):
            entries = [BatchEntry(self._seq_id(engine, step[r].request), step[r].position + lo, c) for r, lo, c in call]
            ends = [
                e.seq_id
                for e, (r, lo, c) in zip(entries, call, strict=True)
                if last and _ends(step[r]) and lo + c == step[r].num_tokens
            ]
            rows = [slice(int(starts[r]) + lo, int(starts[r]) + lo + c) for r, lo, c in call]
            qs, ks, vs = (None if x is None else np.concatenate([x[r] for r in rows]) for x in (q, k, v))
            out = await self._send(engine, "attend", layer, entries, qs, ks, vs, end_of_sequence=ends)
            self._count([e.num_tokens for e in entries], writes)
            if engine.check is not None and engine.check.take():
                await self._verify(engine, engine.check.check_entries(engine.index, layer, entries, qs, ks, vs, out))
        return len(step)

    def _tensors(self, tokens: int, writes: bool) -> tuple[Any, Any, Any]:
        info, data = self.info, self._data
        q = data.take(tokens, info.num_heads)
        if not writes:
            return q, None, None
        return q, data.take(tokens, info.num_kv_heads), data.take(tokens, info.num_kv_heads)

    async def _send(self, engine: Engine, method: str, *args: Any, **options: Any) -> Any:
        """One call (``attend`` or ``attend_blocks``) on the engine's stream, or unary, each with the client's
        deadline (--timeout); its latency recorded."""
        t = time.perf_counter()
        out = await getattr(engine.stream or engine.client, method)(*args, dtype=self.config.dtype, **options)
        self._rec.layer_latency.append(time.perf_counter() - t)
        return out

    def _count(self, rows: list[int], writes: bool) -> None:
        """An answered call of rows of ``rows`` tokens each: its tokens filed as the server files them (a row of
        one token under decode), its tensor bytes."""
        rec = self._rec
        rec.calls += 1
        ones = sum(1 for n in rows if n == 1)
        rec.layer_tokens["decode"] += ones
        rec.layer_tokens["prefill"] += sum(rows) - ones
        sent, received = call_bytes(self.info, self.config.dtype, sum(rows), writes)
        rec.bytes_sent += sent
        rec.bytes_received += received

    async def _model(self, engine: Engine) -> None:
        """A layer's share of --model-step-ms: owed time is slept once it reaches 2 ms (an event loop's sleep
        overshoots by about a millisecond, which per layer would double a 48-layer model's step), and what a sleep
        overshoots is owed less after it."""
        engine.model_owed_s += self._model_step_s / len(self.layers)
        if engine.model_owed_s >= 0.002:
            t = time.perf_counter()
            await asyncio.sleep(engine.model_owed_s)
            engine.model_owed_s -= time.perf_counter() - t

    async def _verify(self, engine: Engine, check: Awaitable[None]) -> None:
        """A --verify check, its time left out of the engine's clock (its arrivals wait as long: the open loop's
        arrivals follow the engine's clock)."""
        t = time.perf_counter()
        await check
        took = time.perf_counter() - t
        engine.verify_s += took
        engine.next_arrival += took

    @staticmethod
    def _seq_id(engine: Engine, request: Request) -> str:
        return f"{engine.route}-r{request.id}"

    async def _forget(self, engine: Engine, request: Request, ended: bool = False) -> None:
        """A request that left the engine or was preempted: with the block API its blocks are the engine's
        (nothing to tell the server); with the sequence API the server's sequence is released, unless its last
        call ended it."""
        if self.config.api != "sequence":
            return
        seq_id = self._seq_id(engine, request)
        if engine.check is not None:
            engine.check.release(seq_id)
        if not ended:
            await self._release(engine.client, seq_id)


def _ends(s: Scheduled) -> bool:
    """Whether the request's step makes its last token (scheduled: its computed tokens already counted)."""
    return s.request.computed >= s.request.tokens and s.request.generated + 1 >= s.request.output_len


def _retry_in(message: str) -> float | None:
    """The seconds a RESOURCE_EXHAUSTED for the tenant's opening rate says to wait ("... retry in 1.3 s"), or None."""
    match = re.search(r"retry in ([0-9.]+) s", message)
    return float(match.group(1)) if match else None
