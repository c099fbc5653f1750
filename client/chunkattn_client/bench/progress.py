"""Live progress: a rich progress bar on a terminal, plain periodic lines otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from chunkattn_client.bench.recorder import Recorder


def _live(rec: Recorder) -> tuple[float, str, int]:
    """(tokens/s so far, the recent p50 for display, errors so far)."""
    p50 = rec.recent_p50_ms()
    rate = sum(rec.tokens.values()) / max(rec.now(), 1e-9)
    return rate, "-" if p50 is None else f"{p50:.2f} ms", sum(rec.errors.values())


def _line(rec: Recorder) -> str:
    rate, p50, errors = _live(rec)
    return (
        f"{rec.now():7.1f} s  sequences {rec.sequences:>6}  calls {rec.calls:>8}  tokens/s {rate:>9.0f}"
        f"  p50 {p50:>10}  errors {errors}"
    )


class PlainProgress:
    """One line every ``every_s`` seconds."""

    def __init__(self, out: TextIO = sys.stderr, every_s: float = 5.0) -> None:
        self._out, self._every, self._last = out, every_s, 0.0

    def __call__(self, rec: Recorder, final: bool) -> None:
        now = time.monotonic()
        if final or now - self._last >= self._every:
            self._last = now
            print(_line(rec), file=self._out, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A rich progress bar over the run's duration or its sequence count."""

    def __init__(self, total: float, unit: str) -> None:
        from rich.console import Console  # the [bench] extra
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._unit = unit
        self._bar = Progress(
            TextColumn("[bold]bench"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
            console=Console(stderr=True),
        )  # fmt: skip
        self._task = self._bar.add_task("starting", total=total)
        self._bar.start()

    def __call__(self, rec: Recorder, final: bool) -> None:
        done = rec.now() if self._unit == "s" else rec.sequences + rec.sequences_failed
        rate, p50, errors = _live(rec)
        description = f"{rec.sequences} seq, {rate:,.0f} tok/s, p50 {p50}, {errors} errors"
        self._bar.update(self._task, completed=done, description=description)

    def close(self) -> None:
        self._bar.stop()


def make_progress(mode: str, total: float | None, unit: str) -> Any:
    """ "auto": rich on a terminal when rich is installed, else plain; "plain"; or "none" (None)."""
    if mode == "none":
        return None
    if mode == "auto" and sys.stderr.isatty() and total:
        try:
            return RichProgress(total, unit)
        except ImportError:
            pass
    return PlainProgress()
