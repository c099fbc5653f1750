"""Greedy generation: ``greedy`` (the decoding loop, shared by OffloadSession.generate and the reference),
the Generation result, and ``generate_locally``, the same generation run by transformers alone with its own
KV cache: the reference offloaded generation is compared against."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from chunkattn_client.hf.attention import NAME, SessionError


@dataclass
class Generation:
    """Greedy generation's result.

    tokens: per row, the new tokens.
    logits: per row, float32 [new tokens, vocab]: the logits each token was chosen from (with keep_logits).
    seconds: wall time of the whole generation, prefill included; decode_seconds: the decode steps only.
    calls: Attend calls made (one per layer per forward).
    """

    tokens: list[list[int]]
    logits: list[torch.Tensor] | None
    seconds: float
    decode_seconds: float
    calls: int = 0
    decode_tokens: int = field(default=0)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def generate_locally(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, keep_logits: bool = False
) -> Generation:
    """The same greedy generation run by transformers alone, with its own KV cache, one row at a time
    (so no padding is involved): the reference that offloaded generation is compared against."""
    if model.config._attn_implementation == NAME:
        raise SessionError("the model is switched to chunkattn; run this outside an OffloadSession")
    tokens: list[list[int]] = []
    logits: list[torch.Tensor] = []
    started, decode_s = time.perf_counter(), 0.0
    with torch.no_grad():
        for prompt in prompts:
            row = _LocalRow(model, prompt)
            decode_started = time.perf_counter()
            row_tokens, row_logits = greedy(row.last, max_new_tokens, row.step)
            decode_s += time.perf_counter() - decode_started
            tokens += row_tokens
            logits += row_logits
    return Generation(
        tokens=tokens,
        logits=logits if keep_logits else None,
        seconds=time.perf_counter() - started,
        decode_seconds=decode_s,
        decode_tokens=len(prompts) * (max_new_tokens - 1),
    )


class _LocalRow:
    """One prompt run by transformers with its own cache: ``last`` after the prefill, then ``step``."""

    def __init__(self, model: PreTrainedModel, prompt: Sequence[int]) -> None:
        self.model = model
        out = model(input_ids=torch.tensor([list(prompt)], device=model.device), use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.last = [out.logits[0, -1].float()]

    def step(self, chosen: list[int]) -> list[torch.Tensor]:
        out = self.model(
            input_ids=torch.tensor([chosen], device=self.model.device), past_key_values=self.cache, use_cache=True
        )
        self.cache = out.past_key_values
        return [out.logits[0, -1].float()]


def greedy(
    last: list[torch.Tensor], max_new_tokens: int, step: Callable[[list[int]], list[torch.Tensor]]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding from each row's last logits; ``step(chosen tokens) -> next last logits``. Returns the
    tokens per row and, per row, the logits each was chosen from [max_new_tokens, vocab]."""
    tokens: list[list[int]] = [[] for _ in last]
    kept: list[list[torch.Tensor]] = [[] for _ in last]
    for i in range(max_new_tokens):
        chosen = [int(x.argmax()) for x in last]
        for r, t in enumerate(chosen):
            tokens[r].append(t)
            kept[r].append(last[r])
        if i + 1 < max_new_tokens:
            last = step(chosen)
    return tokens, [torch.stack(k) for k in kept]
