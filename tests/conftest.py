"""Test configuration: hypothesis profiles (CI is derandomized so a red build reproduces), and Triton's
interpreter, so the triton backend's kernels run on the CPU (read when a kernel is decorated: it must be
set before anything imports them)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
