"""A sequence's calls with seeded data, for the deployment tests (tests/deploy/): replaying a seed gives the same
tensors, so a session through Envoy can be compared with one sent directly, bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from chunkattn_client import BatchEntry, ChunkAttnClient
from tests.helpers.tensors import qkv


class Session:
    """One sequence's calls, every layer per step, with seeded data: replaying a seed gives the same tensors."""

    def __init__(self, client: ChunkAttnClient, seq_id: str, seed: int, length: int = 0) -> None:
        self.client, self.seq_id, self.length = client, seq_id, length
        self.info = client.info()
        self.rng = np.random.default_rng(seed)

    def step(self, n: int, layers: Sequence[int] | None = None) -> list[np.ndarray[Any, Any]]:
        info, outs = self.info, []
        for layer in range(len(info.layers)) if layers is None else layers:
            q, k, v = qkv(self.rng, n, heads=info.num_heads, kv_heads=info.num_kv_heads, head_size=info.head_size)
            outs.append(self.client.attend(layer, [BatchEntry(self.seq_id, self.length, n)], q, k, v))
        self.length += n
        return outs
