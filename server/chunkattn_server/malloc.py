"""glibc malloc settings for a process that receives and builds MiB-sized messages.

gRPC hands every received message to Python as a new bytes object, and a KV export builds one per
message. With glibc's defaults such blocks soon go back to the kernel (the heap is trimmed once twice
the largest recently freed block is free at its top), so the next message faults its pages in again and
the kernel zeroes them first: thousands of page faults and milliseconds of CPU per 64 MiB imported
(benchmarks/transport.py; docs/results.md has the numbers). The server therefore raises the mmap
threshold to glibc's maximum (32 MiB: smaller blocks come from the heap) and the trim threshold to
64 MiB (up to that much free memory at the top of a heap is kept for the next messages; 512 MiB measured
no better). The threshold holds per malloc arena (the event loop, the engine thread and gRPC's threads
allocate from their own), and memory freed below a heap's top is kept whatever the setting, so a server
that once held many large messages at the same time can keep more than 64 MiB.

Nothing changes when the C library is not glibc, or when the thresholds were given in the environment
(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or glibc.malloc tunables in GLIBC_TUNABLES): glibc
then read them at startup, and they win.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 64 << 20
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> str:
    """Apply the settings above to this process; returns what was done, for the startup log."""
    if platform.libc_ver()[0] != "glibc":
        return "malloc left as it is (not glibc)"
    given = [f"{n}={os.environ[n]}" for n in ENVIRONMENT if n in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        given.append(f"GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}")
    if given:
        return "malloc left to " + " and ".join(given)
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "malloc left as it is (mallopt refused the settings)"
    return f"malloc keeps up to {TRIM_THRESHOLD >> 20} MiB freed (mmap threshold {MMAP_THRESHOLD >> 20} MiB)"
