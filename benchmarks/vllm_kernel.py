"""vLLM's own CPU attention kernel against chunkattn's engine (torch and native backends), on the same shapes and
the same data, side by side in one run. Runs in .venv-vllm (``make bench-vllm``), the engine imported from
server/ (PYTHONPATH=server: the engine layer needs no gRPC server).

Rows (times are medians over rounds that run vLLM, torch and native in turn; ratios are ours / vLLM):
1. decode: 32 sequences x 1 token over 4,096 keys (all inside one chunk: C = 8192), 32 query / 8 KV heads of
   128, computing in float32 and bfloat16 over a cache of the same dtype, and in bfloat16 over a float8 cache
   (e4m3 and e5m2); each in two block layouts: the allocator's (vLLM: each sequence's blocks consecutive, as a
   fresh pool gives them; ours: the engine's own allocator, the 32 prompts prefilled interleaved in 256-token
   pieces, as benchmarks/engine.py does) and scattered (in both, every block moved to a random place: no two
   blocks of a sequence in order). Each step writes the step's new K/V and attends over them, one position
   further every step, in both.
2. prefill: one sequence of 16,384 tokens, C = 4096, 8 query / 2 KV heads of 128, float32 and bfloat16: vLLM
   runs it as its chunked-local layers do, four virtual requests of 4,096 queries each attending causally
   within its chunk (its own ``make_local_attention_virtual_batches``); ours is ``Engine.attend`` of the whole
   prompt. Both write the prompt's K/V into the cache inside the timed call.

What is timed. vLLM: the ops its CPU attention layer runs (vllm/v1/attention/backends/cpu_attn.py):
``cpu_attn_reshape_and_cache`` (the new tokens' K/V into the cache, at the slots of the slot mapping),
``cpu_attn_get_scheduler_metadata`` (built once per step for all layers in vLLM, a few microseconds) and
``cpu_attention_with_kv_cache``, into a preallocated output. Its host-side batch (block table, slot mapping,
the virtual batches), which vLLM's model runner builds once per step for all layers, is built before the
clock starts. Ours: the whole ``Engine.attend`` call (planning, block allocation, the write, attention, a
fresh output), so ours carries its host-side work and vLLM's carries none. Both run on torch's threads (2 on
the dev machines); a vLLM server would also pin its OpenMP threads to cores (VLLM_CPU_OMP_THREADS_BIND).

vLLM's cache, as its CPU backend allocates it: one tensor per layer [num_blocks, Hkv, 2 * block_size, D] (its
``[num_blocks, Hkv, block_size, 2 * D]`` viewed as such), split on dim 2 into the K and V halves. Within a block
and head, where each token's K and V elements go depends on the ISA vLLM's kernel picks for the row's dtype
(``_get_attn_isa``, recorded per row: "vec" on AVX-512 without AMX, where K is stored transposed; "amx" for
bfloat16 where the CPU has AMX, with K and V packed for its tiles): the benchmark learns the layout once per
(dtype, cache) by writing one block of distinct values with vLLM's own write op and reading where each landed
(``VLLMCache.layout``), so the caches are compared on every machine whatever the ISA. A
float8 cache is uint8 storage with ``kv_cache_dtype`` naming the format and per-layer float scales. Ours: per
plane K and V tensors [Hkv, num_blocks, block_size, D] (kv/cache.py). Blocks of 32 tokens in both: vLLM's
CPU backend asks for a multiple of 32 (``get_supported_kernel_block_sizes``); its kernel takes 16 only through
the "vec16" ISA, which has no float8 path.

Same data: both caches are written with each side's own write op from the same K/V, and their contents are
compared exactly after the prefill and after the scattering. vLLM's float8 write truncates toward zero where
ours rounds to nearest, so the K/V of the float8 rows are values each format holds exactly over the scales
(a float8 number times a power of two: K over 2^-5, V over 2^-6, the same scales in both), and none is -0
(vLLM stores it as +0); both then store the same bits. Outputs are checked too: the first step (or the
prefill) of each contender against vLLM's, max |ours - vLLM| printed; they agree where every |ours - vLLM|
<= tol * max(1, |vLLM|), tol per compute dtype (1e-4 float32, 2e-2 bfloat16: a bfloat16 output's spacing
grows with its value). A row that does not agree, or whose caches differ, is marked and the run exits 1.

    PYTHONPATH=server .venv-vllm/bin/python benchmarks/vllm_kernel.py [--json PATH] [--repeats N] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from typing import Any

import torch
import vllm
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm.v1.attention.backends.utils import make_local_attention_virtual_batches

from chunkattn_client import BatchEntry
from chunkattn_server import Engine, torchtypes
from chunkattn_server.attention.backends.native.build import isa
from chunkattn_server.kv.scales import KVScales

import contenders  # benchmarks/contenders.py
from timing import cpu_name, publish, rounds  # benchmarks/timing.py

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# float8 codes that both formats store and read back as themselves: not -0 (vLLM writes +0), no NaN or inf.
SAFE_CODES = [c for c in range(256) if c != 0x80 and c & 0x7F < 0x7C][:240]
# (compute dtype, cache dtype): "auto" is the compute dtype, as in both projects' configuration.
DECODE_CACHES = (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8_e4m3"), ("bfloat16", "fp8_e5m2"))
LAYOUTS = ("allocator", "scattered")
FP8_SCALES = (2.0**-5, 2.0**-6)  # (k, v): powers of two, so each K/V value below is a float8 number times one
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # |ours - vLLM| <= tol * max(1, |vLLM|), per compute dtype


@dataclass(frozen=True)
class Shapes:
    decode_seqs: int = 32
    decode_context: int = 4096
    decode_heads: tuple[int, int] = (32, 8)
    prefill_tokens: int = 16_384
    prefill_chunk: int = 4096
    prefill_heads: tuple[int, int] = (8, 2)
    head_size: int = 128
    block_size: int = 32
    fill_piece: int = 256


SMOKE = Shapes(
    decode_seqs=4,
    decode_context=256,
    decode_heads=(4, 2),
    prefill_tokens=512,
    prefill_chunk=128,
    prefill_heads=(4, 2),
    head_size=32,  # vLLM's CPU kernel takes head sizes 32, 64, 80, ...
    fill_piece=64,
)


# -- vLLM's side ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One step's host-side inputs to vLLM's ops, virtual requests already made (R of them, T new tokens)."""

    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32: keys each virtual request attends over
    block_table: torch.Tensor  # [R, pages] int32: each virtual request's blocks (its chunk's)
    slots: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token


def local_batch(chunk: int, q_lens: list[int], seq_lens: list[int], table: torch.Tensor, block_size: int) -> Batch:
    """The batch vLLM's chunked-local layers see for requests whose last ``q_lens`` of ``seq_lens`` tokens are
    new, over block tables ``table`` [requests, pages] int32: each request cut at chunk boundaries into virtual
    requests by vLLM's own ``make_local_attention_virtual_batches`` (a prompt of 4C tokens: 4 requests of C
    queries over C keys; a decode inside one chunk: itself)."""
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens, strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = table[rows, positions // block_size].long() * block_size + positions % block_size
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=lens,
        num_reqs=len(q_lens),
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=slots,
    )
    local, _ = make_local_attention_virtual_batches(chunk, common, block_size)
    return Batch(local.query_start_loc, local.seq_lens, local.block_table_tensor, slots)


class VLLMCache:
    """One layer's paged cache as vLLM's CPU backend holds it (see the module doc), and the ops its attention
    layer runs on it. ``cache``: "auto" (the compute dtype) or a float8 format over ``scales`` (k, v)."""

    def __init__(
        self, num_blocks: int, heads: tuple[int, int], head_size: int, block_size: int, dtype: str, cache: str
    ) -> None:
        self.heads, self.head_size, self.block_size = heads, head_size, block_size
        self.dtype, self.cache = DTYPES[dtype], cache
        self.scales = FP8_SCALES if cache != "auto" else (1.0, 1.0)
        storage = self.dtype if cache == "auto" else torch.uint8
        self.kv = torch.zeros(num_blocks, heads[1], 2 * block_size, head_size, dtype=storage)
        self.k, self.v = self.kv.chunk(2, dim=2)  # [num_blocks, Hkv, block_size, D] views (K's interior: [D, bs])
        self.isa: str = _get_attn_isa(self.dtype, block_size, head_size, cache)
        self._order: torch.Tensor | None = None  # layout(), learned on first use

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] (the compute dtype) at ``slots`` [T] int64."""
        ops.cpu_attn_reshape_and_cache(k, v, self.k, self.v, slots, self.isa, *self.scales, self.cache)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, batch: Batch) -> None:
        """What vLLM's CPU attention layer runs for one step: the new tokens' K/V written, the scheduler
        metadata, attention of q [T, H, D] into ``out`` [T, H, D]."""
        self.write(k, v, batch.slots)
        h, hkv = self.heads
        metadata = ops.cpu_attn_get_scheduler_metadata(
            batch.seq_lens.shape[0], h, hkv, self.head_size, batch.seq_lens, self.dtype, batch.query_start_loc,
            True, -1, self.isa, envs.VLLM_CPU_ATTN_SPLIT_KV, None, self.cache,
        )  # fmt: skip
        ops.cpu_attention_with_kv_cache(
            q, self.k, self.v, out, batch.query_start_loc, batch.seq_lens, self.head_size**-0.5, True, None, -1,
            batch.block_table, 0.0, metadata, None, None, *self.scales, self.cache,
        )  # fmt: skip

    def tokens(self, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` tokens' K and V [n, Hkv, D] held in ``blocks`` (as stored: uint8 for float8), read
        through the layout vLLM's write op has on this machine (``layout``)."""
        hkv, d = self.heads[1], self.head_size
        order = self.layout()
        held = self.kv[blocks].flatten(2)[:, :, order]  # [blocks, Hkv, 2 * bs * D]: K then V, token-major
        k, v = held.view(len(blocks), hkv, 2, self.block_size, d).unbind(2)
        return k.transpose(1, 2).reshape(-1, hkv, d)[:n], v.transpose(1, 2).reshape(-1, hkv, d)[:n]

    def layout(self) -> torch.Tensor:
        """Where vLLM's write op puts each element of a block: ``order`` [2 * bs * D] int64 such that a block's
        head slice, flattened, indexed by ``order`` is K [bs, D] then V [bs, D] in token order. Learned by
        writing one block whose every K and V element is a distinct code (K: t * D + i, V: bs * D + t * D + i),
        with the same op, ISA and cache dtype, and reading where each code landed (per head; all heads agree)."""
        if self._order is not None:
            return self._order
        bs, d, hkv = self.block_size, self.head_size, self.heads[1]
        count = 2 * bs * d
        probe = VLLMCache(1, self.heads, d, bs, str(self.dtype).removeprefix("torch."), self.cache)
        codes = torch.arange(count).view(2, bs, 1, d).expand(2, bs, hkv, d)
        landed = torch.zeros(hkv, count, dtype=torch.int64)
        base = len(SAFE_CODES) if self.cache != "auto" else count
        for digit in range(2 if self.cache != "auto" else 1):  # float8: two base-240 digits of each code
            part = (codes // base**digit) % base
            probe.kv.zero_()
            probe.write(self._encode(part[0], self.scales[0]), self._encode(part[1], self.scales[1]), torch.arange(bs))
            landed += self._decode(probe.kv[0].flatten(1)) * base**digit
        order = torch.argsort(landed, dim=1)
        if not (landed.sort(dim=1).values == torch.arange(count)).all() or not (order == order[0]).all():
            raise RuntimeError(f"vLLM's {self.isa} cache layout is not a permutation of each head's block: not read")
        self._order = order[0]
        return self._order

    def _encode(self, codes: torch.Tensor, scale: float) -> torch.Tensor:
        """K or V in the compute dtype that this cache stores as ``codes`` (distinct bits per code); a float8
        cache's over ``scale`` (its K's or V's)."""
        if self.cache != "auto":  # a float8 number times the scale (a power of two): stored exactly as its code
            fp8 = torchtypes.of(self.cache)
            raw = torch.tensor(SAFE_CODES, dtype=torch.uint8)[codes].view(fp8)
            return (raw.float() * scale).to(self.dtype)
        if self.dtype == torch.float32:
            return codes.float()  # exact below 2^24
        return (codes + 0x3F80).to(torch.int16).view(torch.bfloat16)  # normal numbers from 1.0 up, all distinct

    def _decode(self, stored: torch.Tensor) -> torch.Tensor:
        """The codes ``_encode`` made, read back from a block's storage [Hkv, 2 * bs * D]."""
        if self.cache != "auto":
            lookup = torch.full((256,), -1, dtype=torch.int64)
            lookup[torch.tensor(SAFE_CODES)] = torch.arange(len(SAFE_CODES))
            return lookup[stored.long()]
        if self.dtype == torch.float32:
            return stored.long()
        return stored.view(torch.int16).long() - 0x3F80

    def move_blocks(self, where: torch.Tensor) -> None:
        """Move block b's contents to block ``where[b]`` (a permutation of the block ids)."""
        moved = torch.empty_like(self.kv)
        moved[where] = self.kv
        self.kv.copy_(moved)


class VLLMDecoder:
    """vLLM's decode steps, one per call, over the prepared ``batches`` in turn (one position further each)."""

    def __init__(
        self, cache: VLLMCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batches: list[Batch]
    ) -> None:
        self.cache, self.q, self.k, self.v, self.batches = cache, q, k, v, batches
        self.out = torch.empty_like(q)  # vLLM writes into the model's preallocated output
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.cache.step(self.q, self.k, self.v, self.out, self.batches[self.calls])
        self.calls += 1
        return self.out


# -- ours -------------------------------------------------------------------------------------------


def scatter(engine: Engine, seqs: int, generator: torch.Generator) -> None:
    """Move every block the engine's sequences s0 .. s{seqs-1} hold to a random one of those blocks (contents
    and block tables both): the scattered layout, made from the allocator's."""
    states = [engine.kv.get(f"s{i}", tenant="") for i in range(seqs)]
    tables = [s.tables[0] for s in states if s is not None]  # one layer: one KV group
    used = torch.tensor(sorted(b for t in tables for b in t.values()))
    moved = used[torch.randperm(len(used), generator=generator)]  # block used[j] goes to moved[j]
    for pages in (engine.cache.k[0], engine.cache.v[0]):
        raw = pages.view(torch.uint8)  # as bytes: indexing has no float8 kernels
        raw[:, moved] = raw[:, used]
    where = dict(zip(used.tolist(), moved.tolist(), strict=True))
    for t in tables:
        for logical, block in t.items():
            t[logical] = where[block]


def our_tokens(engine: Engine, seq: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` tokens' K and V [n, Hkv, D] of sequence s{seq} as the engine's cache holds them."""
    state = engine.kv.get(f"s{seq}", tenant="")
    assert state is not None, "set up by prefill"
    blocks = torch.tensor([state.tables[0][b] for b in range(-(-n // engine.block_size))])
    hkv, d = engine.cache.k[0].shape[0], engine.cache.k[0].shape[3]
    k, v = (
        pages[:, blocks].permute(1, 2, 0, 3).reshape(-1, hkv, d)[:n] for pages in (engine.cache.k[0], engine.cache.v[0])
    )
    return k, v


def same_contents(theirs: VLLMCache, table: torch.Tensor, ours: dict[str, Engine], n: int) -> bool:
    """Whether every engine's cache holds, bit for bit, what vLLM's holds for the first ``n`` tokens of each
    sequence."""
    for seq in range(table.shape[0]):
        held = theirs.tokens(table[seq].long(), n)
        for engine in ours.values():
            mine = our_tokens(engine, seq, n)
            if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(held, mine, strict=True)):
                return False
    return True


# -- the rows ---------------------------------------------------------------------------------------


def values(shape: tuple[int, ...], dtype: str, cache: str, scale: float, generator: torch.Generator) -> torch.Tensor:
    """Random K or V in the compute dtype; for a float8 cache, values the format holds exactly over ``scale``
    (stored and read back once, as our cache does), which vLLM's truncating write stores alike; no -0 among
    them (vLLM stores it as +0, ours as -0: the same value, other bits)."""
    x = torch.randn(shape, generator=generator)
    if cache != "auto":
        fp8 = torchtypes.of(cache)
        x = torchtypes.load(torchtypes.store(x, scale, fp8), scale, torch.float32)
        x = torch.where(x == 0, 0.0, x)
    return x.to(DTYPES[dtype])


def _compare(ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> tuple[float, bool]:
    """max |ours - theirs|, and whether every |ours - theirs| <= tol * max(1, |theirs|)."""
    diff = (ours.float() - theirs.float()).abs()
    return float(diff.max()), bool((diff <= tol * theirs.float().abs().clamp(min=1)).all())


def bench_decode(s: Shapes, dtype: str, cache: str, backends: tuple[str, ...], repeats: int) -> list[dict[str, Any]]:
    """The decode rows of one (compute, cache) pair: the allocator's layout, then scattered."""
    b, ctx, (h, hkv), d, bs = s.decode_seqs, s.decode_context, s.decode_heads, s.head_size, s.block_size
    g = torch.Generator().manual_seed(1)
    steps = repeats + 2  # the checked step, the warm-up, the timed ones
    pages = -(-(ctx + steps) // bs)  # blocks per sequence, the steps' included
    k_scale, v_scale = FP8_SCALES
    k_all = values((b, ctx - 1, hkv, d), dtype, cache, k_scale, g)  # the context before the first step
    v_all = values((b, ctx - 1, hkv, d), dtype, cache, v_scale, g)
    q1 = torch.randn(b, h, d, generator=g).to(DTYPES[dtype])  # each step's query and new K/V
    k1, v1 = values((b, hkv, d), dtype, cache, k_scale, g), values((b, hkv, d), dtype, cache, v_scale, g)

    theirs = VLLMCache(b * pages, (h, hkv), d, bs, dtype, cache)
    table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)  # each sequence's blocks consecutive
    theirs.write(
        k_all.flatten(0, 1), v_all.flatten(0, 1), local_batch(2 * ctx, [ctx - 1] * b, [ctx - 1] * b, table, bs).slots
    )
    scales = None if cache == "auto" else KVScales(k=(k_scale,), v=(v_scale,))
    ours = {
        name: contenders.engine(
            name, chunk=2 * ctx, heads=(h, hkv), head_size=d, num_blocks=b * (pages + 1), dtype=dtype,
            block_size=bs, cache_dtype=cache, scales=scales,
        )
        for name in backends
    }  # fmt: skip
    for engine in ours.values():
        contenders.prefill(engine, k_all, v_all, s.fill_piece)
    del k_all, v_all

    rows = []
    for layout in LAYOUTS:
        if layout == "scattered":
            where = torch.randperm(b * pages, generator=g)
            theirs.move_blocks(where)
            table = where[table.long()].to(torch.int32)
            for engine in ours.values():
                scatter(engine, b, g)
        same = same_contents(theirs, table, ours, ctx - 1)
        batches = [local_batch(2 * ctx, [1] * b, [ctx + i] * b, table, bs) for i in range(steps)]
        steppers: dict[str, Callable[[], torch.Tensor]] = {"vllm": VLLMDecoder(theirs, q1, k1, v1, batches)}
        steppers.update({name: contenders.Decoder(engine, q1, k1, v1, ctx - 1) for name, engine in ours.items()})
        first = {name: step().clone() for name, step in steppers.items()}  # position ctx - 1: over ctx keys
        times = rounds(steppers, repeats)
        path = ours_isa(ours, "decode", dtype, cache, h // hkv)
        rows.append(_row("decode", dtype, cache, layout, theirs.isa, path, times, first, same))
        for engine in ours.values():  # back to the prefilled context for the next layout
            for i in range(b):
                engine.kv.truncate(f"s{i}", ctx - 1, tenant="")
    return rows


def bench_prefill(s: Shapes, dtype: str, backends: tuple[str, ...], repeats: int) -> dict[str, Any]:
    n, c, (h, hkv), d, bs = s.prefill_tokens, s.prefill_chunk, s.prefill_heads, s.head_size, s.block_size
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    q = torch.randn(n, h, d, generator=g).to(dt)  # the packed layout of both: [T, H, D]
    k = torch.randn(n, hkv, d, generator=g).to(dt)
    v = torch.randn(n, hkv, d, generator=g).to(dt)

    theirs = VLLMCache(n // bs, (h, hkv), d, bs, dtype, "auto")
    batch = local_batch(c, [n], [n], torch.arange(n // bs, dtype=torch.int32).view(1, -1), bs)
    out = torch.empty_like(q)

    def vllm_prefill() -> torch.Tensor:
        theirs.step(q, k, v, out, batch)
        return out

    def ours(engine: Engine) -> torch.Tensor:
        engine.kv.release(["p"], missing_ok=True, tenant="")
        return engine.attend(0, [BatchEntry("p", 0, n)], q, k, v, tenant="")

    engines = {
        name: contenders.engine(
            name, chunk=c, heads=(h, hkv), head_size=d, num_blocks=n // bs + 1, dtype=dtype, block_size=bs
        )
        for name in backends
    }
    runs: dict[str, Callable[[], torch.Tensor]] = {"vllm": vllm_prefill}
    runs.update({name: functools.partial(ours, engine) for name, engine in engines.items()})
    first = {name: run().clone() for name, run in runs.items()}
    ours_path = ours_isa(engines, "prefill", dtype, "auto", h // hkv)
    return _row("prefill", dtype, "auto", "-", theirs.isa, ours_path, rounds(runs, repeats), first, None)


def ours_isa(engines: dict[str, Engine], kind: str, dtype: str, cache: str, heads_per_kv: int) -> str:
    """The native backend's path for a row, named as vLLM names its own: "amx" where the AMX tiles compute it (a
    bfloat16 compute in the AMX build: a prefill always, a decode from the kernel's ``amx_min_heads`` query heads
    per KV head for its page type), else "vec"; "-" without the native backend."""
    engine = engines.get("native")
    if engine is None:
        return "-"
    kernel = engine.backend._kernel  # type: ignore[attr-defined]
    if not kernel.amx or dtype != "bfloat16":
        return "vec"
    if kind == "prefill":
        return "amx"
    page = {"auto": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[cache]
    return "amx" if heads_per_kv >= kernel.amx_min_heads[page] else "vec"


def _row(
    kind: str,
    dtype: str,
    cache: str,
    layout: str,
    isa: str,
    ours: str,
    times: dict[str, float],
    outputs: dict[str, torch.Tensor],
    same_cache: bool | None,
) -> dict[str, Any]:
    names = [name for name in times if name != "vllm"]
    checks = {name: _compare(outputs[name], outputs["vllm"], TOLERANCE[dtype]) for name in names}
    return {
        "kind": kind,
        "compute": dtype,
        "cache": cache,
        "layout": layout,
        "isa": isa,  # vLLM's kernel ISA for this row's dtype and cache (its cache layout too)
        "ours_isa": ours,  # the native backend's path for the row: "amx" (the AMX tiles) or "vec" (vector units)
        "seconds": times,
        "vs_vllm": {name: times[name] / times["vllm"] for name in names},
        "max_abs_diff": {name: diff for name, (diff, _) in checks.items()},
        "tolerance": TOLERANCE[dtype],
        "agree": all(ok for _, ok in checks.values()),
        "same_cache": same_cache,
    }


# -- report ------------------------------------------------------------------------------------------


def report(result: dict[str, Any]) -> str:
    s = result["shapes"]
    lines = [
        f"vLLM's CPU attention kernel against chunkattn's engine, {result['date']}, {result['machine']}",
        f"vllm {result['vllm']} (its kernel's ISA per row; split KV {result['split_kv']}), blocks of {s['block_size']}"
        " in both caches; medians, ratios ours / vLLM (below 1: ours faster)",
        f"ours: the native kernels' {result['native_build']} build (per row: its AMX tiles or vector units)",
    ]
    if result["native_unavailable"]:
        lines.append(f"native backend unavailable, torch only: {result['native_unavailable']}")
    header = (
        f"{'compute':<9} {'cache':<9} {'layout':<10} {'ISA':<5} {'ours':<5} {'vLLM':>9} {'torch':>9} {'native':>9}"
        f" {'torch/vLLM':>10} {'native/vLLM':>11}  {'max |ours - vLLM| torch, native (tol)':<38} same cache"
    )
    for kind, title in (
        (
            "decode",
            f"decode: {s['decode_seqs']} sequences x 1 token over {s['decode_context']:,} keys,"
            f" {s['decode_heads'][0]}/{s['decode_heads'][1]} heads of {s['head_size']}",
        ),
        (
            "prefill",
            f"prefill: one sequence of {s['prefill_tokens']:,} tokens, C = {s['prefill_chunk']},"
            f" {s['prefill_heads'][0]}/{s['prefill_heads'][1]} heads of {s['head_size']}",
        ),
    ):
        lines += ["", title, header]
        for r in (r for r in result["rows"] if r["kind"] == kind):
            t, ratio, diff = r["seconds"], r["vs_vllm"], r["max_abs_diff"]
            native = "native" in t
            errors = f"{diff['torch']:.1e}, {diff['native']:.1e}" if native else f"{diff['torch']:.1e}, -"
            check = f"{errors} ({r['tolerance']:.0e}) {'ok' if r['agree'] else 'DIFFER'}"
            same = {True: "yes", False: "NO", None: "-"}[r["same_cache"]]
            lines.append(
                f"{r['compute']:<9} {r['cache']:<9} {r['layout']:<10} {r['isa']:<5} {r['ours_isa']:<5}"
                f" {_time(t['vllm'])}"
                f" {_time(t['torch'])}"
                f" {_time(t['native']) if native else '-':>9} {ratio['torch']:>9.2f}x"
                f" {(format(ratio['native'], '.2f') + 'x') if native else '-':>11}"
                f"  {check:<38} {same}"
            )
    return "\n".join(lines)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:>7.1f}ms" if seconds < 1 else f"{seconds:>8.3f}s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per contender (default 5)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the code paths in seconds")
    parser.add_argument(
        "--only",
        metavar="ROWS",
        default="",
        help="comma-separated rows to run, each 'prefill/COMPUTE' or 'decode/COMPUTE/CACHE'"
        " (e.g. decode/bfloat16/fp8_e4m3); default: all",
    )
    args = parser.parse_args(argv)
    only = {w for w in args.only.split(",") if w}
    known = {f"decode/{d}/{c}" for d, c in DECODE_CACHES} | {f"prefill/{d}" for d in DTYPES}
    if only - known:
        parser.error(f"--only: unknown rows {sorted(only - known)}; expected some of {sorted(known)}")
    shapes = SMOKE if args.smoke else Shapes()

    started = time.perf_counter()
    backends, unavailable = contenders.backends()
    if unavailable:
        print(f"native backend unavailable, timing torch only: {unavailable}", flush=True)
    rows: list[dict[str, Any]] = []
    for dtype, cache in DECODE_CACHES:
        if not only or f"decode/{dtype}/{cache}" in only:
            rows += bench_decode(shapes, dtype, cache, backends, args.repeats)
    for dtype in DTYPES:
        if not only or f"prefill/{dtype}" in only:
            rows.append(bench_prefill(shapes, dtype, backends, args.repeats))
    result: dict[str, Any] = {
        "benchmark": "vllm_kernel",
        "date": date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads,"
        f" torch {torch.__version__}",
        "vllm": vllm.__version__,
        "split_kv": bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
        "shapes": asdict(shapes),
        "native_unavailable": unavailable,
        "native_build": "-" if unavailable else isa(),
        "rows": rows,
        "duration_s": time.perf_counter() - started,
    }
    publish(result, report(result), args.json)
    wrong = [
        f"{r['kind']} {r['compute']} {r['cache']} {r['layout']}"
        for r in rows
        if not r["agree"] or r["same_cache"] is False
    ]
    if wrong:
        print(f"\nours and vLLM differ (outputs past the tolerance, or caches not the same) in: {'; '.join(wrong)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
