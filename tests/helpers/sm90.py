"""What an H100/H200 (sm_90) gives one kernel, for the tests that compile the triton kernels for it ahead of time
on the CPU (tests/attention/test_triton_compile.py, tests/attention/test_triton_fp8.py)."""

from __future__ import annotations

H200_SHARED_BYTES = 232_448  # shared memory per block: 227 KiB
