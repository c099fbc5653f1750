"""Checks of an engine's state that several engine tests share (the harness's ``snapshot`` is the other)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from chunkattn_server import Engine
from chunkattn_server.kv.manifest import BlockRecord


def owners_are_exact(engine: Engine) -> None:
    """Every block's owner count equals the number of block tables that hold it; used = distinct blocks."""
    held = Counter(
        b
        for s in engine.kv.sequence_ids(tenant="")
        for t in engine.kv.sequence(s, tenant="").tables
        for b in t.values()
    )
    assert engine.pool.num_used == len(held)
    for block, n in held.items():
        assert engine.pool.owners(block) == n, (block, n)


def poison(engine: Engine) -> None:
    """NaN in every free block of every plane, K and V (pages [Hkv, blocks, block_size, D]), so that a read of a
    block nobody wrote shows."""
    free = torch.tensor([b for b in range(engine.pool.num_blocks) if engine.pool.is_free(b)], dtype=torch.int64)
    if len(free):
        for pages in (*engine.cache.k, *engine.cache.v):
            pages.index_fill_(1, free, float("nan"))


def assert_no_nan(records: list[BlockRecord]) -> None:
    """No exported record's K or V (float32 bytes) holds a NaN: none read a poisoned block."""
    for r in records:
        for data in (r.k, r.v):
            assert not np.isnan(np.frombuffer(data, np.float32)).any(), f"record {r.layer, r.logical} carries NaN"
