"""What every benchmark here shares: interleaved rounds with medians, and a line naming the machine."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


def rounds(
    contenders: Mapping[str, Callable[[], object]],
    repeats: int,
    cleanup: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median seconds of each contender; each round runs them all in turn (after one warm-up each), so
    drift on a shared machine hits all of them alike. ``cleanup[name]``, when given, runs after each call
    of that contender, untimed (e.g. freeing what the call made)."""
    after = cleanup or {}
    for name, fn in contenders.items():
        fn()
        after.get(name, _nothing)()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            after.get(name, _nothing)()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _nothing() -> None:
    pass


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def publish(result: dict[str, Any], table: str, json_path: str | None) -> None:
    """Print a run's table and its duration (``result["duration_s"]``); write ``result`` as JSON when asked."""
    print(table)
    print(f"\n({result['duration_s']:.0f} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
