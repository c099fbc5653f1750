"""What the simulated model runner sends: sequence lengths, their calls, and the tensors' contents.

A sequence is a prompt of ``prompt_len`` tokens prefilled in pieces of at most ``prefill_chunk`` tokens
(0: the whole prompt in one piece), then ``output_len`` decode steps of one token. Every step calls each
chosen layer once, in layer order, as a model's forward pass does.

With speculative decoding (``Speculation``: K drafts, each accepted with probability P until the first
rejection, as EAGLE or a draft model's verification goes), a decode step is a verify call of K + 1 tokens:
the last chosen token and K drafts. The sequence keeps the chosen token and the a drafts accepted, and
truncates the K - a rejected ones (Truncate); the step yields a + 1 new tokens (the accepted drafts and the
target model's own next token, which the next verify call sends first), so ``output_len`` tokens take fewer
steps.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from chunkattn_client import codec
from chunkattn_client.client import ServerInfo


class WorkloadError(ValueError):
    """A workload option or trace file that cannot be used; the message says what was expected."""


@dataclass(frozen=True)
class SequenceSpec:
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Step:
    """One forward pass of one sequence: ``num_tokens`` tokens from ``position``, of which the sequence
    keeps the first ``keep`` (None: all; a verify call keeps its chosen token and accepted drafts, and the
    rest is truncated after it)."""

    kind: str  # "prefill" or "decode" (a verify call is a decode step)
    position: int
    num_tokens: int
    keep: int | None = None

    @property
    def tokens(self) -> int:
        """The model tokens it adds to the sequence."""
        return self.num_tokens if self.keep is None else self.keep


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding: ``drafts`` draft tokens per verify call, each accepted with probability
    ``accept_rate`` while every earlier one was."""

    drafts: int
    accept_rate: float

    def accepted(self, rng: random.Random) -> int:
        """Drafts accepted in one verify call: the length of the accepted prefix, 0..drafts."""
        n = 0
        while n < self.drafts and rng.random() < self.accept_rate:
            n += 1
        return n


@dataclass(frozen=True)
class Lengths:
    """A length that is fixed (low == high) or uniform in [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, *, what: str, minimum: int) -> Lengths:
        """ "128" or "64:256" (inclusive)."""
        try:
            parts = [int(p) for p in text.split(":")]
        except ValueError:
            raise WorkloadError(f"{what}: expected N or LOW:HIGH (integers), got {text!r}") from None
        if len(parts) not in (1, 2):
            raise WorkloadError(f"{what}: expected N or LOW:HIGH, got {text!r}")
        low, high = parts[0], parts[-1]
        if low < minimum or high < low:
            raise WorkloadError(f"{what}: expected {minimum} <= LOW <= HIGH, got {text!r}")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def read_trace(path: str | Path) -> list[SequenceSpec]:
    """A JSONL trace: one {"prompt_len": int >= 1, "output_len": int >= 0} object per line."""
    specs = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise WorkloadError(f"cannot read the trace {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, output = row["prompt_len"], row["output_len"]
        except (ValueError, TypeError, KeyError):
            raise WorkloadError(
                f"{path}:{n}: expected a JSON object with integer prompt_len and output_len, got {line[:80]!r}"
            ) from None
        if not (isinstance(prompt, int) and isinstance(output, int) and prompt >= 1 and output >= 0):
            raise WorkloadError(f"{path}:{n}: expected prompt_len >= 1 and output_len >= 0, got {line[:80]!r}")
        specs.append(SequenceSpec(prompt, output))
    if not specs:
        raise WorkloadError(f"the trace {path} lists no sequences")
    return specs


class LengthSource:
    """The lengths of each new sequence: from a trace, in its order (and again from the top), or sampled."""

    def __init__(self, prompt: Lengths, output: Lengths, trace: Sequence[SequenceSpec] | None, seed: int) -> None:
        self.prompt, self.output, self.trace = prompt, output, list(trace) if trace else None
        self._rng = random.Random(seed)
        self._n = 0

    def next(self) -> SequenceSpec:
        self._n += 1
        if self.trace:
            return self.trace[(self._n - 1) % len(self.trace)]
        return SequenceSpec(self.prompt.sample(self._rng), self.output.sample(self._rng))

    @property
    def max_prompt(self) -> int:
        return max(s.prompt_len for s in self.trace) if self.trace else self.prompt.high


def steps(
    spec: SequenceSpec, prefill_chunk: int, speculation: Speculation | None = None, rng: random.Random | None = None
) -> list[Step]:
    """The sequence's forward passes: prefill pieces, then one decode step per output token, or with
    ``speculation`` verify steps of drafts + 1 tokens, each keeping 1 + its accepted drafts (drawn from
    ``rng``), until ``output_len`` tokens are kept (the last step keeps no more than that)."""
    piece = prefill_chunk or spec.prompt_len
    out = [Step("prefill", p, min(piece, spec.prompt_len - p)) for p in range(0, spec.prompt_len, piece)]
    if speculation is None or not speculation.drafts:
        return out + [Step("decode", spec.prompt_len + i, 1) for i in range(spec.output_len)]
    rng = rng or random.Random(0)
    position, left = spec.prompt_len, spec.output_len
    while left > 0:
        keep = min(1 + speculation.accepted(rng), left)
        out.append(Step("decode", position, speculation.drafts + 1, keep))
        position, left = position + keep, left - keep
    return out


def choose_layers(info: ServerInfo, text: str) -> tuple[int, ...]:
    """ "all" or a comma-separated list of layer indices; a KV-sharing layer needs its source too."""
    n = len(info.layers)
    if text == "all":
        return tuple(range(n))
    try:
        chosen = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise WorkloadError(f"--layers: expected 'all' or indices like 0,1,3, got {text!r}") from None
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise WorkloadError(f"--layers: the server's model has layers 0..{n - 1}; got {bad}")
    for i in chosen:
        source = info.layers[i].kv_source
        if source is not None and source not in chosen:
            raise WorkloadError(f"--layers: layer {i} reads layer {source}'s KV, so layer {source} must be called too")
    return tuple(chosen)


class RandomTensors:
    """q/k/v contents: views of one buffer of N(0, 1) values in the wire dtype, at random offsets.

    Generating fresh random numbers for every call would make the client, not the server, the
    bottleneck; views cost nothing and still differ from call to call.
    """

    _SLACK = 4096

    def __init__(self, info: ServerInfo, dtype: str, max_tokens: int, seed: int) -> None:
        self.head_size = info.head_size
        rng = np.random.default_rng(seed)
        n = max_tokens * max(info.num_heads, info.num_kv_heads) * info.head_size + self._SLACK
        values = rng.standard_normal(n, dtype=np.float32)
        self._pool: npt.NDArray[Any] = (
            codec.float32_to_bf16(values) if dtype == "bfloat16" else values.astype(codec.numpy_dtype(dtype))
        )
        self._rng = rng

    def take(self, tokens: int, heads: int) -> npt.NDArray[Any]:
        """[tokens, heads, head_size] in the wire dtype (uint16 words for bfloat16)."""
        start = int(self._rng.integers(0, self._SLACK))
        return self._pool[start : start + tokens * heads * self.head_size].reshape(tokens, heads, self.head_size)


def call_bytes(info: ServerInfo, dtype: str, tokens: int, writes_kv: bool) -> tuple[int, int]:
    """(tensor bytes sent, tensor bytes received) of one call of ``tokens`` tokens."""
    item = codec.numpy_dtype(dtype).itemsize
    q = tokens * info.num_heads * info.head_size * item
    kv = 2 * tokens * info.num_kv_heads * info.head_size * item if writes_kv else 0
    return q + kv, q
