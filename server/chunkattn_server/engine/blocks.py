"""The block API's calls on the engine (see kv/spaces.py and the proto's BlockBatch).

A call is checked against its space before anything is written: every row's query range, key count and
block table entries, every slot, inside the space and within int64 arithmetic, and every written slot where
its row's table puts that token; then its work (chunkattn_client.work) against the engine's bound. Then the
space blocks it touches that are still stale are zeroed (a space is not zeroed when it opens), its K/V are
written at its slots (a KV-sharing layer's are read back from its source's writes), and each row is plain
causal attention of its queries over its keys: the older ones through its block table, its new ones as this
call's rows; a row with a padding token (not written) reads all its new keys from the call (decided per row,
so one call's padding never changes how another's rows are computed). The layer's chunk size is not
applied; the caller windows (vLLM's virtual batches give a chunked layer's rows one chunk each). The calls of
one step that share a plane of the pages run in one backend call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from chunkattn_client import work
from chunkattn_client.limits import MAX_BATCH
from chunkattn_server.attention.backends import AttentionBatch
from chunkattn_server.engine import checks
from chunkattn_server.engine.types import BlockCall
from chunkattn_server.errors import InvalidBatch, PositionMismatch
from chunkattn_server.kv.spaces import BlockSpace

if TYPE_CHECKING:
    from chunkattn_server.engine.core import Engine


@dataclass
class _Plan:
    """A checked call: its pages' plane, each space block's pool block for its layer [num_blocks] int64, per
    row its new tokens (q_len) and the blocks its keys take, and the space blocks it reads or writes."""

    call: BlockCall
    space: BlockSpace
    plane: int
    pool: np.ndarray
    q_lens: np.ndarray
    blocks: np.ndarray
    touched: np.ndarray


def check_rows(call: BlockCall, num_blocks: int, block_size: int, *, reads_back: bool) -> tuple[np.ndarray, np.ndarray]:
    """InvalidBatch naming the field of the first index outside the space or inconsistent with the others;
    else per row its q_len and the blocks its keys take (ceil(seq_len / block_size)), int64 [R]."""
    tokens = int(call.q.shape[0])
    starts, seq_lens, tables, slots = call.starts, call.seq_lens, call.tables, call.slots
    rows = len(seq_lens)
    if not 1 <= rows <= MAX_BATCH:
        raise InvalidBatch(f"seq_lens has {rows} rows; a block batch has 1 .. {MAX_BATCH}")
    if len(starts) != rows + 1:
        raise InvalidBatch(f"query_start_loc has {len(starts)} entries; expected one more than the rows ({rows + 1})")
    if starts[0] != 0 or starts[-1] != tokens:
        raise InvalidBatch(
            f"query_start_loc runs from {starts[0]} to {starts[-1]}; expected 0 to q's tokens ({tokens})"
        )
    q_lens = np.diff(starts)
    _first("query_start_loc", q_lens < 0, "decreases: each row's start must be >= the previous row's", offset=1)
    _first("seq_lens", seq_lens < q_lens, "is less than its row's q_len: a row's new tokens are among its keys")
    if tables.ndim != 2 or tables.shape[0] != rows:
        raise InvalidBatch(f"block_table has shape {list(tables.shape)}; expected [{rows} rows, block_table_width]")
    blocks = -(-seq_lens // block_size)
    _first(
        "seq_lens",
        blocks > tables.shape[1],
        f"needs more blocks of {block_size} tokens than block_table_width ({tables.shape[1]}) holds",
    )
    # A row's keys fit in its space: repeated table entries must not make a 1-block space read millions of keys.
    _first(
        "seq_lens",
        blocks > num_blocks,
        f"needs more blocks of {block_size} tokens than the space holds ({num_blocks})",
    )
    if tables.shape[1]:
        used = np.arange(tables.shape[1]) < blocks[:, None]
        outside = used & ((tables < 0) | (tables >= num_blocks))
        if outside.any():
            r, j = (int(x) for x in np.argwhere(outside)[0])
            raise InvalidBatch(
                f"block_table row {r} entry {j} is {tables[r, j]}; the space's blocks are 0 .. {num_blocks - 1}"
            )
    if len(slots) != tokens:
        raise InvalidBatch(f"slot_mapping has {len(slots)} entries; expected one per token of q ({tokens})")
    last = num_blocks * block_size - 1
    _first("slot_mapping", slots > last, f"is past the space's last slot ({last})")
    if reads_back:
        _first(
            "slot_mapping",
            slots < 0,
            "is negative: a KV-sharing layer reads each new token's K/V back at its slot, where its source wrote it",
        )
    _check_slots(slots, starts, seq_lens, tables, block_size)
    return q_lens, blocks


def _check_slots(
    slots: np.ndarray, starts: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray, block_size: int
) -> None:
    """InvalidBatch unless every written token's slot is where its row's block table puts it, and no two share
    one: a row's new tokens are its last q_len keys, so the key it reads at position p of the row is the one
    written at ``tables[r, p // block_size] * block_size + p % block_size``. A slot elsewhere would make the
    row read whatever that position holds instead of this request's k (vLLM's slot_mapping is always this).

    Worked example, block_size 4: a row with seq_len 6, q_len 2 and table [7, 2] has new tokens at positions 4
    and 5, in block 2 at offsets 0 and 1: slots 8 and 9 (or -1, padding: not written)."""
    row = np.repeat(np.arange(len(seq_lens)), np.diff(starts))  # [T] each token's row
    position = work.keys_seen(starts, seq_lens) - 1  # [T] its key's position in its row
    where = tables[row, position // block_size] * block_size + position % block_size if len(row) else row
    wrong = (slots >= 0) & (slots != where)
    if wrong.any():
        t = int(np.argmax(wrong))
        r, p = int(row[t]), int(position[t])
        raise InvalidBatch(
            f"slot_mapping[{t}] is {slots[t]}; token {t} is key {p} of row {r}, which block_table row {r} puts in"
            f" slot {where[t]} (block {tables[r, p // block_size]}, offset {p % block_size}): write each row's new"
            " tokens where its block table puts them (-1: a padding token, not written)"
        )
    written = slots[slots >= 0]
    if len(np.unique(written)) != len(written):
        order = np.argsort(slots, kind="stable")
        ordered = slots[order]
        dup = np.flatnonzero((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0))[0]
        first, again = sorted((int(order[dup]), int(order[dup + 1])))
        raise InvalidBatch(
            f"slot_mapping[{again}] is {slots[again]}, the slot of token {first} too: each new token has a slot of"
            " its own"
        )


def _first(field: str, bad: np.ndarray, problem: str, offset: int = 0) -> None:
    if bad.any():
        i = int(np.argmax(bad)) + offset
        raise InvalidBatch(f"{field}[{i}] {problem}")


def attend_step(engine: Engine, layer: int, calls: Sequence[BlockCall]) -> list[torch.Tensor | Exception]:
    """Per call its output ([T_i, num_heads, head_size] in its q's dtype) or the error it fails with alone
    (a call refused by its checks wrote nothing); calls that share a plane of the pages are computed
    together. An error that is not a call's own (a backend failure, after the calls' K/V were written at
    their slots) fails every call of its plane."""
    engine.config.model.spec(layer)  # UnknownLayer for the whole step, as the sequence path raises it
    results: list[torch.Tensor | Exception] = [RuntimeError("not served")] * len(calls)
    by_plane: dict[int, list[tuple[int, _Plan, torch.Tensor, torch.Tensor]]] = {}
    for i, call in enumerate(calls):
        try:
            p = _plan(engine, layer, call)
            kc, vc = _store(engine, layer, p)
        except Exception as e:  # an EngineError; anything else is a bug, and still this call's alone
            results[i] = e
            continue
        by_plane.setdefault(p.plane, []).append((i, p, kc, vc))
    for plane, members in by_plane.items():
        try:
            outs = _compute(engine, layer, plane, members)
        except Exception as e:
            for i, *_ in members:
                results[i] = e
            continue
        now = time.monotonic()
        for (i, p, _, _), out in zip(members, outs, strict=True):
            results[i] = out if out.dtype == p.call.q.dtype else out.to(p.call.q.dtype)
            p.space.last_used = now  # used until the call's end: its lease runs from here
    return results


def _plan(engine: Engine, layer: int, call: BlockCall) -> _Plan:
    model, spec = engine.config.model, engine.config.model.spec(layer)
    space = engine.kv.spaces.get(call.space_id, tenant=call.tenant)
    tokens = int(call.q.shape[0]) if call.q.dim() else 0
    if tokens < 1:
        raise InvalidBatch("q has no tokens; a block batch brings at least one new token")
    checks.check_tensors(model, layer, spec, (), tokens, call.q, call.k, call.v, engine.dtype, engine.cache_dtype)
    q_lens, blocks = check_rows(call, space.num_blocks, engine.block_size, reads_back=spec.kv_source is not None)
    if engine.max_call_work:
        checks.check_work(int(work.token_work(call.starts, call.seq_lens).sum()), engine.max_call_work)
    if call.k is not None and call.v is not None and engine.scales.calibrating(layer):
        engine.check_calibration(engine.on_device(call.k), engine.on_device(call.v))
    if spec.kv_source is not None and engine.scales.calibrating(spec.kv_source):
        raise PositionMismatch(
            f"layer {layer} reads layer {spec.kv_source}'s KV cache (KV sharing), which has had no write yet:"
            f" call layer {spec.kv_source} first"
        )
    planes = engine.config.group_size
    p = space.layer_planes[layer]
    used = np.arange(call.tables.shape[1]) < blocks[:, None]
    touched = np.concatenate([call.tables[used], call.slots[call.slots >= 0] // engine.block_size])
    return _Plan(call, space, p % planes, space.blocks[:, p // planes], q_lens, blocks, touched)


def _slots(p: _Plan, bs: int) -> np.ndarray:
    """The pool slots of the call's slots (all of them; a negative one stays negative)."""
    slots = p.call.slots
    physical = p.pool[np.where(slots >= 0, slots, 0) // bs] * bs + slots % bs
    return np.where(slots >= 0, physical, -1)


def _store(engine: Engine, layer: int, p: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the call's K/V at its slots (a KV-sharing layer: read them back there); returns them as the
    cache holds them, in the compute dtype."""
    spec = engine.config.model.spec(layer)
    engine.cache.zero_blocks(p.space.take_stale(p.touched))  # first touch: no previous owner's bytes show
    slots = _slots(p, engine.block_size)
    call = p.call
    if call.k is None or call.v is None:
        source = layer if spec.kv_source is None else spec.kv_source
        return engine.cache.read(p.plane, engine.index(slots), engine.read_scales(source), engine.dtype)
    k, v = engine.on_device(call.k), engine.on_device(call.v)
    scales = engine.write_scales(layer, k, v)
    written = slots >= 0
    if written.all():
        return engine.cache.write(p.plane, engine.index(slots), k, v, scales)
    rows = np.flatnonzero(written)
    return engine.cache.write(p.plane, engine.index(slots[rows]), k, v, scales, engine.index(rows))


def _compute(
    engine: Engine, layer: int, plane: int, members: list[tuple[int, _Plan, torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """One backend call over the calls' rows; per call its output [T_i, H, D] in the compute dtype."""
    spec = engine.config.model.spec(layer)
    source = layer if spec.kv_source is None else spec.kv_source
    spans: list[tuple[int, int, int]] = []
    tables: list[np.ndarray] = []  # per row: its keys' pool blocks, by logical block
    sizes: list[int] = []
    base = 0
    unwritten: set[int] = set()
    for _, p, _, _ in members:
        starts, seq_lens, table = p.call.starts, p.call.seq_lens, p.call.tables
        negative = np.concatenate([[0], np.cumsum(p.call.slots < 0)])
        padded = negative[starts[1:]] > negative[starts[:-1]]  # [R] rows with a token not written
        for r in np.flatnonzero(p.q_lens):
            n = int(p.q_lens[r])
            if padded[r]:  # some of its new tokens were not written: it reads them from this call's k and v
                unwritten.add(len(spans))
            spans.append((base + int(starts[r]), int(seq_lens[r]) - n, n))
            tables.append(p.pool[table[r, : p.blocks[r]]])
        sizes.append(int(p.call.q.shape[0]))
        base += sizes[-1]
    one = len(members) == 1
    q = engine.on_device(members[0][1].call.q) if one else torch.cat([engine.on_device(m[1].call.q) for m in members])
    k = members[0][2] if one else torch.cat([m[2] for m in members])
    v = members[0][3] if one else torch.cat([m[3] for m in members])
    k_scale, v_scale = engine.read_scales(source)
    out = torch.empty(q.shape, dtype=engine.dtype, device=engine.device)
    if spans:
        batch = AttentionBatch(
            q=q,
            k=k,
            v=v,
            k_pages=engine.cache.k[plane],
            v_pages=engine.cache.v[plane],
            spans=spans,
            tables=tables,
            chunk_size=0,
            block_size=engine.block_size,
            scale=engine.scale(layer),
            alibi_slopes=engine.slopes(layer),
            k_scale=k_scale,
            v_scale=v_scale,
            unwritten=frozenset(unwritten),
        )
        engine.backend.attend(batch, out)
    if one:
        return [out]
    parts, row = [], 0
    for n in sizes:
        parts.append(out[row : row + n])
        row += n
    return parts
