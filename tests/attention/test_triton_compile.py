"""The triton kernels compiled ahead of time for an H100/H200 (sm_90), on the CPU: what the interpreter
cannot check. Each configuration the backend launches for the issue's shapes must fit in an H200's shared
memory (227 KiB per block). Compiling needs no GPU: Triton brings its own ptxas.

It runs in a subprocess, because the interpreter (TRITON_INTERPRET=1, set for the other tests) replaces
the kernels when they are decorated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.sm90 import H200_SHARED_BYTES

SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from chunkattn_server.attention.backends import triton_kernels as kern
from chunkattn_server.attention.backends.triton_backend import attention_config

dtype, head_size, group, rows, splits = json.loads(sys.argv[1])
config = attention_config(getattr(torch, dtype), head_size, group, 16, rows, splits, False, 64, 4)
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
        int_ptr = name.startswith(("tables", "tile", "seq"))
        signature[name] = "*" + (kind or ("i32" if int_ptr else element))
    else:
        signature[name] = "fp32" if name == "scale_log2" else "i32"
compiled = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)
print(json.dumps({"shared": compiled.metadata.shared}))
"""

# (dtype, head size, query heads per KV head, rows per tile, splits): Scout's decode and prefill in bf16,
# the largest head size in bf16 and fp32 (prefill and split decode).
CASES = [
    ("bfloat16", 128, 5, 16, 4),
    ("bfloat16", 128, 5, 64, 1),
    ("bfloat16", 256, 4, 64, 1),
    ("float32", 256, 4, 64, 1),
    ("float32", 256, 4, 16, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_compile_for_sm90_within_an_h200s_shared_memory(case: tuple[object, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(case)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    shared = json.loads(result.stdout.strip().splitlines()[-1])["shared"]
    assert 0 < shared <= H200_SHARED_BYTES, f"{case}: {shared} bytes of shared memory"
