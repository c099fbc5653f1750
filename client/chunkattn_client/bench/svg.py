"""Line charts as inline SVG: no plotting library, no script, nothing fetched; any browser draws them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 760, 340
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 170, 36, 52  # plot margins; the legend sits on the right


@dataclass(frozen=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str  # "#rrggbb"
    markers: bool = False  # draw each point (a sweep), not only the line


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 x 10^k) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, count - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """1, 2, 5 x 10^k ticks covering [lo, hi] (lo > 0)."""
    ticks = []
    for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        ticks += [m * 10.0**k for m in (1, 2, 5)]
    inside = [t for t in ticks if lo <= t <= hi]
    below = [t for t in ticks if t < lo]
    above = [t for t in ticks if t > hi]
    return ([below[-1]] if below else []) + inside + ([above[0]] if above else [])


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    log_x: bool = False,
    y_from_zero: bool = True,
    chart_id: str = "",
) -> str:
    """An SVG line chart of ``series`` with axes, grid, tick labels and a legend."""
    pts = [(x, y) for s in series for x, y in zip(s.xs, s.ys, strict=True) if not log_x or x > 0]
    if not pts:
        return _empty(title, chart_id)
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    xt = log_ticks(min(xs), max(xs)) if log_x else nice_ticks(min(xs), max(xs))
    yt = nice_ticks(0.0 if y_from_zero else min(ys), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    pw, ph = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def px(x: float) -> float:
        f = (math.log10(x) - math.log10(x0)) / (math.log10(x1) - math.log10(x0)) if log_x else (x - x0) / (x1 - x0)
        return _LEFT + f * pw

    def py(y: float) -> float:
        return _TOP + ph - (y - y0) / ((y1 - y0) or 1.0) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{escape(chart_id)}" width="{WIDTH}"'
        f' height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
        f'<text x="{_LEFT}" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    for t in xt:
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{_TOP + ph}" stroke="#e6e6e6"/>')
        out.append(
            f'<text class="x-tick" x="{x:.1f}" y="{_TOP + ph + 18}" font-size="11"'
            f' text-anchor="middle">{_num(t)}</text>'
        )
    for t in yt:
        y = py(t)
        out.append(f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_LEFT + pw}" y2="{y:.1f}" stroke="#e6e6e6"/>')
        out.append(
            f'<text class="y-tick" x="{_LEFT - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{_num(t)}</text>'
        )
    out.append(f'<rect x="{_LEFT}" y="{_TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    out.append(
        f'<text x="{_LEFT + pw / 2}" y="{HEIGHT - 10}" font-size="12" text-anchor="middle">{escape(x_label)}</text>'
    )
    out.append(
        f'<text transform="translate(16 {_TOP + ph / 2}) rotate(-90)" font-size="12"'
        f' text-anchor="middle">{escape(y_label)}</text>'
    )
    for i, s in enumerate(series):
        coords = [(px(x), py(y)) for x, y in zip(s.xs, s.ys, strict=True) if not log_x or x > 0]
        if not coords:
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        out.append(
            f'<polyline class="series" data-name="{escape(s.name)}" points="{path}" fill="none"'
            f' stroke="{s.color}" stroke-width="2.5" stroke-linejoin="round"/>'
        )
        if s.markers or len(coords) == 1:
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="{s.color}"/>' for x, y in coords]
        ly = _TOP + 10 + 20 * i
        out.append(
            f'<line x1="{_LEFT + pw + 14}" y1="{ly}" x2="{_LEFT + pw + 40}" y2="{ly}" stroke="{s.color}"'
            ' stroke-width="4"/>'
        )
        out.append(f'<text x="{_LEFT + pw + 46}" y="{ly + 4}" font-size="12">{escape(s.name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _empty(title: str, chart_id: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart empty" id="{escape(chart_id)}" width="{WIDTH}"'
        f' height="60"><text x="10" y="35" font-size="13">{escape(title)}: no data</text></svg>'
    )


def _num(t: float) -> str:
    if t == 0:
        return "0"
    if abs(t) >= 1000:
        return f"{t:,.0f}"
    return f"{t:g}"
