"""A call's own checks, before anything changes: its metadata, its tensors against the model, their values
(finite, within the compute dtype), its positions against its sequences' state. Each raises the EngineError
(InvalidBatch, InvalidTensor, UnknownSequence, PositionMismatch) the call fails with, merged into a step with
others or alone."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from chunkattn_client import dtypes
from chunkattn_client.batch import BatchEntry
from chunkattn_client.limits import MAX_BATCH, MAX_TOKENS, id_problem, quote
from chunkattn_server import torchtypes
from chunkattn_server.config import LayerSpec, ModelShape
from chunkattn_server.errors import InvalidBatch, InvalidTensor, PositionMismatch, UnknownSequence
from chunkattn_server.kv.sequences import SequenceState

_EXPECTED = dtypes.names(dtypes.WIRE)


def check_entries(entries: Sequence[BatchEntry]) -> int:
    """Validate batch metadata on its own; returns the total number of tokens."""
    if not entries:
        raise InvalidBatch("the batch is empty; send at least one sequence")
    if len(entries) > MAX_BATCH:
        raise InvalidBatch(f"the batch has {len(entries)} sequences; at most {MAX_BATCH} per call")
    seen: set[str] = set()
    for i, e in enumerate(entries):
        if not isinstance(e, BatchEntry):
            raise InvalidBatch(
                f"entry {i} is a {type(e).__name__}; expected a BatchEntry(seq_id, position, num_tokens)"
            )
        problem = id_problem(e.seq_id)
        if problem:
            raise InvalidBatch(f"entry {i}: {problem}")
        if isinstance(e.position, bool) or not isinstance(e.position, int) or e.position < 0:
            raise InvalidBatch(
                f"entry {i} ({quote(e.seq_id)}): position must be an integer >= 0, got {quote(e.position)}"
            )
        if isinstance(e.num_tokens, bool) or not isinstance(e.num_tokens, int) or e.num_tokens < 1:
            raise InvalidBatch(
                f"entry {i} ({quote(e.seq_id)}): num_tokens must be an integer >= 1, got {quote(e.num_tokens)}"
            )
        if e.position + e.num_tokens > MAX_TOKENS:
            raise InvalidBatch(
                f"entry {i} ({quote(e.seq_id)}): position {e.position} + num_tokens {e.num_tokens} is past the"
                f" longest sequence served, {MAX_TOKENS} tokens"
            )
        if e.seq_id in seen:
            raise InvalidBatch(
                f"sequence {quote(e.seq_id)} appears twice in the batch; send each sequence once per call"
            )
        seen.add(e.seq_id)
    return sum(e.num_tokens for e in entries)


def check_tensor(name: str, t: object, shape: tuple[int, ...], meaning: str, dtype: torch.dtype | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTensor(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in torchtypes.WIRE_TORCH:
        raise InvalidTensor(f"{name} has dtype {t.dtype}; expected {_EXPECTED}")
    if dtype is not None and t.dtype != dtype:
        raise InvalidTensor(f"{name} has dtype {t.dtype}; expected q's dtype {dtype}")
    if t.shape != shape:
        raise InvalidTensor(f"{name} has shape {list(t.shape)}; expected {list(shape)} {meaning}")


def check_values(name: str, t: torch.Tensor, entries: Sequence[BatchEntry], compute: torch.dtype) -> None:
    """InvalidTensor naming the first row (its sequence and position) of ``t`` ([T, heads, head_size]) that
    holds a NaN, an infinity, or a value past the largest of the ``compute`` dtype (where it is narrower than
    ``t``'s it would become one). Attention over such a row gives no meaningful output (a NaN key or value
    poisons every later query of its chunk), so it is refused before anything is written."""
    dtype = torchtypes.OF_TORCH[compute]
    largest = dtype.max
    low, high = torch.aminmax(t)  # one pass; NaN propagates, and fails both comparisons
    if -largest <= low.item() and high.item() <= largest:  # Python floats: comparing tensors costs 3x as much
        return
    bad = ~(t.float().abs() <= largest)  # in float32: in t's own dtype ``largest`` may round to inf
    row = int(bad.flatten(1).any(1).nonzero()[0, 0])
    value = t[row][bad[row]][0].item()
    start, where = 0, ""
    for e in entries:  # none for a block-addressed call: its rows name no sequence
        if row < start + e.num_tokens:
            where = f" (sequence {quote(e.seq_id)} at position {e.position + row - start})"
            break
        start += e.num_tokens
    what = f"{value}" if not math.isfinite(value) else f"{value:g}, past {dtype.name}'s largest value {largest:g}"
    raise InvalidTensor(
        f"{name} row {row}{where} holds {what}; q, k and v must be finite numbers that the server's compute"
        f" dtype ({dtype.name}) can hold. Nothing was written"
    )


def check_tensors(
    model: ModelShape,
    layer: int,
    spec: LayerSpec,
    entries: Sequence[BatchEntry],
    total: int,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    compute: torch.dtype,
) -> None:
    """The call's tensors against the model (shapes, dtypes, presence) and their values (``check_values``:
    finite, within the ``compute`` dtype)."""
    check_tensor("q", q, (total, model.num_heads, model.head_size), "[tokens, num_heads, head_size]", None)
    if spec.kv_source is not None:
        if k is not None or v is not None:
            raise InvalidTensor(
                f"layer {layer} reads layer {spec.kv_source}'s KV cache (KV sharing) and writes none:"
                " send q only, without k and v"
            )
        check_values("q", q, entries, compute)
        return
    if k is None or v is None:
        raise InvalidTensor(f"layer {layer} writes its own KV cache: k and v are required")
    shape = (total, model.num_kv_heads, model.head_size)
    check_tensor("k", k, shape, "[tokens, num_kv_heads, head_size]", q.dtype)
    check_tensor("v", v, shape, "[tokens, num_kv_heads, head_size]", q.dtype)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_values(name, t, entries, compute)


def check_positions(
    layer: int, spec: LayerSpec, entries: Sequence[BatchEntry], states: Sequence[SequenceState | None]
) -> None:
    for e, state in zip(entries, states, strict=True):
        if state is None:
            if e.position != 0:
                raise UnknownSequence(
                    f"sequence {quote(e.seq_id)} does not exist; a new sequence starts at position 0,"
                    f" got position {e.position}"
                )
        elif e.position != state.lengths[layer]:
            have = state.lengths[layer]
            raise PositionMismatch(
                f"sequence {quote(e.seq_id)} has {have} tokens in layer {layer}, so its next position is"
                f" {have}; got position {e.position}"
            )
        source = spec.kv_source
        if source is not None:
            held = state.lengths[source] if state else 0
            if e.position + e.num_tokens > held:
                raise PositionMismatch(
                    f"layer {layer} reads layer {source}'s KV cache, which holds {held} tokens of sequence"
                    f" {quote(e.seq_id)}; positions up to {e.position + e.num_tokens - 1} need layer {source}"
                    " to be called first"
                )
