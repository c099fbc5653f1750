"""An engine and the float64 reference side by side: every call runs on both and is compared."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from chunkattn_client import BatchEntry, ReferenceModel, dtypes
from chunkattn_client.reference import within_tolerance
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape, torchtypes
from chunkattn_server.attention.backends import AttentionBatch, Backend, TorchBackend
from chunkattn_server.attention.backends.native import build as native_build
from chunkattn_server.attention.backends.native.backend import NativeBackend
from chunkattn_server.attention.backends.triton_backend import TritonBackend
from chunkattn_server.kv.records import Truncation
from chunkattn_server.kv.scales import KVScales


def _native_problem() -> str:
    try:
        native_build.load()
    except native_build.NativeUnavailable as e:
        return str(e)
    return ""


NATIVE_PROBLEM = _native_problem()
# The native backend where its kernels build here (CI builds them); elsewhere its cases skip, saying why.
NATIVE = pytest.param(
    "native",
    marks=[pytest.mark.native, pytest.mark.skipif(bool(NATIVE_PROBLEM), reason=NATIVE_PROBLEM or "built")],
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Small models that between them cover GQA, MQA, MHA, ALiBi, global layers and KV sharing.
# Block size 4 everywhere, so chunks are 2-4 blocks and boundaries come often.
MODELS: dict[str, ModelShape] = {
    "gqa": ModelShape(
        num_heads=8,
        num_kv_heads=2,
        head_size=16,
        layers=(LayerSpec(8), LayerSpec(8), LayerSpec(0), LayerSpec(16), LayerSpec(16), LayerSpec(0)),
    ),
    "mqa": ModelShape(num_heads=4, num_kv_heads=1, head_size=8, layers=(LayerSpec(4), LayerSpec(0))),
    "alibi": ModelShape(
        num_heads=2,
        num_kv_heads=2,
        head_size=8,
        layers=(
            LayerSpec(8, alibi_slopes=(0.5, 0.125)),
            LayerSpec(0, alibi_slopes=(0.25, 0.0625), scale=0.3),
        ),
    ),
    "sharing": ModelShape(
        num_heads=4,
        num_kv_heads=2,
        head_size=8,
        layers=(LayerSpec(8), LayerSpec(8, kv_source=0), LayerSpec(0), LayerSpec(0, kv_source=2)),
    ),
}


@dataclass
class Harness:
    """Runs calls on an engine and on the reference, with reproducible random q/k/v.

    dtype: what q/k/v travel in; the engine computes in its compute dtype and stores in its cache dtype
    (float8: over per-layer scales), and the reference sees the inputs as the engine holds them: q in the
    compute dtype, k/v as the cache gives them back (``expected_kv``)."""

    engine: Engine
    reference: ReferenceModel
    dtype: str
    cache_dtype: str
    seed: int = 0
    spread: float = 1.0  # the standard deviation of random k/v (large values test float8 saturation)

    @classmethod
    def build(
        cls,
        model: ModelShape,
        *,
        dtype: str = "float32",
        cache_dtype: str | None = None,
        compute_dtype: str = "auto",
        kv_scales: KVScales | None = None,
        spec_window: int = 0,
        num_blocks: int = 512,
        block_size: int = 4,
        impl: str = "auto",
        min_view_tokens: int = 64,
        max_views: int = 8,
        splits: int = 1,
    ) -> Harness:
        """impl: the torch backend's "auto" or "math" path, "native" (its decodes in the native kernel), or
        "triton" (the kernels under the interpreter, with ``splits`` decode splits and 16 keys per inner step,
        so short contexts take several)."""
        cache_dtype = cache_dtype or dtype
        cache = CacheConfig(
            block_size=block_size, num_blocks=num_blocks, dtype=cache_dtype, scales=kv_scales, spec_window=spec_window
        )
        config = EngineConfig(model, cache, device="cpu", dtype=compute_dtype)
        backend: Backend
        if impl == "triton":
            backend = TritonBackend(torch.device("cpu"), block_n=16, num_splits=splits)
        elif impl == "native":
            backend = NativeBackend(torch.device("cpu"))
        else:
            backend = TorchBackend(torch.device("cpu"), impl=impl, min_view_tokens=min_view_tokens, max_views=max_views)  # type: ignore[arg-type]
        reference = ReferenceModel(
            [s.chunk_size for s in model.layers],
            kv_sources=[s.kv_source for s in model.layers],
            scales=[s.scale for s in model.layers],
            alibi_slopes=[s.alibi_slopes for s in model.layers],
        )
        return cls(Engine(config, backend=backend), reference, dtype, dtypes.lookup(cache_dtype).name)

    @property
    def model(self) -> ModelShape:
        return self.engine.config.model

    def tensors(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Random q [T, H, D] and k, v [T, Hkv, D] in the harness dtype (k, v None for a KV-sharing layer)."""
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        m = self.model
        dt = DTYPES[self.dtype]
        q = torch.randn(tokens, m.num_heads, m.head_size, generator=g).to(dt)
        if m.layers[layer].kv_source is not None:
            return q, None, None
        k = (torch.randn(tokens, m.num_kv_heads, m.head_size, generator=g) * self.spread).to(dt)
        v = (torch.randn(tokens, m.num_kv_heads, m.head_size, generator=g) * self.spread).to(dt)
        return q, k, v

    def call(self, layer: int, entries: Sequence[BatchEntry]) -> torch.Tensor:
        """One call on both; asserts the engine matches the reference within the dtype's tolerance."""
        q, k, v = self.tensors(layer, sum(e.num_tokens for e in entries))
        out = self.engine.attend(layer, entries, q, k, v, tenant="")
        assert out.dtype == q.dtype
        assert out.shape == q.shape
        kr, vr = (None, None) if k is None or v is None else self.expected_kv(layer, k, v)
        expected = self.reference.attend(layer, entries, self._computed(q), kr, vr)
        ok, err = within_tolerance(out.double().numpy(), expected, self.tolerance)
        assert ok, f"layer {layer}, entries {list(entries)}: error {err:.3g} ({self.dtype}, cache {self.cache_dtype})"
        return out

    @property
    def compute_dtype(self) -> str:
        return torchtypes.OF_TORCH[self.engine.dtype].name

    @property
    def tolerance(self) -> str:
        """The dtype whose tolerance applies: the coarsest the values went through (a float8 cache's error is
        in ``expected_kv``, not in the tolerance)."""
        seen = [self.dtype, self.compute_dtype] + ([] if dtypes.lookup(self.cache_dtype).fp8 else [self.cache_dtype])
        return max(seen, key=["float32", "float16", "bfloat16"].index)

    def _computed(self, t: torch.Tensor) -> npt.NDArray[np.float64]:
        return t.to(self.engine.dtype).double().numpy()

    def expected_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """k, v as the layer's cache gives them back, float64, computed with numpy (not the engine's torch
        code): in the compute dtype, then divided by the layer's scale in float32, rounded to float8 (ties to
        even, saturated) and multiplied back; or rounded to a float cache dtype."""
        d = dtypes.lookup(self.cache_dtype)
        k_c, v_c = self._computed(k), self._computed(v)
        if not d.fp8:
            return k.to(DTYPES[d.name]).double().numpy(), v.to(DTYPES[d.name]).double().numpy()
        scales = self.engine.scales.of(layer)
        assert scales is not None, "the call has calibrated the layer"

        def cached(x: npt.NDArray[np.float64], scale: float) -> npt.NDArray[np.float64]:
            stored = x.astype(np.float32) / np.float32(scale)  # float32, as the engine divides
            return dtypes.fp8_round(stored, d.name) * np.float64(np.float32(scale))

        return cached(k_c, scales[0]), cached(v_c, scales[1])

    def step(self, entries: Sequence[BatchEntry]) -> None:
        """The same batch through every layer in order, as a model runner does."""
        for layer in range(self.model.num_layers):
            self.call(layer, entries)

    def truncate(self, seq_id: str, length: int) -> Truncation:
        """Truncate on both."""
        done = self.engine.kv.truncate(seq_id, length, tenant="")
        self.reference.truncate(seq_id, length)
        return done

    def release(self, *seq_ids: str) -> None:
        self.engine.kv.release(seq_ids, tenant="")
        for s in seq_ids:
            self.reference.release(s)


def snapshot(engine: Engine) -> Any:
    """Everything a request could change: lengths and block tables of every sequence, the pool."""
    seqs = {s: engine.kv.sequence(s, tenant="") for s in engine.kv.sequence_ids(tenant="")}
    return (
        {s: (i.lengths, i.tables, i.kept_from) for s, i in seqs.items()},
        engine.stats(),
        sorted(b for b in range(engine.pool.num_blocks) if engine.pool.is_free(b)),
    )


class Exploding(TorchBackend):
    """A backend that writes K/V, then fails in attention, as a device error mid-call would."""

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        raise RuntimeError("device fell over")
