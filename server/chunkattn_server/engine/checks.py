"""A call's own checks, before anything changes: its metadata, its tensors against the model, their values
(finite, within the compute dtype and the value bounds), its positions against its sequences' state, its work
(chunkattn_client.work) against the engine's bound. Each raises the EngineError (InvalidBatch, InvalidTensor,
UnknownSequence, PositionMismatch) the call fails with, merged into a step with others or alone."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chunkattn_client import dtypes, work
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


def check_values(
    name: str,
    t: torch.Tensor,
    entries: Sequence[BatchEntry],
    compute: torch.dtype,
    limit: float = math.inf,
    why: str = "",
) -> None:
    """InvalidTensor naming the first row (its sequence and position) of ``t`` ([T, heads, head_size]) that
    holds a NaN, an infinity, a value past the largest of the ``compute`` dtype (where it is narrower than
    ``t``'s it would become one), or one past ``limit`` in magnitude, ``why`` saying why such values are
    refused. Attention over such a row gives no meaningful output (a NaN key or value poisons every later
    query of its chunk), so it is refused before anything is written."""
    dtype = torchtypes.OF_TORCH[compute]
    largest = min(dtype.max, limit)
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
    if not math.isfinite(value):
        what = f"{value}"
    elif abs(value) > dtype.max:
        what = f"{value:g}, past {dtype.name}'s largest value {dtype.max:g}"
    else:
        what = f"{value:g}, past {limit:g} (2^{int(math.log2(limit))}), the largest |{name}| {why}"
    raise InvalidTensor(
        f"{name} row {row}{where} holds {what}; q, k and v must be finite numbers within the bounds the server"
        f" documents (server.md, limits) that its compute dtype ({dtype.name}) can hold. Nothing was written"
    )


@dataclass(frozen=True)
class Bounds:
    """A layer's value bounds, the same for every call (built once per layer: ``bounds``): per tensor the largest
    |x| it takes and why (check_values' ``limit`` and ``why``)."""

    q: tuple[float, str]
    k: tuple[float, str]
    v: tuple[float, str]


def bounds(model: ModelShape, layer: int, compute: torch.dtype, cache: torch.dtype) -> Bounds:
    """The layer's value limits (config.ModelShape.value_limits: larger finite values could overflow attention's
    float32 scores or sums) and, for k and v, what the ``cache`` dtype stores (``storable``)."""
    qk, v_limit = model.value_limits(layer)
    overflow = "this layer takes (larger values could overflow attention's scores or sums)"
    held = torchtypes.storable(cache, compute)
    kept = f"the server's {torchtypes.OF_TORCH[cache].name} KV cache holds and gives back finite"
    return Bounds(
        q=(qk, overflow),
        k=(min(qk, held), overflow if qk <= held else kept),
        v=(min(v_limit, held), overflow if v_limit <= held else kept),
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
    cache: torch.dtype,
    limits: Bounds | None = None,
) -> None:
    """The call's tensors against the model (shapes, dtypes, presence) and their values (``check_values``:
    finite, within the ``compute`` dtype and the layer's ``bounds``; ``limits``: those, built once by the
    caller, or None to build them now)."""
    check_tensor("q", q, (total, model.num_heads, model.head_size), "[tokens, num_heads, head_size]", None)
    limits = limits or bounds(model, layer, compute, cache)
    if spec.kv_source is not None:
        if k is not None or v is not None:
            raise InvalidTensor(
                f"layer {layer} reads layer {spec.kv_source}'s KV cache (KV sharing) and writes none:"
                " send q only, without k and v"
            )
        check_values("q", q, entries, compute, *limits.q)
        return
    if k is None or v is None:
        raise InvalidTensor(f"layer {layer} writes its own KV cache: k and v are required")
    shape = (total, model.num_kv_heads, model.head_size)
    check_tensor("k", k, shape, "[tokens, num_kv_heads, head_size]", q.dtype)
    check_tensor("v", v, shape, "[tokens, num_kv_heads, head_size]", q.dtype)
    check_values("q", q, entries, compute, *limits.q)
    check_values("k", k, entries, compute, *limits.k)
    check_values("v", v, entries, compute, *limits.v)


def check_work(done: int, limit: int) -> None:
    """InvalidBatch when the call asks for more than ``limit`` work (chunkattn_client.work: query-key pairs,
    and PIECE_WORK per piece computed apart): EngineConfig.max_call_work, the server's --max-call-work."""
    if done > limit:
        raise InvalidBatch(
            f"the call's work is {done:,} (the keys each new token sees, plus {work.PIECE_WORK:,} for each piece"
            f" computed apart); this server takes at most {limit:,} per call (--max-call-work, Info's"
            " max_call_work), so that no call holds the engine long while others wait: send fewer tokens or rows"
            " per call"
        )


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
