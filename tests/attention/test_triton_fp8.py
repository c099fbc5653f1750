"""The triton backend over a float8 KV cache (e4m3 and e5m2 pages with per-layer k_scale / v_scale), under
Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).

Batches are built directly (no engine): each sequence's K/V history is drawn in float32, stored with
``torchtypes.store`` (the engine's quantization) into scattered blocks of float8 pages, and the call's own
rows are the stored values read back in the compute dtype (``torchtypes.load``), as the engine passes them.
The kernel's output must match both the torch backend (impl="math", float32) run on the dequantized
pages and the float64 reference on the same dequantized values, within the compute dtype's tolerance.
The scales are far from 1 (0.05 and 3.0) so that a kernel ignoring either one fails.

Shapes are tiny (head size 16, blocks of 4): the interpreter costs milliseconds per inner-loop step.
fp32 and fp16 compute only (the interpreter's bf16 math is wrong; benchmarks/gpu.py checks bf16 on a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
import torch
import triton
import triton.language as tl

from chunkattn_client import dtypes
from chunkattn_client.reference import chunked_attention, within_tolerance
from chunkattn_server import torchtypes
from chunkattn_server.attention.backends import TorchBackend
from chunkattn_server.attention.backends.base import AttentionBatch
from chunkattn_server.attention.backends.triton_backend import TritonBackend, TritonLaunchError
from tests.helpers.sm90 import H200_SHARED_BYTES

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {"float8_e4m3": E4M3, "float8_e5m2": E5M2}
COMPUTE = {"float32": torch.float32, "float16": torch.float16}
SCALES = {"float8_e4m3": (0.05, 3.0), "float8_e5m2": (3.0, 0.05)}  # (k_scale, v_scale): both far from 1
KV_HEADS, HEAD_D, BLOCK = 2, 16, 4


# -- the interpreter reads float8 ------------------------------------------------------------------------


@triton.jit  # type: ignore[untyped-decorator]
def _decode_codes(x_ptr, out_ptr, scale, n: tl.constexpr):
    """out[i] = float(x[i]) * scale: x [n] float8 (Triton fp8e4nv / fp8e5), out [n] float32."""
    i = tl.arange(0, n)
    tl.store(out_ptr + i, tl.load(x_ptr + i).to(tl.float32) * scale)


@pytest.mark.parametrize("name", sorted(FP8))
def test_the_interpreter_decodes_every_finite_float8_code_as_torch_does(name: str) -> None:
    """What the kernel relies on: a float8 pointer loads, and converts to float32 exactly (all 256 codes;
    the non-finite ones, which a saturating write never stores, are the interpreter's known difference)."""
    codes = torch.arange(256, dtype=torch.uint8)
    x = codes.view(FP8[name])
    out = torch.empty(256)
    _decode_codes[(1,)](x, out, 3.0, n=256)
    want = torchtypes.load(x, 3.0, torch.float32)
    finite = torch.from_numpy(np.isfinite(dtypes.fp8_decode(codes.numpy(), name)))
    assert int(finite.sum()) == (254 if name == "float8_e4m3" else 248)
    assert torch.equal(out[finite], want[finite])


# -- attention -----------------------------------------------------------------------------------------------


@dataclass
class Fp8Case:
    """One call over a float8 cache, and what it must give.

    batch: the call (float8 pages, compute-dtype q/k/v). dequantized: the same call with the pages read back
    in float32 and q/k/v in float32, scales 1 (what the torch backend runs). want: [T, H, D] float64, the
    reference on the dequantized values.
    """

    batch: AttentionBatch
    dequantized: AttentionBatch
    want: npt.NDArray[np.float64]


def _case(
    cache: torch.dtype,
    compute: torch.dtype,
    scales: tuple[float, float],
    chunk: int,
    spans: list[tuple[int, int]],
    *,
    group: int = 2,
    alibi: torch.Tensor | None = None,
    seed: int = 0,
) -> Fp8Case:
    """Sequences (position of the first new token, new tokens) with histories stored in scattered blocks,
    KV_HEADS KV heads with ``group`` query heads each, optional ALiBi slopes [H] float32.

    Blocks before each sequence's current chunk are left out of its table (the engine frees them); free
    blocks hold other finite float8 values, so a read through a wrong table entry shows."""
    k_scale, v_scale = scales
    g = torch.Generator().manual_seed(seed)
    lengths = [pos + n for pos, n in spans]
    per_seq = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    noise = torch.randn(2, KV_HEADS, num_blocks, BLOCK, HEAD_D, generator=g) * 50
    k_pages = torchtypes.store(noise[0], k_scale, cache)
    v_pages = torchtypes.store(noise[1], v_scale, cache)
    k_bytes, v_bytes = k_pages.view(torch.uint8), v_pages.view(torch.uint8)
    qs, ks, vs, tables, batch_spans, wants = [], [], [], [], [], []
    row = first_block = 0
    for (pos, n), length, blocks in zip(spans, lengths, per_seq, strict=True):
        k_real = torch.randn(length, KV_HEADS, HEAD_D, generator=g)
        v_real = torch.randn(length, KV_HEADS, HEAD_D, generator=g)
        k_stored, v_stored = torchtypes.store(k_real, k_scale, cache), torchtypes.store(v_real, v_scale, cache)
        table = {i: order[first_block + i] for i in range(blocks)}
        first_block += blocks
        for t in range(length):  # the engine has written the call's own tokens too
            k_bytes[:, table[t // BLOCK], t % BLOCK] = k_stored[t].view(torch.uint8)
            v_bytes[:, table[t // BLOCK], t % BLOCK] = v_stored[t].view(torch.uint8)
        start = pos - pos % chunk if chunk else 0
        tables.append({b: p for b, p in table.items() if b >= start // BLOCK})
        q = torch.randn(n, KV_HEADS * group, HEAD_D, generator=g).to(compute)
        k_new = torchtypes.load(k_stored[pos:], k_scale, compute)  # stored then read, as the engine passes them
        v_new = torchtypes.load(v_stored[pos:], v_scale, compute)
        # The reference sees what the kernel is given: dequantized cache values, then the call's rows.
        k_seen = torch.cat([torchtypes.load(k_stored[:pos], k_scale, torch.float32).double(), k_new.double()])
        v_seen = torch.cat([torchtypes.load(v_stored[:pos], v_scale, torch.float32).double(), v_new.double()])
        wants.append(
            chunked_attention(
                q.double().numpy(), k_seen.numpy(), v_seen.numpy(), np.arange(pos, length),
                chunk_size=chunk, scale=HEAD_D**-0.5, alibi_slopes=None if alibi is None else alibi.double().numpy(),
            )
        )  # fmt: skip
        qs.append(q)
        ks.append(k_new)
        vs.append(v_new)
        batch_spans.append((row, pos, n))
        row += n
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    batch = AttentionBatch(
        q, k, v, k_pages, v_pages, batch_spans, tables, chunk, BLOCK, HEAD_D**-0.5, alibi, k_scale, v_scale
    )  # fmt: skip
    f32 = torch.float32
    dequantized = AttentionBatch(
        q.float(), k.float(), v.float(), torchtypes.load(k_pages, k_scale, f32), torchtypes.load(v_pages, v_scale, f32),
        batch_spans, tables, chunk, BLOCK, HEAD_D**-0.5, alibi,
    )  # fmt: skip
    return Fp8Case(batch, dequantized, np.concatenate(wants))


def _check(case: Fp8Case, compute: str, splits: int) -> None:
    """Run the triton backend on the float8 call; assert it matches the torch backend on the dequantized
    pages and the float64 reference (errors printed: absolute for fp32, relative to the output for fp16)."""
    out = torch.full_like(case.batch.q, float("nan"))
    TritonBackend(CPU, block_n=16, num_splits=splits).attend(case.batch, out)
    theirs = torch.empty_like(case.dequantized.q)
    TorchBackend(CPU, impl="math").attend(case.dequantized, theirs)
    ours = out.double().numpy()
    ok_torch, err_torch = within_tolerance(ours, theirs.double().numpy(), compute)
    ok_ref, err_ref = within_tolerance(ours, case.want, compute)
    print(f"max error: {err_torch:.2e} against the torch backend, {err_ref:.2e} against the reference")
    assert ok_torch, f"{err_torch:.3g} from the torch backend on the dequantized pages"
    assert ok_ref, f"{err_ref:.3g} from the float64 reference"


# A prefill piece over a chunk boundary with cache context (5..10 after 0..4: C = 8 splits it at 8), and
# decodes: inside a chunk (13), at a chunk's first position (16: no cache key in a chunked layer) and after
# 22 keys (a global layer's decode with splits of 16 keys: one all cache, one cache and its own row).
SPANS = [(5, 6), (13, 1), (16, 1), (22, 1)]


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("chunk", [8, 0])
@pytest.mark.parametrize("compute", sorted(COMPUTE))
@pytest.mark.parametrize("cache", sorted(FP8))
def test_float8_cache_matches_the_dequantized_torch_backend_and_reference(
    cache: str, compute: str, chunk: int, splits: int
) -> None:
    """GQA (2 query heads per KV head), prefill and decodes in one call, chunked (C = 8) and global."""
    case = _case(FP8[cache], COMPUTE[compute], SCALES[cache], chunk, SPANS)
    _check(case, compute, splits)


def test_float8_cache_with_alibi_and_four_query_heads_per_kv_head() -> None:
    """ALiBi's bias is added after the score scale that k_scale is folded into: it must stay unscaled."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625] * KV_HEADS)
    case = _case(E4M3, torch.float32, (3.0, 0.05), 8, [(6, 5), (11, 1)], group=4, alibi=slopes)
    _check(case, "float32", 1)


# -- writes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FP8))
def test_write_kernel_copies_float8_rows_bit_for_bit(name: str) -> None:
    """Every one of the 256 codes (NaN ones too: a write is a copy) lands at its slot; nothing else moves."""
    cache = FP8[name]
    g = torch.Generator().manual_seed(5)
    k = torch.randperm(256, generator=g).to(torch.uint8).view(4, 2, 32)
    v = torch.randperm(256, generator=g).to(torch.uint8).view(4, 2, 32)
    before = torch.randint(0, 256, (2, 2, 6, 4, 32), generator=g, dtype=torch.uint8)
    pages = before.clone()
    slots = torch.tensor([3, 17, 4, 22])
    TritonBackend(CPU).write(pages[0].view(cache), pages[1].view(cache), slots, k.view(cache), v.view(cache))
    want = before.clone()
    for i, slot in enumerate(slots.tolist()):
        want[0, :, slot // 4, slot % 4] = k[i]
        want[1, :, slot // 4, slot % 4] = v[i]
    assert torch.equal(pages, want)


# -- launch checks ---------------------------------------------------------------------------------------------


def _small(cache: torch.dtype, change: dict[str, object]) -> tuple[AttentionBatch, torch.Tensor]:
    """A one-sequence float8 batch [3 tokens, 4 heads, D 16] with scales (0.05, 3.0), fields replaced."""
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    pages = torch.zeros(2, 8, 4, 16).to(cache)
    fields: dict[str, object] = {
        "q": q, "k": k, "v": k.clone(), "k_pages": pages, "v_pages": pages.clone(), "spans": [(0, 0, 3)],
        "tables": [{}], "chunk_size": 8, "block_size": 4, "scale": 0.25, "alibi_slopes": None,
        "k_scale": 0.05, "v_scale": 3.0,
    }  # fmt: skip
    out = change.get("out", torch.empty(3, 4, 16))
    assert isinstance(out, torch.Tensor)
    return AttentionBatch(**(fields | {k: v for k, v in change.items() if k != "out"})), out  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.randn(3, 4, 16).to(E4M3)}, "q, k, v and out must share one of"),
        ({"k": torch.randn(3, 2, 16).to(E4M3)}, "k torch.float8_e4m3fn"),  # the call's rows come dequantized
        ({"out": torch.empty(3, 4, 16).half()}, "out torch.float16"),
        ({"v_pages": torch.zeros(2, 8, 4, 16).to(E5M2)}, "pages of torch.float8_e4m3fn (K) and torch.float8_e5m2"),
        ({"k_pages": torch.zeros(2, 8, 4, 16).half(), "v_pages": torch.zeros(2, 8, 4, 16).half()}, "compute dtype"),
        ({"k_scale": 0.0}, "must be finite and > 0"),
        ({"v_scale": float("nan")}, "must be finite and > 0"),
        ({"k_pages": torch.zeros(2, 8, 4, 16), "v_pages": torch.zeros(2, 8, 4, 16)}, "for a float8 cache only"),
    ],
)
def test_launch_checks_refuse_mismatched_float8_batches(change: dict[str, object], message: str) -> None:
    batch, out = _small(E4M3, change)
    with pytest.raises(TritonLaunchError) as e:
        TritonBackend(CPU).attend(batch, out)
    assert message in str(e.value)


def test_an_e4m3_cache_is_refused_before_sm89_and_e5m2_is_not() -> None:
    """Triton has no fp8e4nv before sm_89 (see the compile test below): say so instead of failing to compile."""
    backend = TritonBackend(CPU)
    backend._capability = (8, 0)  # as on an A100
    with pytest.raises(TritonLaunchError, match="float8_e4m3fn cache needs an sm_89"):
        backend.prepare(*_small(E4M3, {}))
    backend.prepare(*_small(E5M2, {}))


def test_write_refuses_rows_in_another_dtype_than_the_pages() -> None:
    pages = torch.zeros(2, 8, 4, 16).to(E4M3)
    k = torch.randn(1, 2, 16)
    with pytest.raises(TritonLaunchError, match="must share the cache dtype"):
        TritonBackend(CPU).write(pages, pages.clone(), torch.tensor([0]), k, k.clone())


# -- compiled for a GPU ----------------------------------------------------------------------------------------

COMPILE = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from chunkattn_server.attention.backends import triton_kernels as kern
from chunkattn_server.attention.backends.triton_backend import attention_config

results = []
for arch, dtype, cache, head_size, group, rows, splits in json.loads(sys.argv[1]):
    config = attention_config(getattr(torch, dtype), head_size, group, 16, rows, splits, False, 64, 4, kv_fp8=True)
    options = {k: config.pop(k) for k in ("num_warps", "num_stages") if k in config}
    element = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    fn = kern.chunked_paged_attention
    signature, constants = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in config:
            signature[name] = "constexpr"
            constants[(i,)] = config[name]
        elif name.endswith("_ptr"):
            kind = {"part_acc_ptr": "fp32", "part_ml_ptr": "fp32", "slopes_ptr": "fp32"}.get(name)
            kind = kind or {"k_pages_ptr": cache, "v_pages_ptr": cache}.get(name)
            int_ptr = name.startswith(("tables", "tile", "seq"))
            signature[name] = "*" + (kind or ("i32" if int_ptr else element))
        else:
            signature[name] = "fp32" if name in ("scale_log2", "k_scale", "v_scale") else "i32"
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constants), target=GPUTarget("cuda", arch, 32), options=options
        )
        results.append({"shared": compiled.metadata.shared})
    except Exception as e:
        results.append({"error": str(e)[-500:]})
print(json.dumps(results))
"""

# (sm, compute dtype, pages (Triton's name), head size, query heads per KV head, rows per tile, splits)
COMPILE_CASES = [
    (90, "bfloat16", "fp8e4nv", 128, 5, 16, 4),  # Scout's decode over an e4m3 cache, split
    (90, "bfloat16", "fp8e5", 128, 5, 64, 1),  # Scout's prefill over an e5m2 cache
    (90, "float32", "fp8e4nv", 256, 4, 64, 1),  # the largest tile
    (80, "float16", "fp8e5", 128, 4, 16, 2),  # e5m2 compiles for an A100
    (80, "float16", "fp8e4nv", 128, 4, 16, 2),  # e4m3 does not: why prepare refuses it there
]


@pytest.mark.slow
def test_float8_kernels_compile_for_sm90_and_e5m2_for_sm80() -> None:
    """The GPU path (fp8e4nv / fp8e5 pointers, KV_FP8) compiled ahead of time, on the CPU: what the
    interpreter cannot check. In a subprocess, as the interpreter replaces the kernels when they are
    decorated."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(COMPILE_CASES)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    *fits, refused = json.loads(result.stdout.strip().splitlines()[-1])
    for case, got in zip(COMPILE_CASES[:-1], fits, strict=True):
        assert 0 < got.get("shared", 0) <= H200_SHARED_BYTES, f"{case}: {got}"
    assert "fp8e4nv not supported in this architecture" in refused.get("error", ""), refused
