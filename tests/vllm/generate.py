"""Greedy generation with vLLM's offline LLM, run as a script (vLLM spawns its engine process, so LLM() must
be created under ``__main__``): ``python generate.py '<json>'`` prints one line ``RESULT <json>``.

The JSON argument: {"model": dir, "llm": {LLM keyword arguments}, "batches": [[[token ids], ...], ...],
"max_tokens": n, "prompt_logprobs": bool, "pause_after_first": bool, "kv_transfer_config": {...},
"kv_transfer_params": [[params or null, ...], ...], "hold": bool, "record_calls": bool,
"force_async_scheduling": bool}. Each batch is one ``generate`` call (its prompts run concurrently); batches run
in order, so a later one can hit the prefix cache of an earlier one. ``kv_transfer_config`` (vLLM's
KVTransferConfig fields) loads a KV connector; ``kv_transfer_params``, shaped as ``batches``, gives each prompt
its params (SamplingParams.extra_args's "kv_transfer_params"). The result: per prompt its tokens, each token's
logprob (and each prompt token's) and the kv_transfer_params of its output, vLLM's preemption and prefix-cache
counters, its worker's KV cache (``kv``: the blocks it schedules with, the bytes its KV tensors hold) and, with
the plugin on, its worker's profile counters (``profile``: layer calls, and the connector's grants and claims).
With ``pause_after_first`` it prints ``READY`` after the first batch and waits for a line on stdin (the test kills
the chunkattn server meanwhile); with ``hold`` it waits for one after printing its result, before shutting vLLM
down (the test kills it meanwhile). With ``record_calls`` (the plugin on) the worker records every layer call the
plugin gets, and the result's ``calls`` lists them in order, each ``[layer, num_actual_tokens, [q_len per row],
[seq_len per row]]`` (rows in vLLM's order); ``async_scheduling`` says whether vLLM scheduled asynchronously,
which it does on the CPU too with ``force_async_scheduling`` (vLLM turns it off there: the function of that name
says how it is kept on). The plugin is on when CHUNKATTN_VLLM_TARGET is set.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from typing import Any


def counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            out[m.name] = float(getattr(m, "value", 0.0))
    return out


def kv_cache(worker: Any) -> dict[str, int]:
    """Run in vLLM's worker (LLM.collective_rpc): the blocks of its KV cache config (the scheduler's) and the
    bytes the model runner's KV tensors hold (their untyped storages, each counted once)."""
    runner = worker.model_runner
    storages = {}
    for tensor in runner.kv_caches:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return {"num_blocks": int(runner.kv_cache_config.num_blocks), "local_kv_bytes": sum(storages.values())}


def plugin_profile(worker: Any) -> dict[str, float] | None:
    """Run in vLLM's worker: the plugin's profile counters (offload.Offload.profile), None with the plugin off."""
    if not os.environ.get("CHUNKATTN_VLLM_TARGET"):
        return None
    from chunkattn_client.vllm import backend

    return dict(backend.current().profile)


def record_calls(worker: Any) -> None:
    """Run in vLLM's worker: wrap the plugin's ``Offload.attend`` (backend.current()) with a recorder of each
    layer call's shape (module doc), kept on the Offload for ``recorded_calls``."""
    from chunkattn_client.vllm import backend

    offload = backend.current()
    attend = offload.attend
    calls: list[list[Any]] = []

    def recorder(layer: int, q: Any, k: Any, v: Any, metadata: Any, output: Any) -> None:
        seq_lens = [int(x) for x in metadata.seq_lens.cpu().tolist()]
        starts = [int(x) for x in metadata.query_start_loc[: len(seq_lens) + 1].cpu().tolist()]
        q_lens = [b - a for a, b in itertools.pairwise(starts)]
        calls.append([layer, int(metadata.num_actual_tokens), q_lens, seq_lens])
        attend(layer, q, k, v, metadata, output)

    offload.attend = recorder  # type: ignore[method-assign]
    offload.recorded_calls = calls  # type: ignore[attr-defined]


def recorded_calls(worker: Any) -> list[list[Any]]:
    """Run in vLLM's worker: the layer calls ``record_calls`` recorded."""
    from chunkattn_client.vllm import backend

    calls: list[list[Any]] = backend.current().recorded_calls  # type: ignore[attr-defined]
    return calls


def force_async_scheduling() -> None:
    """vLLM's async scheduling (its AsyncScheduler and the engine core's batch queue of two) on the CPU platform,
    which turns it off whatever was asked: ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py) sets
    ``scheduler_config.async_scheduling = False`` ("not required on CPU"). That classmethod is wrapped, in this
    process, where LLM() builds the config (``VllmConfig.__post_init__`` resolves async scheduling, validating it
    against the executor and the model, then calls the platform hook), so that the flag gets back the value it had
    before the hook; the hook's other settings stand. Pass ``"async_scheduling": true`` among the LLM arguments
    too, so that vLLM validates it as an explicit request. Why: the bench models vLLM on GPUs, where async
    scheduling is the default, and on the CPU only this shows vLLM's steps under it (tests/vllm/
    test_bench_engine.py runs the engine core in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.platforms.cpu import CpuPlatform

    hook = CpuPlatform.check_and_update_config.__func__

    def keep_async_scheduling(cls: type, vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    CpuPlatform.check_and_update_config = classmethod(keep_async_scheduling)


def sampling(args: dict[str, Any], params: dict[str, Any] | None) -> Any:
    """Greedy SamplingParams as ``args`` ask, with ``params`` as the prompt's kv_transfer_params."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0,
        max_tokens=args.get("max_tokens", 16),
        detokenize=False,
        logprobs=1,
        prompt_logprobs=1 if args.get("prompt_logprobs") else None,
        extra_args=None if params is None else {"kv_transfer_params": params},
    )


def main() -> None:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(kv_cache): a function, pickled
    from vllm import LLM

    args = json.loads(sys.argv[1])
    if args.get("force_async_scheduling"):
        force_async_scheduling()
    llm_args = dict(args.get("llm", {}))
    if args.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        llm_args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    started = time.perf_counter()
    llm = LLM(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        disable_log_stats=False,
        **llm_args,
    )
    built = time.perf_counter() - started
    (kv,) = llm.collective_rpc(kv_cache)
    if args.get("record_calls"):
        llm.collective_rpc(record_calls)
    transfer = args.get("kv_transfer_params") or [[None] * len(batch) for batch in args["batches"]]
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for i, (batch, batch_params) in enumerate(zip(args["batches"], transfer, strict=True)):
        params = [sampling(args, p) for p in batch_params]
        for r in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False):
            c = r.outputs[0]
            assert c.logprobs is not None
            # each prompt token's logprob given the tokens before it (the first has none), when asked for
            prompt = [] if r.prompt_logprobs is None else r.prompt_logprobs[1:]
            results.append(
                {
                    "tokens": list(c.token_ids),
                    "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
                    "prompt_logprobs": [lp[t].logprob for t, lp in zip(r.prompt_token_ids[1:], prompt, strict=False)],
                    "kv_transfer_params": r.kv_transfer_params,
                }
            )
        if i == 0 and args.get("pause_after_first"):
            print("READY", flush=True)
            sys.stdin.readline()
    generated = time.perf_counter() - started
    (profile,) = llm.collective_rpc(plugin_profile)
    calls = llm.collective_rpc(recorded_calls)[0] if args.get("record_calls") else None
    summary = {
        "outputs": results,
        "counters": counters(llm),
        "kv": kv,
        "profile": profile,
        "calls": calls,
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "llm_s": built,
        "generate_s": generated,
    }
    print("RESULT " + json.dumps(summary), flush=True)
    if args.get("hold"):
        sys.stdin.readline()


if __name__ == "__main__":
    main()
