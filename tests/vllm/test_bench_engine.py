"""The bench's engine workload (``chunkattn bench``: its Scheduler and KVBlocks, client/chunkattn_client/bench/) sends
the server what vLLM with the plugin sends it: vLLM runs a batch of prompts (lengths crossing chunk boundaries,
C = 64, blocks of 32; some longer than max_num_batched_tokens, so vLLM chunks their prefill; more prompts than
max_num_seqs, so some wait), its worker recording every layer call the plugin gets, and the bench's dry run
schedules the same lengths with vLLM's limits and block count. Per step and per layer: the same tokens, the same
rows as (query tokens, keys) pairs, and the same table width (ceil of the longest row's keys over the block size:
the plugin cuts vLLM's tables to that; the bench's LayerRows are that wide).

Rows are compared as sorted lists: vLLM orders them by its persistent batch's slots (InputBatch: a new request
takes the lowest freed slot, condense() moves the last requests into the holes; the CPU backend does not reorder
decodes before prefills), the bench in its scheduler's order (running requests as admitted, then the new ones).

vLLM's engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that all the prompts are queued before
its first step (its engine process would start stepping on the first request to arrive); prefix caching off; a
pool that holds every running request (no preemption). Twice: with synchronous scheduling, which vLLM's CPU
platform forces (vllm/platforms/cpu.py, check_and_update_config), against ``Scheduler``; and with async
scheduling, vLLM's default on GPUs, kept on by generate.py's ``force_async_scheduling`` (which undoes that
platform hook's setting, nothing else), against ``Scheduler(..., async_scheduling=True)``: there step N + 1 is
scheduled before step N's tokens are processed, so a request that finished in step N keeps its seat and blocks
through N + 1 and the requests waiting for a seat start a step later. The async run's tokens and logprobs are the
synchronous run's (vLLM's CPU runner computes the same under async scheduling: its steps can be trusted).

Then under KV pressure (PREEMPT): other lengths in a pool of PREEMPT_POOL_BLOCKS (max_model_len 256, so that
vLLM starts with it), synchronous, then async. vLLM admits a waiting request only when its whole sequence's
blocks are free (scheduler_reserve_full_isl, its default; a chunked group's capped at C plus the tokens in
flight, ChunkedLocalAttentionSpec.max_admission_blocks_per_request), so requests wait for blocks with seats and
budget left; and, as the running ones grow past what was free when they were admitted (the rest of a chunked
prompt, decodes crossing into new blocks), vLLM preempts the request admitted last (its ``vllm:num_preemptions``
counter), recomputing it later from its first token. The bench's dry run preempts as many times, and every
step's calls have the same shapes; under async scheduling too (a chunked group's blocks freed only below the
chunk of the tokens processed, not of those in flight; its admission cap counting two steps in flight), with the
synchronous run's tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkattn_client.bench.kvblocks import KVBlocks
from chunkattn_client.bench.scheduler import Request, Scheduler
from tests.vllm.conftest import BLOCK_SIZE, CHUNK, generate
from tests.vllm.test_parity import LOGPROB_BOUND, _compare, _prompts, _server

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.vllm]

# Across chunk boundaries (64, 128 exactly on one), longer than the step's budget (96), and more than max_num_seqs.
LENGTHS = [40, 70, 100, 130, 200, 31, 64, 65, 150, 90, 128]
MAX_NUM_BATCHED_TOKENS = 96
MAX_NUM_SEQS = 4
MAX_TOKENS = 6  # vLLM's max_tokens: the bench's output_len
POOL_BLOCKS = 128  # every running request's blocks at once (4 requests need at most ~64): no preemption
BLOCK_BYTES = BLOCK_SIZE * 2 * 2 * 64 * 4  # a block of the model's KV (2 KV heads of 64, K and V, float32)
SERVER_BLOCKS = 512
CHUNK_SIZES = [CHUNK, CHUNK, CHUNK, 0]  # the checkpoint's layers (conftest): 3 chunked, then 1 global
NUM_LAYERS = len(CHUNK_SIZES)

# Under KV pressure: requests admitted on what is free while their later prefill chunks (200 and 160: longer than
# the budget) and their decodes (crossing into new blocks) take more; the 200 admitted second, where what it
# reserves per chunked group with two steps in flight (7 blocks of C + 2 x 96 tokens) is not what it reserves with
# one (5). Prompts drawn with seed 12: none samples the checkpoint's EOS before MAX_TOKENS.
PREEMPT_LENGTHS = [70, 200, 31, 70, 64, 160, 40, 31, 32]
PREEMPT_SEED = 12
PREEMPT_POOL_BLOCKS = 34
# vLLM starts only with a pool that holds one request of max_model_len: 8 global blocks of 256 tokens and, per
# chunked group, ceil((C + tokens in flight) / 32): 5 synchronous (C + 96), 8 async (C + 2 x 96), so 23 and 32
# blocks (at 512 tokens, async would need 40).
PREEMPT_MAX_MODEL_LEN = 256

# A layer call's shape: (tokens, sorted [(q_len, seq_len), ...], table width in blocks).
Shape = tuple[int, list[tuple[int, int]], int]


def _shape(tokens: int, q_lens: list[int], seq_lens: list[int]) -> Shape:
    assert sum(q_lens) == tokens, f"rows of {sum(q_lens)} tokens in a call of {tokens}"
    width = -(-max(seq_lens, default=0) // BLOCK_SIZE)
    return tokens, sorted(zip(q_lens, seq_lens, strict=True)), width


def _vllm_steps(calls: list[list[Any]]) -> list[list[Shape]]:
    """vLLM's recorded layer calls (generate.py's ``calls``) cut into steps: each step calls layers 0..L-1 in
    order."""
    steps: list[list[Shape]] = []
    for layer, tokens, q_lens, seq_lens in calls:
        if layer == 0:
            steps.append([])
        assert steps, "vLLM's first call was not layer 0's"
        assert layer == len(steps[-1]), f"vLLM called layer {layer} out of order (step {len(steps)})"
        steps[-1].append(_shape(tokens, q_lens, seq_lens))
    assert all(len(step) == NUM_LAYERS for step in steps), "a vLLM step called fewer layers than the model has"
    return steps


@dataclasses.dataclass(frozen=True)
class Case:
    """One run: the prompts' lengths, vLLM's pool in blocks (the bench's block space), the scheduling."""

    lengths: tuple[int, ...]
    pool_blocks: int
    async_scheduling: bool = False
    max_model_len: int = 512
    seed: int = 11  # the prompts' tokens


BASE = Case(tuple(LENGTHS), POOL_BLOCKS)
BASE_ASYNC = Case(tuple(LENGTHS), POOL_BLOCKS, async_scheduling=True)
PREEMPT = Case(tuple(PREEMPT_LENGTHS), PREEMPT_POOL_BLOCKS, max_model_len=PREEMPT_MAX_MODEL_LEN, seed=PREEMPT_SEED)
PREEMPT_ASYNC = dataclasses.replace(PREEMPT, async_scheduling=True)


@dataclasses.dataclass
class BenchRun:
    """The bench's dry run, per step: its layer calls' shapes, what it scheduled (request, position, tokens),
    the requests it preempted, and, once it was scheduled, those left waiting and the number holding a seat."""

    steps: list[list[Shape]]
    scheduled: list[list[tuple[int, int, int]]]
    preempted: list[list[int]]
    waiting: list[list[int]]
    seated: list[int]

    @property
    def preemptions(self) -> int:
        return sum(len(p) for p in self.preempted)


def _bench_steps(case: Case, num_blocks: int, preemption: bool = False) -> BenchRun:
    """The bench's dry run on ``case``'s lengths over ``num_blocks`` (vLLM's): it may preempt only when
    ``preemption`` says so."""
    blocks = KVBlocks(CHUNK_SIZES, [None] * NUM_LAYERS, num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(blocks, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, async_scheduling=case.async_scheduling)
    requests = [Request(i, prompt_len, MAX_TOKENS) for i, prompt_len in enumerate(case.lengths)]
    for request in requests:
        scheduler.add(request)
    run = BenchRun([], [], [], [], [])
    while not scheduler.idle:
        s = len(run.steps)
        step = scheduler.schedule()
        assert step, f"the bench's scheduler scheduled nothing at step {s} ({num_blocks} blocks)"
        assert preemption or not scheduler.preempted, f"the bench's scheduler preempted at step {s}"
        entries = [(x.request, x.position, x.num_tokens) for x in step]
        shapes = []
        for layer in range(NUM_LAYERS):
            rows = blocks.rows(blocks.group_of[layer], entries)
            q_lens = np.diff(rows.starts).tolist()
            shape = _shape(rows.num_tokens, q_lens, rows.seq_lens.tolist())
            assert rows.tables.shape == (len(q_lens), shape[2]), f"step {s} layer {layer}: tables"
            shapes.append(shape)
        run.steps.append(shapes)
        run.scheduled.append([(x.request.id, x.position, x.num_tokens) for x in step])
        run.preempted.append([r.id for r in scheduler.preempted])
        run.waiting.append([r.id for r in scheduler.waiting])
        run.seated.append(len(scheduler.running) + len(scheduler.leaving))
        scheduler.finish(step)
    assert run.preemptions == sum(r.preemptions for r in requests)
    assert all(r.done for r in requests)
    return run


def _first_difference(
    vllm: list[list[Shape]], bench: list[list[Shape]], scheduled: list[list[tuple[int, int, int]]]
) -> str | None:
    """A message showing the first step whose shapes differ (both sides, per layer), or None."""
    for i in range(max(len(vllm), len(bench))):
        ours = bench[i] if i < len(bench) else None
        theirs = vllm[i] if i < len(vllm) else None
        if ours == theirs:
            continue
        lines = [f"step {i} of {len(vllm)} (vLLM) / {len(bench)} (bench) differs, as (tokens, rows, width):"]
        if i < len(scheduled):
            lines.append(f"  the bench scheduled (request, position, tokens): {scheduled[i]}")
        for layer in range(NUM_LAYERS):
            lines.append(f"  layer {layer}  vLLM:  {None if theirs is None else theirs[layer]}")
            lines.append(f"  layer {layer}  bench: {None if ours is None else ours[layer]}")
        return "\n".join(lines)
    return None


@pytest.fixture(scope="module")
def vllm_runs(checkpoint: Path) -> Iterator[Callable[[Case], dict[str, Any]]]:
    """vLLM on a case's lengths with the plugin recording its layer calls (each case run once)."""
    runs: dict[Case, dict[str, Any]] = {}
    with _server(checkpoint, num_blocks=SERVER_BLOCKS) as server:

        def run(case: Case) -> dict[str, Any]:
            if case not in runs:
                llm: dict[str, Any] = {
                    "kv_cache_memory_bytes": case.pool_blocks * BLOCK_BYTES,
                    "max_model_len": case.max_model_len,
                    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                    "max_num_seqs": MAX_NUM_SEQS,
                    "enable_prefix_caching": False,
                }
                if case.async_scheduling:
                    llm["async_scheduling"] = True
                args = {
                    "model": str(checkpoint),
                    "max_tokens": MAX_TOKENS,
                    "record_calls": True,
                    "force_async_scheduling": case.async_scheduling,
                    "llm": llm,
                    "batches": [_prompts(case.seed, list(case.lengths))],
                }
                env = {"CHUNKATTN_DATA_PLANE": "grpc", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
                result = generate(args, target=server.target, env=env)
                assert result["kv"]["num_blocks"] == case.pool_blocks
                assert result["async_scheduling"] == case.async_scheduling, "vLLM did not schedule as asked"
                assert [len(o["tokens"]) for o in result["outputs"]] == [MAX_TOKENS] * len(case.lengths), (
                    "a request sampled EOS before MAX_TOKENS (the bench's do not): draw the prompts with another seed"
                )
                runs[case] = result
            return runs[case]

        yield run


def _preemptions(result: dict[str, Any]) -> int:
    return int(result["counters"].get("vllm:num_preemptions", 0))


def _assert_alike(result: dict[str, Any], bench: BenchRun) -> list[list[Shape]]:
    """vLLM's steps are the bench's, shape for shape; returns vLLM's."""
    vllm = _vllm_steps(result["calls"])
    difference = _first_difference(vllm, bench.steps, bench.scheduled)
    assert difference is None, difference
    return vllm


def test_the_bench_engine_schedules_the_layer_calls_vllm_makes(vllm_runs: Callable[[Case], dict[str, Any]]) -> None:
    result = vllm_runs(BASE)
    assert _preemptions(result) == 0, "the pool was meant to hold every request"
    bench = _bench_steps(BASE, result["kv"]["num_blocks"])
    vllm = _assert_alike(result, bench)
    scheduled = bench.scheduled
    # The scenario does what it is meant to: steps that fill the budget, prompts prefilled in pieces (chunked
    # prefill), requests that wait for a seat while MAX_NUM_SEQS run.
    assert any(sum(tokens for *_, tokens in step) == MAX_NUM_BATCHED_TOKENS for step in scheduled)
    assert any(0 < position < LENGTHS[i] for step in scheduled for i, position, _ in step)
    first_step: dict[int, int] = {}
    for s, step in enumerate(scheduled):
        for i, _, _ in step:
            first_step.setdefault(i, s)
    assert any(
        len(step) == MAX_NUM_SEQS and sum(tokens for *_, tokens in step) < MAX_NUM_BATCHED_TOKENS
        for s, step in enumerate(scheduled)
        if max(first_step.values()) > s
    ), "no request waited for a seat with budget left"
    print(f"{len(vllm)} steps of {NUM_LAYERS} layer calls alike; vLLM generated in {result['generate_s']:.1f} s")


def test_the_bench_engine_schedules_the_layer_calls_vllm_makes_under_async_scheduling(
    vllm_runs: Callable[[Case], dict[str, Any]],
) -> None:
    result = vllm_runs(BASE_ASYNC)
    assert _preemptions(result) == 0, "the pool was meant to hold every request"
    _compare(vllm_runs(BASE), result, LOGPROB_BOUND)  # the CPU runner computes the same under async scheduling
    bench = _bench_steps(BASE_ASYNC, result["kv"]["num_blocks"])
    vllm = _assert_alike(result, bench)
    # The scenario shows the difference: the synchronous schedule is not this one (seats come free a step later).
    synchronous = _bench_steps(BASE, result["kv"]["num_blocks"])
    assert len(synchronous.steps) < len(bench.steps)
    print(f"{len(vllm)} steps of {NUM_LAYERS} layer calls alike ({len(synchronous.steps)} synchronous)")


def test_the_bench_engine_preempts_as_vllm_does_under_kv_pressure(
    vllm_runs: Callable[[Case], dict[str, Any]],
) -> None:
    result = vllm_runs(PREEMPT)
    preemptions = _preemptions(result)
    assert preemptions > 0, "vLLM did not preempt: the pool was meant to be too small for what it admits"
    bench = _bench_steps(PREEMPT, result["kv"]["num_blocks"], preemption=True)
    vllm = _assert_alike(result, bench)
    assert bench.preemptions == preemptions, f"the bench preempted {bench.preemptions} times, vLLM {preemptions}"
    # The scenario does what it is meant to: requests wait for blocks (a seat and budget free, nothing preempted
    # that step, yet one waits), and a preempted request is recomputed from its first token.
    assert any(
        bench.waiting[s]
        and not bench.preempted[s]
        and bench.seated[s] < MAX_NUM_SEQS
        and sum(tokens for *_, tokens in step) < MAX_NUM_BATCHED_TOKENS
        for s, step in enumerate(bench.scheduled)
    ), "no request waited for blocks"
    for s, preempted in enumerate(bench.preempted):
        for i in preempted:
            resumed = next(step for step in bench.scheduled[s + 1 :] if any(r == i for r, _, _ in step))
            assert (i, 0) in [(r, position) for r, position, _ in resumed]
    print(
        f"{len(vllm)} steps of {NUM_LAYERS} layer calls alike, {preemptions} preemptions; "
        f"vLLM generated in {result['generate_s']:.1f} s"
    )


def test_the_bench_engine_preempts_as_vllm_does_under_kv_pressure_and_async_scheduling(
    vllm_runs: Callable[[Case], dict[str, Any]],
) -> None:
    result = vllm_runs(PREEMPT_ASYNC)
    _compare(vllm_runs(PREEMPT), result, LOGPROB_BOUND)  # preempted and recomputed, the same tokens
    preemptions = _preemptions(result)
    assert preemptions > 0, "vLLM did not preempt: the pool was meant to be too small for what it admits"
    bench = _bench_steps(PREEMPT_ASYNC, result["kv"]["num_blocks"], preemption=True)
    vllm = _assert_alike(result, bench)
    assert bench.preemptions == preemptions, f"the bench preempted {bench.preemptions} times, vLLM {preemptions}"
    synchronous = _bench_steps(PREEMPT, result["kv"]["num_blocks"], preemption=True)
    assert len(synchronous.steps) < len(bench.steps)
    print(
        f"{len(vllm)} steps of {NUM_LAYERS} layer calls alike ({len(synchronous.steps)} synchronous), "
        f"{preemptions} preemptions"
    )
