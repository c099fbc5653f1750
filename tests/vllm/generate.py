"""Greedy generation with vLLM's offline LLM, run as a script (vLLM spawns its engine process, so LLM() must
be created under ``__main__``): ``python generate.py '<json>'`` prints one line ``RESULT <json>``.

The JSON argument: {"model": dir, "llm": {LLM keyword arguments}, "batches": [[[token ids], ...], ...],
"max_tokens": n, "prompt_logprobs": bool, "pause_after_first": bool, "kv_transfer_config": {...},
"kv_transfer_params": [[params or null, ...], ...], "hold": bool}. Each batch is one ``generate`` call
(its prompts run concurrently); batches run in order, so a later one can hit the prefix cache of an earlier
one. ``kv_transfer_config`` (vLLM's KVTransferConfig fields) loads a KV connector; ``kv_transfer_params``, shaped
as ``batches``, gives each prompt its params (SamplingParams.extra_args's "kv_transfer_params"). The result: per
prompt its tokens, each token's logprob (and each prompt token's) and the kv_transfer_params of its output,
vLLM's preemption and prefix-cache counters, its worker's KV cache (``kv``: the blocks it schedules with, the
bytes its KV tensors hold) and, with the plugin on, its worker's profile counters (``profile``: layer calls, and
the connector's grants and claims). With ``pause_after_first`` it prints ``READY`` after the first batch
and waits for a line on stdin (the test kills the chunkattn server meanwhile); with ``hold`` it waits for one
after printing its result, before shutting vLLM down (the test kills it meanwhile). The plugin is on when
CHUNKATTN_VLLM_TARGET is set.
"""

from __future__ import annotations

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
    summary = {
        "outputs": results,
        "counters": counters(llm),
        "kv": kv,
        "profile": profile,
        "llm_s": built,
        "generate_s": generated,
    }
    print("RESULT " + json.dumps(summary), flush=True)
    if args.get("hold"):
        sys.stdin.readline()


if __name__ == "__main__":
    main()
