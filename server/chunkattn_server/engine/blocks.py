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

import numpy as np

from chunkattn_client import work
from chunkattn_client.limits import MAX_BATCH
from chunkattn_server.engine.types import BlockCall, Planned
from chunkattn_server.errors import InvalidBatch
from chunkattn_server.kv.spaces import SpaceState


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


def plan(call: BlockCall, space: SpaceState, layer: int, source: int, block_size: int) -> tuple[Planned, np.ndarray]:
    """A block call of ``layer`` (whose K/V are ``source``'s: itself, or a KV-sharing layer's source) in the
    engine's one form (types.Planned), checked against its space (``check_rows``): each row with new tokens
    is a span whose earlier keys are read through its table, in the layer's pool blocks; its slots in the
    pool. Also the space blocks it reads or writes [n] int64 (the stale ones among them are zeroed before its
    write). Pure: nothing changes."""
    q_lens, blocks = check_rows(call, space.num_blocks, block_size, reads_back=source != layer)
    plane, pool = space.pages(layer)
    starts, seq_lens, table = call.starts, call.seq_lens, call.tables
    spans: list[tuple[int, int, int]] = []
    tables: list[np.ndarray] = []  # per row: its keys' pool blocks, by logical block
    for r in np.flatnonzero(q_lens):
        n = int(q_lens[r])
        spans.append((int(starts[r]), int(seq_lens[r]) - n, n))
        tables.append(pool[table[r, : blocks[r]]])
    used = np.arange(table.shape[1]) < blocks[:, None]
    touched = np.concatenate([table[used], call.slots[call.slots >= 0] // block_size])
    planned = Planned(
        q=call.q,
        k=call.k,
        v=call.v,
        plane=plane,
        source=source,
        slots=space.pool_slots(layer, call.slots, block_size),
        spans=spans,
        tables=tables,
        chunk_size=0,
        stored=bool((call.slots >= 0).all()),
    )
    return planned, touched
