"""``--verify N``: sampled calls recomputed with the float64 reference and compared (Verifier, and
SequenceCheck for one sampled sequence, EngineCheck for one engine's calls)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from chunkattn_client import codec
from chunkattn_client.batch import BatchEntry, BlockRows
from chunkattn_client.client import ServerInfo
from chunkattn_client.reference import BlockReference, ReferenceModel, as_cached, within_tolerance


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

    def reserve(self) -> bool:
        """One call of the budget (an engine's next call), or False when it is spent."""
        if self._unreserved <= 0:
            return False
        self._unreserved -= 1
        return True

    async def compare(
        self,
        layer: int,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        expect: Callable[[Any, Any, Any], Any],
        where: dict[str, Any],
        rows: Sequence[int] = (),
    ) -> None:
        """One call's answer ``out`` against ``expect(q64, k64, v64)`` (the reference, which records the call's
        K/V as the server's cache gives them back: float8 quantized), counted and, when off, kept (``where``).
        ``rows``: the tokens of each of its rows (a batch of several sequences), each judged on its own scale, so
        that a row of small outputs (a long decode) is not judged by a prefill's large ones beside it."""
        q64, k64, v64 = (None if x is None else codec.to_float64(x, self.dtype) for x in (q, k, v))
        if k64 is not None and v64 is not None:
            k_scale, v_scale = await self.scales(layer)
            k64 = as_cached(k64, self.info.cache_dtype, k_scale)
            v64 = as_cached(v64, self.info.cache_dtype, v_scale)
        want = await asyncio.to_thread(expect, q64, k64, v64)
        got = codec.to_float64(out, self.dtype)
        bounds = np.cumsum([0, *rows]) if rows else np.array([0, len(want)])
        judged = [within_tolerance(got[a:b], want[a:b], self.dtype) for a, b in itertools.pairwise(bounds.tolist())]
        ok, err = all(x for x, _ in judged), max((e for _, e in judged), default=0.0)
        self.checked += 1
        self.max_error = max(self.max_error, err)
        if not ok:
            self.mismatches.append(where | {"error": err})

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
        await self._v.compare(
            layer,
            q,
            k,
            v,
            out,
            lambda q64, k64, v64: self._ref.attend(layer, [entry], q64, k64, v64),
            {"seq_id": entry.seq_id, "layer": layer, "position": entry.position, "tokens": entry.num_tokens},
        )

    def truncate(self, seq_id: str, length: int) -> None:
        """The sequence was truncated on the server: the reference follows."""
        self._ref.truncate(seq_id, length)

    def finish(self) -> None:
        """The sequence ended: calls it reserved but did not check go back to the budget."""
        self._v.refund(self._left)
        self._left = 0


class EngineCheck:
    """The reference of one engine (the engine workload), for its calls from its first on while the run's budget
    lasts (``Verifier.reserve``): a block space's slots (``BlockReference``) or its sequences
    (``ReferenceModel``). It stops for good at the first call the budget does not cover, or that failed: a
    later call reads K/V the reference did not see."""

    def __init__(self, verifier: Verifier, api: str) -> None:
        self._v = verifier
        self._blocks = BlockReference(verifier.info) if api == "blocks" else None
        self._sequences = ReferenceModel.for_server(verifier.info) if api != "blocks" else None
        self.active = True

    def take(self) -> bool:
        """Whether the engine's next call is checked."""
        self.active = self.active and self._v.reserve()
        return self.active

    def stop(self) -> None:
        self.active = False

    async def check_blocks(self, engine: int, layer: int, rows: BlockRows, q: Any, k: Any, v: Any, out: Any) -> None:
        assert self._blocks is not None
        ref = self._blocks
        sizes = np.diff(np.asarray(rows.query_start_loc)).tolist()
        where = {"engine": engine, "layer": layer, "rows": len(sizes), "tokens": len(q)}
        await self._v.compare(
            layer, q, k, v, out, lambda q64, k64, v64: ref.attend(layer, rows, q64, k64, v64), where, sizes
        )

    async def check_entries(
        self, engine: int, layer: int, entries: list[BatchEntry], q: Any, k: Any, v: Any, out: Any
    ) -> None:
        assert self._sequences is not None
        ref = self._sequences
        where = {"engine": engine, "layer": layer, "rows": len(entries), "tokens": len(q)}
        sizes = [e.num_tokens for e in entries]
        await self._v.compare(
            layer, q, k, v, out, lambda q64, k64, v64: ref.attend(layer, entries, q64, k64, v64), where, sizes
        )

    def release(self, seq_id: str) -> None:
        """A sequence the engine released (finished or preempted): the reference forgets it too."""
        if self._sequences is not None:
            self._sequences.release(seq_id)
