"""Serving one step on the engine, on the thread that runs it: a control job alone, or Attend calls of one
layer merged into one ``Engine.attend_step`` (block-addressed ones into one ``Engine.attend_blocks``), their
outputs copied to host memory there (a device tensor's copy waits for its compute: it belongs to the thread
that owns the device), ``end_of_sequence`` releases after each call; and the step's metrics, observed here and
nowhere else. ``Steps`` serves steps for either runner and publishes what readers on other threads may see
(the pool's stats, the layers' KV scales) after each."""

from __future__ import annotations

import logging
import time

import torch

from chunkattn_server.engine.core import Engine
from chunkattn_server.engine.jobs import Attend, AttendBlocks, Control, Job, LayerCall, Result
from chunkattn_server.engine.types import AttendCall, EngineStats, Retry
from chunkattn_server.metrics import Metrics

log = logging.getLogger(__name__)

Scales = tuple[tuple[float, float] | None, ...]  # per layer, as Engine.scales_now


class Steps:
    """Serves steps on the engine for whichever runner has the turn, and publishes after each, for readers that
    must not queue behind the jobs (Info, the tenants' metrics): ``stats``, the pool and sequences, and
    ``kv_scales``, the layers' KV scales (Engine.scales_now). Each is replaced whole by the thread that ran the
    step, before its answers go, so a reader sees one step's state or the next one's, and a caller that reads
    after its answer sees its own step. Built on the engine thread, which takes the first snapshot."""

    def __init__(self, engine: Engine, metrics: Metrics | None) -> None:
        self.engine = engine
        self._metrics = metrics
        self.stats: EngineStats = engine.stats()
        self.kv_scales: Scales = engine.scales_now()
        self._calibrating = None in self.kv_scales  # scales change only while a layer calibrates
        if metrics is not None:  # the pool's gauges read what was published last, at scrape time
            metrics.watch_pool(lambda: self.stats)

    def run(self, step: list[Job], runner: str) -> tuple[list[Result], list[Job]]:
        """Serve one step (``serve``): its answers, and the calls to run again first. An error outside any call's
        own (a bug) fails every job of the step rather than leaving them unanswered."""
        try:
            results, retry, self.stats = serve(self.engine, step, self._metrics, runner)
        except Exception as e:
            log.exception("an engine step failed")
            results, retry = [(job, False, e) for job in step], []
        if self._calibrating:
            self.kv_scales = self.engine.scales_now()
            self._calibrating = None in self.kv_scales
        return results, retry


def serve(
    engine: Engine, step: list[Job], metrics: Metrics | None, runner: str
) -> tuple[list[Result], list[Job], EngineStats]:
    """Run one step on the engine. Returns the answers, (job, ok, result or exception): an Attend call's
    result is its output, a contiguous tensor in host memory; the calls to run again, first (engine.Retry);
    and the engine's stats after it. The metrics are observed before the answers go: a client that reads
    them after its call sees it counted."""
    started = time.perf_counter()
    results: list[Result] = []
    retry: list[Job] = []
    first = step[0]
    if isinstance(first, Control):
        try:
            results.append((first, True, first.fn(engine)))
        except Exception as e:
            results.append((first, False, e))
        calls: list[LayerCall] = []
    elif isinstance(first, AttendBlocks):
        calls = [job for job in step if isinstance(job, LayerCall)]
        _serve_blocks(engine, [job for job in step if isinstance(job, AttendBlocks)], results)
    else:
        calls = [job for job in step if isinstance(job, LayerCall)]
        released = _serve_attend(engine, [job for job in step if isinstance(job, Attend)], results, retry)
        if released and metrics is not None:
            metrics.released.inc(released)
    stats = engine.stats()
    if metrics is not None:
        observe(metrics, calls, results, retry, started, time.perf_counter(), runner)
    return results, retry, stats


def _serve_attend(engine: Engine, step: list[Attend], results: list[Result], retry: list[Job]) -> int:
    """The calls' answers and retries; returns how many sequences their ``ending`` released."""
    calls = [AttendCall(job.entries, job.q, job.k, job.v, job.tenant) for job in step]
    try:
        outs = engine.attend_step(step[0].layer, calls)
    except Exception as e:  # not one call's own error: every call of the step fails with it
        results.extend((job, False, e) for job in step)
        return 0
    released = 0
    for job, out in zip(step, outs, strict=True):
        if isinstance(out, Retry):
            retry.append(job)
            continue
        if isinstance(out, BaseException):
            results.append((job, False, out))
            continue
        try:
            if job.ending:
                released += engine.release(list(job.ending), tenant=job.tenant)
            results.append((job, True, _host(out)))
        except Exception as e:
            results.append((job, False, e))
    return released


def _serve_blocks(engine: Engine, step: list[AttendBlocks], results: list[Result]) -> None:
    try:
        outs = engine.attend_blocks(step[0].layer, [job.call for job in step])
    except Exception as e:  # not one call's own error: every call of the step fails with it
        results.extend((job, False, e) for job in step)
        return
    for job, out in zip(step, outs, strict=True):
        if isinstance(out, BaseException):
            results.append((job, False, out))
            continue
        try:
            results.append((job, True, _host(out)))
        except Exception as e:
            results.append((job, False, e))


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, contiguous (the wire's layout): itself when it is already."""
    if t.is_cpu and t.is_contiguous() and not t.requires_grad:
        return t
    return t.detach().to("cpu").contiguous()


def observe(
    m: Metrics,
    calls: list[LayerCall],
    results: list[Result],
    retry: list[Job],
    started: float,
    finished: float,
    runner: str,
) -> None:
    """A step's metrics, once per step where they can be: per call only what is labelled by its RPC.
    ``calls``: the step's Attend calls (none for a control job's step)."""
    m.of(m.steps, runner).inc()
    compute_s = finished - started
    for job, _, _ in results:
        m.of(m.queue_seconds, job.rpc).observe(started - job.submitted)
        m.of(m.compute_seconds, job.rpc).observe(compute_s)
    if not calls:
        return
    m.step_calls.observe(len(calls) - len(retry))
    m.step_tokens.observe(sum(job.tokens for job in calls if job not in retry))
    decode = prefill = received = sent = 0
    sequence = blocks = 0
    for job, ok, value in results:
        if not ok or not isinstance(job, LayerCall):
            continue
        if isinstance(job, AttendBlocks):
            blocks += 1
            c = job.call
            q_lens = c.starts[1:] - c.starts[:-1]
            decode += int((q_lens == 1).sum())
            prefill += int(q_lens[q_lens > 1].sum())
            q, k, v = c.q, c.k, c.v
        else:
            assert isinstance(job, Attend)
            sequence += 1
            for e in job.entries:
                if e.num_tokens == 1:
                    decode += 1
                else:
                    prefill += e.num_tokens
            q, k, v = job.q, job.k, job.v
        received += q.nbytes + (0 if k is None else k.nbytes) + (0 if v is None else v.nbytes)
        sent += value.nbytes
    if not (sequence or blocks):
        return
    if sequence:
        m.of(m.calls, "sequence").inc(sequence)
    if blocks:
        m.of(m.calls, "blocks").inc(blocks)
    if decode:
        m.of(m.tokens, "decode").inc(decode)
    if prefill:
        m.of(m.tokens, "prefill").inc(prefill)
    m.bytes_received.inc(received)
    m.bytes_sent.inc(sent)
