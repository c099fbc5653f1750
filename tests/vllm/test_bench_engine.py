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
"""

from __future__ import annotations

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


def _bench_steps(
    num_blocks: int, async_scheduling: bool = False
) -> tuple[list[list[Shape]], list[list[tuple[int, int, int]]]]:
    """The bench's dry run on LENGTHS: per step its layer calls' shapes, and what it scheduled (request, position,
    tokens)."""
    blocks = KVBlocks(CHUNK_SIZES, [None] * NUM_LAYERS, num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(blocks, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, async_scheduling=async_scheduling)
    for i, prompt_len in enumerate(LENGTHS):
        scheduler.add(Request(i, prompt_len, MAX_TOKENS))
    steps: list[list[Shape]] = []
    scheduled: list[list[tuple[int, int, int]]] = []
    while not scheduler.idle:
        step = scheduler.schedule()
        assert step, f"the bench's scheduler scheduled nothing at step {len(steps)} ({num_blocks} blocks)"
        assert not scheduler.preempted, f"the bench's scheduler preempted at step {len(steps)}"
        entries = [(s.request, s.position, s.num_tokens) for s in step]
        shapes = []
        for layer in range(NUM_LAYERS):
            rows = blocks.rows(blocks.group_of[layer], entries)
            q_lens = np.diff(rows.starts).tolist()
            shape = _shape(rows.num_tokens, q_lens, rows.seq_lens.tolist())
            assert rows.tables.shape == (len(q_lens), shape[2]), f"step {len(steps)} layer {layer}: tables"
            shapes.append(shape)
        steps.append(shapes)
        scheduled.append([(s.request.id, s.position, s.num_tokens) for s in step])
        scheduler.finish(step)
    return steps, scheduled


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
def vllm_runs(checkpoint: Path) -> Iterator[Callable[[bool], dict[str, Any]]]:
    """vLLM on LENGTHS with the plugin recording its layer calls, synchronous or async (each run once)."""
    runs: dict[bool, dict[str, Any]] = {}
    with _server(checkpoint, num_blocks=SERVER_BLOCKS) as server:

        def run(async_scheduling: bool) -> dict[str, Any]:
            if async_scheduling not in runs:
                llm: dict[str, Any] = {
                    "kv_cache_memory_bytes": POOL_BLOCKS * BLOCK_BYTES,
                    "max_model_len": 512,
                    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                    "max_num_seqs": MAX_NUM_SEQS,
                    "enable_prefix_caching": False,
                }
                if async_scheduling:
                    llm["async_scheduling"] = True
                args = {
                    "model": str(checkpoint),
                    "max_tokens": MAX_TOKENS,
                    "record_calls": True,
                    "force_async_scheduling": async_scheduling,
                    "llm": llm,
                    "batches": [_prompts(11, LENGTHS)],
                }
                env = {"CHUNKATTN_DATA_PLANE": "grpc", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
                result = generate(args, target=server.target, env=env)
                assert result["kv"]["num_blocks"] == POOL_BLOCKS
                assert result["counters"].get("vllm:num_preemptions", 0) == 0, (
                    "the pool was meant to hold every request"
                )
                assert result["async_scheduling"] == async_scheduling, "vLLM did not schedule as asked"
                assert [len(o["tokens"]) for o in result["outputs"]] == [MAX_TOKENS] * len(LENGTHS)
                runs[async_scheduling] = result
            return runs[async_scheduling]

        yield run


def test_the_bench_engine_schedules_the_layer_calls_vllm_makes(vllm_runs: Callable[[bool], dict[str, Any]]) -> None:
    result = vllm_runs(False)
    vllm = _vllm_steps(result["calls"])
    bench, scheduled = _bench_steps(result["kv"]["num_blocks"])
    difference = _first_difference(vllm, bench, scheduled)
    assert difference is None, difference
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
    vllm_runs: Callable[[bool], dict[str, Any]],
) -> None:
    result = vllm_runs(True)
    _compare(vllm_runs(False), result, LOGPROB_BOUND)  # the CPU runner computes the same under async scheduling
    vllm = _vllm_steps(result["calls"])
    bench, scheduled = _bench_steps(result["kv"]["num_blocks"], async_scheduling=True)
    difference = _first_difference(vllm, bench, scheduled)
    assert difference is None, difference
    # The scenario shows the difference: the synchronous schedule is not this one (seats come free a step later).
    synchronous, _ = _bench_steps(result["kv"]["num_blocks"])
    assert len(synchronous) < len(bench)
    print(f"{len(vllm)} steps of {NUM_LAYERS} layer calls alike ({len(synchronous)} synchronous)")
