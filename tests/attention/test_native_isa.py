"""Every ISA build of the native kernels that this CPU runs (AMX, AVX512, AVX2, DEFAULT), against the float64
reference.

A server loads the widest build its CPU runs (attention/backends/native/build.py), so on a CI machine with
AVX512 the AVX2 and DEFAULT builds, which the image also ships for narrower CPUs, would never run. Here each is
forced in turn with CHUNKATTN_NATIVE_ISA (each ISA's module has a name of its own, so all load side by side in
one process; each is compiled once per machine into torch's extension cache, about 30 s, and found there
afterwards) and serves decodes through the engine, every call checked against the reference by the harness. An
ISA wider than this CPU's is skipped, saying so: its code would stop the process with an illegal instruction.

The shapes reach each build's vector paths: head sizes of 8, 16 and 20 (less than one vector, whole vectors,
and whole ones plus a part, for 8- and 16-float vectors), 1 to 9 query heads per KV head (the kernel keeps 8 in
registers at once), contexts past the kernel's 32-key tile, ALiBi, KV sharing, and every page dtype (float32,
float16, bfloat16, both float8 formats) with float32, float16 and bfloat16 outputs.
"""

from __future__ import annotations

import pytest

from chunkattn_client import BatchEntry
from chunkattn_server import LayerSpec, ModelShape
from chunkattn_server.kv.scales import KVScales
from tests.helpers.harness import MODELS, Harness

pytestmark = pytest.mark.native

# 18 query heads over 2 KV heads (9 each: a full register group of 8 and one more), head size 20; a chunked
# layer and a global one with ALiBi, whose decodes read more keys than one tile.
WIDE = ModelShape(
    num_heads=18,
    num_kv_heads=2,
    head_size=20,
    layers=(LayerSpec(16), LayerSpec(0, alibi_slopes=tuple(2.0 ** -(1 + h / 2) for h in range(18)))),
)
FP8_SCALES = KVScales((0.05,), (0.02,))  # N(0, 1) K/V land well inside both formats' normal range

# (model, q/k/v dtype, compute dtype, cache dtype)
CASES = [
    *((name, "float32", "auto", "float32") for name in sorted(MODELS)),
    ("wide", "float32", "auto", "float32"),
    ("wide", "float32", "auto", "float16"),
    ("wide", "float32", "auto", "bfloat16"),
    ("wide", "float32", "auto", "fp8_e4m3"),
    ("wide", "float32", "auto", "fp8_e5m2"),
    ("wide", "float16", "float16", "float16"),
    ("wide", "bfloat16", "bfloat16", "bfloat16"),
    ("wide", "bfloat16", "bfloat16", "fp8_e4m3"),
    ("wide", "bfloat16", "bfloat16", "fp8_e5m2"),
]


@pytest.mark.parametrize(("model", "dtype", "compute", "cache"), CASES)
def test_each_isa_build_matches_the_reference(isa: str, model: str, dtype: str, compute: str, cache: str) -> None:
    """A prefill across chunk boundaries beside a fresh sequence's first token, then decodes of both (the
    kernel's work) across the next boundaries; the harness checks every call against the reference."""
    scales = FP8_SCALES if cache.startswith("fp8") else None
    shape = WIDE if model == "wide" else MODELS[model]
    h = Harness.build(shape, dtype=dtype, compute_dtype=compute, cache_dtype=cache, kv_scales=scales, impl="native")
    assert h.engine.backend.name == "native"
    long = 37  # the global layers' decodes read 38 to 43 keys: more than one 32-key tile
    h.step([BatchEntry("a", 0, long), BatchEntry("b", 0, 1)])
    for i in range(6):
        h.step([BatchEntry("a", long + i, 1), BatchEntry("b", 1 + i, 1)])
