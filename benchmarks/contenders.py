"""Ours in the engine benchmarks (engine.py, vllm_kernel.py): one engine per attention backend, torch and native
(where its kernels build here), made, prefilled and stepped alike, so that every row races them side by side."""

from __future__ import annotations

import torch

from chunkattn_client import BatchEntry
from chunkattn_server import CacheConfig, Engine, EngineConfig, LayerSpec, ModelShape
from chunkattn_server.attention.backends import AttentionBatch, Backend, TorchBackend
from chunkattn_server.attention.backends.native.backend import NativeBackend
from chunkattn_server.attention.backends.native.build import NativeUnavailable
from chunkattn_server.kv.scales import KVScales

CPU = torch.device("cpu")


def backends() -> tuple[tuple[str, ...], str | None]:
    """The backends to race on this machine: ("torch", "native"); or ("torch",) and why native is unavailable
    (its first use here builds it: ~30 s)."""
    try:
        NativeBackend(CPU)
    except NativeUnavailable as e:
        return ("torch",), str(e)
    return ("torch", "native"), None


def engine(
    backend: str,
    *,
    chunk: int,
    heads: tuple[int, int],
    head_size: int,
    num_blocks: int,
    dtype: str,
    block_size: int,
    cache_dtype: str = "auto",
    scales: KVScales | None = None,
) -> Engine:
    """One layer of chunk size ``chunk`` on ``backend`` ("torch" or "native", named: the engine's "auto" is
    native on the CPU); ``dtype`` computes, ``cache_dtype`` ("auto": the same) is stored, a float8 cache over
    ``scales``."""
    model = ModelShape(num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, layers=(LayerSpec(chunk),))
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, dtype=cache_dtype, scales=scales)
    chosen: Backend = NativeBackend(CPU) if backend == "native" else TorchBackend(CPU)
    return Engine(EngineConfig(model, cache, device="cpu", dtype=dtype), backend=chosen)


class _WriteOnly(TorchBackend):
    """Set-up only: lets the engine write a long context's K/V without computing attention nobody times."""

    name = "write-only"

    def attend(self, batch: AttentionBatch, out: torch.Tensor) -> None:
        out.zero_()


def prefill(engine: Engine, k: torch.Tensor, v: torch.Tensor, piece: int) -> None:
    """Write k, v [B, T, Hkv, D] as the first T tokens of sequences s0 .. s{B-1}, sent interleaved in pieces of
    ``piece`` tokens (B prompts arriving together, as a server sees them: the allocator's layout), through the
    engine's own write path; the attention of those calls is not computed."""
    seqs, tokens = k.shape[:2]
    q = torch.zeros(piece, engine.config.model.num_heads, k.shape[3], dtype=k.dtype)
    backend = engine.backend  # the cache's writer stays the engine's own backend's (bound at construction)
    engine.backend = _WriteOnly(engine.device)
    try:
        for start in range(0, tokens, piece):
            rows = slice(start, min(tokens, start + piece))
            n = rows.stop - start
            for i in range(seqs):
                engine.attend(0, [BatchEntry(f"s{i}", start, n)], q[:n], k[i, rows], v[i, rows], tenant="")
    finally:
        engine.backend = backend


class Decoder:
    """One decode step of sequences s0 .. s{B-1} per call, at positions ``position``, ``position`` + 1, ...:
    q [B, H, D] and the new token's k, v [B, Hkv, D], the same every step."""

    def __init__(self, engine: Engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        self.engine, self.q, self.k, self.v, self.position = engine, q, k, v, position

    def __call__(self) -> torch.Tensor:
        entries = [BatchEntry(f"s{i}", self.position, 1) for i in range(self.q.shape[0])]
        self.position += 1
        return self.engine.attend(0, entries, self.q, self.k, self.v, tenant="")
