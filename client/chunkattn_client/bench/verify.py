"""``--verify N``: sampled calls recomputed with the float64 reference and compared (Verifier, and
SequenceCheck for one sampled sequence)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from chunkattn_client import codec
from chunkattn_client.batch import BatchEntry
from chunkattn_client.client import ServerInfo
from chunkattn_client.reference import ReferenceModel, as_cached, within_tolerance


class Verifier:
    """Recomputes sampled calls with the float64 reference and compares (``--verify N``).

    From the start of the run, each new sequence is sampled with probability 1/2 (seeded) until N
    calls are reserved; a sampled sequence has its first calls checked, keeping their K/V in its own
    ReferenceModel. A sampled sequence that is cut or fails hands its unchecked calls back.
    """

    def __init__(
        self,
        info: ServerInfo,
        dtype: str,
        budget: int,
        seed: int,
        refresh: Callable[[], Awaitable[ServerInfo]] | None = None,
    ) -> None:
        self.info, self.dtype = info, dtype
        self._refresh = refresh
        self.requested = budget
        self._unreserved = budget
        self._rng = random.Random(seed)
        self.checked = 0
        self.max_error = 0.0
        self.mismatches: list[dict[str, Any]] = []

    async def scales(self, layer: int) -> tuple[float, float]:
        """The layer's float8 cache scales (k, v); a server that calibrates them reports 0 until the layer's
        first write, so Info is read again then (``refresh``)."""
        x = self.info.layers[layer]
        if x.k_scale == 0 and self._refresh is not None:
            self.info = await self._refresh()
            x = self.info.layers[layer]
        return x.k_scale, x.v_scale

    def sample(self, num_calls: int) -> SequenceCheck | None:
        if self._unreserved <= 0 or self._rng.random() >= 0.5:
            return None
        n = min(num_calls, self._unreserved)
        self._unreserved -= n
        return SequenceCheck(self, n)

    def refund(self, calls: int) -> None:
        self._unreserved += calls

    def result(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "checked": self.checked,
            "complete": self.checked >= self.requested,
            "mismatches": len(self.mismatches),
            "max_error": self.max_error,
            "first_mismatches": self.mismatches[:5],
        }


class SequenceCheck:
    """The reference of one sampled sequence, for its first ``calls`` calls."""

    def __init__(self, verifier: Verifier, calls: int) -> None:
        self._v = verifier
        self._left = calls
        self._ref = ReferenceModel.for_server(verifier.info)

    async def check(self, layer: int, entry: BatchEntry, q: Any, k: Any, v: Any, out: Any) -> None:
        if self._left <= 0:
            return
        self._left -= 1
        dtype = self._v.dtype
        q64, k64, v64 = (None if x is None else codec.to_float64(x, dtype) for x in (q, k, v))
        assert q64 is not None
        if k64 is not None and v64 is not None:  # what the server's cache gives back (float8: quantized)
            k_scale, v_scale = await self._v.scales(layer)
            k64 = as_cached(k64, self._v.info.cache_dtype, k_scale)
            v64 = as_cached(v64, self._v.info.cache_dtype, v_scale)
        want = await asyncio.to_thread(self._ref.attend, layer, [entry], q64, k64, v64)
        ok, err = within_tolerance(codec.to_float64(out, dtype), want, dtype)
        self._v.checked += 1
        self._v.max_error = max(self._v.max_error, err)
        if not ok:
            self._v.mismatches.append(
                {"seq_id": entry.seq_id, "layer": layer, "position": entry.position, "tokens": entry.num_tokens}
                | {"error": err}
            )

    def truncate(self, seq_id: str, length: int) -> None:
        """The sequence was truncated on the server: the reference follows."""
        self._ref.truncate(seq_id, length)

    def finish(self) -> None:
        """The sequence ended: calls it reserved but did not check go back to the budget."""
        self._v.refund(self._left)
        self._left = 0
