"""The HTML report: one self-contained page (inline CSS and SVG; no script, no fetch).

A single run shows its parameters, the summary, a latency CDF per kind, prefill and decode throughput over
time (a chart each, each on its own scale) and, with --metrics-url, the server's KV blocks in use over time.
A sweep adds throughput against p99 latency and one row per point.

The engine workload's run shows, instead of the latency CDF, its layer calls' and steps' latency CDF, its users'
(TTFT, TPOT, whole requests) and each engine's step attention over the run; its sweep plots engine step
attention where the sequences workload has decode steps, and layer call p50/p99, TTFT p99 and TPOT p99 against
the swept parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from chunkattn_client.bench.recorder import RunResult
from chunkattn_client.bench.report import (
    KINDS,
    LATENCY_KEYS,
    describe_groups,
    fmt_ms,
    fmt_tokens,
    latency_rows,
    server_tokens_unit,
    shown_engines,
)
from chunkattn_client.bench.svg import Series, line_chart

# One colour per series, and no colour in two charts, so a test can find each chart's lines on a screenshot.
COLORS = {
    "cdf_prefill": "#1f77b4",
    "cdf_decode": "#ff7f0e",
    "cdf_sequence": "#2ca02c",
    "tput_prefill": "#9467bd",
    "tput_decode": "#d62728",
    "kv_used": "#8c564b",
    "sweep": "#e377c2",
    # The engine workload's run: its calls' and steps' latency CDF, its users' CDF (with cdf_sequence: requests).
    "cdf_layer_call": "#006d2c",
    "cdf_step_attention": "#fd8d3c",
    "cdf_step": "#6baed6",
    "cdf_ttft": "#e7298a",
    "cdf_tpot": "#6a3d9a",
    # ... and its sweep: layer call p50 and p99, TTFT p99 and TPOT p99 against the swept parameter.
    "sweep_layer_p50": "#a6761d",
    "sweep_layer_p99": "#1b9e77",
    "sweep_ttft": "#7570b3",
    "sweep_tpot": "#e6ab02",
}
_POINT_COLORS = ("#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173")
_NAMES = {
    "prefill": "prefill piece",
    "decode": "decode step",
    "sequence": "whole sequence",
    "layer_call": "layer call",
    "step_attention": "step attention",  # an engine step's layer calls, summed
    "step": "engine step",  # all of it: with --model-step-ms
    "ttft": "TTFT",
    "tpot": "TPOT",
    "request": "whole request",
}
_MAX_POINTS = 400

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f2f2f2; } td.k, th.k { text-align: left; }
.bad { color: #b00020; font-weight: bold; } .ok { color: #1b5e20; font-weight: bold; }
svg.chart { display: block; margin: 10px 0; border: 1px solid #ddd; }
"""


def render(points: Sequence[tuple[str, RunResult, dict[str, Any]]], sweep_param: str | None = None) -> str:
    """The page for one run (one point) or a sweep (one point per value of ``sweep_param``)."""
    first = points[0][2]
    title = "chunkattn bench" + (f": sweep of {sweep_param}" if sweep_param else "")
    body = [f"<h1>{escape(title)}</h1>", _verdict(points)]
    params = first["params"] | {"layers called": first["layers_called"]}
    if sweep_param:
        params = {k: v for k, v in params.items() if k != "mode"} | {sweep_param: [p[0] for p in points]}
    body += ["<h2>Parameters</h2>", _kv_table(params)]
    body += ["<h2>Server</h2>", _kv_table(first["server_model"])]
    engine = first.get("engine") is not None
    if sweep_param:
        body += ["<h2>Throughput against p99 latency</h2>", _sweep_chart(sweep_param, points)]
        body += [_sweep_table(sweep_param, points)]
        if engine:
            body += [f"<h2>Layer calls and users' latency against {escape(sweep_param)}</h2>"]
            body += _engine_sweep_charts(sweep_param, points)
        step = "Engine step attention" if engine else "Decode step latency"
        body += [f"<h2>{step}, each point</h2>", _sweep_cdf(sweep_param, points)]
    for label, result, s in points:
        head = f"{sweep_param} = {label}" if sweep_param else "Results"
        body += [f"<h2>{escape(head)}</h2>", _summary_table(s)]
        if not sweep_param and engine:
            body += [_engine_cdfs(result), _attention_over_time(result, s), _throughput_charts(s), _kv_chart(s)]
        elif not sweep_param:
            body += [_latency_cdf(result), _throughput_charts(s), _kv_chart(s)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _verdict(points: Sequence[tuple[str, RunResult, dict[str, Any]]]) -> str:
    why = []
    errors = sum(sum(s["errors"].values()) for _, _, s in points)
    if errors:
        why.append(f"{errors} failed calls")
    for _, _, s in points:
        v = s["verify"]
        if v and v["mismatches"]:
            why.append(f"{v['mismatches']} outputs differ from the reference")
        elif v and not v["complete"]:
            why.append(f"verified {v['checked']} of {v['requested']} calls")
        if s["aborted"]:
            why.append(s["aborted"])
    if why:
        return f'<p class="bad">FAILED: {escape("; ".join(why))}</p>'
    return '<p class="ok">No errors.</p>'


def _kv_table(d: dict[str, Any]) -> str:
    rows = "".join(
        f'<tr><th class="k">{escape(str(k))}</th><td class="k">{"-" if v is None else escape(str(v))}</td></tr>'
        for k, v in d.items()
    )
    return f"<table>{rows}</table>"


def _summary_table(s: dict[str, Any]) -> str:
    facts = {
        "duration (s)": f"{s['duration_s']:.2f}",
        "sequences done / cut / failed": f"{s['sequences']} / {s['sequences_cut']} / {s['sequences_failed']}",
        "calls": s["calls"],
        "sequences in flight, at most": s["max_in_flight"],
        "sequences/s": f"{s['sequences_per_s']:.2f}",
        "model tokens prefill / decode": f"{s['tokens']['prefill']} / {s['tokens']['decode']}",
        "tokens/s prefill / decode": f"{s['tokens_per_s']['prefill']:.0f} / {s['tokens_per_s']['decode']:.0f}",
        "payload MB/s sent / received": (
            f"{s['payload_mb_per_s']['sent']:.2f} / {s['payload_mb_per_s']['received']:.2f}"
        ),
        "errors": ", ".join(f"{c}: {n}" for c, n in s["errors"].items()) or "none",
    }
    if s["open_loop"]:
        ol = s["open_loop"]
        facts["open loop: offered / achieved seq/s"] = f"{ol['offered_per_s']:g} / {ol['achieved_per_s']:.2f}"
        if ol["arrival_wait_ms"]["count"]:  # an engine queues its arrivals: no slot to wait for
            facts["open loop: wait for a slot p50 / max (ms)"] = (
                f"{fmt_ms(ol['arrival_wait_ms']['p50'])} / {fmt_ms(ol['arrival_wait_ms']['max'])}"
            )
    if s["release_errors"]:
        facts["failed releases"] = ", ".join(f"{c}: {n}" for c, n in s["release_errors"].items())
    if s["aborted"]:
        facts["aborted"] = s["aborted"]
    if s["verify"]:
        v = s["verify"]
        facts["verify"] = f"{v['checked']} of {v['requested']} calls, {v['mismatches']} mismatches"
    srv = s["server"]
    if srv and "error" not in srv:
        facts["server queue / compute ms (mean)"] = f"{fmt_ms(srv['queue_ms_mean'])} / {fmt_ms(srv['compute_ms_mean'])}"
        facts[f"server: model tokens prefill / decode ({server_tokens_unit(len(s['layers_called']))})"] = (
            f"{fmt_tokens(srv['tokens']['prefill'])} / {fmt_tokens(srv['tokens']['decode'])}"
        )
        facts["server KV blocks peak (1 s samples) / total"] = f"{srv['kv_blocks_used_peak']} / {srv['kv_blocks']}"
    e = s.get("engine")
    if e is not None:
        facts |= {
            "engines, API": f"{e['engines']}, {e['api']}",
            "KV blocks per engine, planes": f"{e['kv_blocks']}, {e['planes']}",
            "KV cache groups": describe_groups(e["groups"]),
            "engine steps (per s)": f"{e['steps']} ({e['steps_per_s']:.1f})",
            "per step: tokens / rows / decodes (means)": (
                f"{_fmt1(e['tokens_per_step'])} / {_fmt1(e['rows_per_step'])} / {_fmt1(e['decodes_per_step'])}"
            ),
            "tokens per layer call": _fmt1(e["tokens_per_call"]),
            "preemptions": e["preemptions"],
        }
    head = "".join(f"<th>{k}</th>" for k in ("n", *LATENCY_KEYS))
    rows = "".join(
        f'<tr><th class="k">{_NAMES[kind]} (ms)</th>'
        + f"<td>{lat['count']}</td>"
        + "".join(f"<td>{fmt_ms(lat[k])}</td>" for k in LATENCY_KEYS)
        + "</tr>"
        for kind, lat in latency_rows(s)
    )
    out = _kv_table(facts) + f'<table><tr><th class="k">latency</th>{head}</tr>{rows}</table>'
    if e is not None and e["engines"] > 1:
        out += _per_engine_table(e)
    return out


def _per_engine_table(e: dict[str, Any]) -> str:
    shown = shown_engines(e)
    note = (
        f"<p>The {len(shown)} of {e['engines']} engines with the highest step attention p99.</p>"
        if len(shown) < e["engines"]
        else ""
    )
    head = '<tr><th class="k">engine</th><th>steps</th><th>tokens</th><th>step attention p50 (ms)</th>'
    head += "<th>step attention p99 (ms)</th></tr>"
    rows = "".join(
        f'<tr><td class="k">{x["engine"]}</td><td>{x["steps"]}</td><td>{x["tokens"]}</td>'
        f"<td>{fmt_ms(x['step_attention_ms']['p50'])}</td><td>{fmt_ms(x['step_attention_ms']['p99'])}</td></tr>"
        for x in shown
    )
    return f'{note}<table class="per-engine">{head}{rows}</table>'


def _fmt1(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _latency_cdf(result: RunResult) -> str:
    series = []
    for kind in KINDS:
        ms = sorted(1000 * x for x in result.recorder.latencies(kind))
        xs, ys = _cdf(ms)
        if xs:
            series.append(Series(_NAMES[kind], xs, ys, COLORS[f"cdf_{kind}"]))
    return line_chart(
        series, title="Latency CDF", x_label="latency (ms, log scale)", y_label="fraction <= x", log_x=True,
        chart_id="latency-cdf",
    )  # fmt: skip


def _engine_seconds(result: RunResult) -> dict[str, list[float]]:
    """The engine workload's latencies in seconds, by kind: layer calls, step attention, whole steps, TTFT, TPOT,
    whole requests."""
    rec = result.recorder
    return {
        "layer_call": rec.layer_latency,
        "step_attention": [x[5] for x in rec.engine_steps],
        "step": [x[6] for x in rec.engine_steps],
        "ttft": rec.ttft,
        "tpot": rec.tpot,
        "request": rec.sequence_latency,
    }


def _engine_cdfs(result: RunResult) -> str:
    """Two latency CDFs: the attention tier's (each layer call; each step's calls summed; whole steps) and what
    the engines' users saw (time to first token, time per output token, whole requests)."""
    seconds = _engine_seconds(result)
    colors = {kind: COLORS[f"cdf_{kind}"] for kind in ("layer_call", "step_attention", "step", "ttft", "tpot")}
    colors["request"] = COLORS["cdf_sequence"]
    charts = []
    for kinds, title, chart_id in (
        (("layer_call", "step_attention", "step"), "Layer call and engine step latency CDF", "engine-cdf"),
        (("ttft", "tpot", "request"), "What users see: TTFT, TPOT and request latency CDF", "users-cdf"),
    ):
        series = []
        for kind in kinds:
            xs, ys = _cdf(sorted(1000 * x for x in seconds[kind]))
            if xs:
                series.append(Series(_NAMES[kind], xs, ys, colors[kind]))
        x_label = "latency (ms, log scale)"
        charts.append(
            line_chart(series, title=title, x_label=x_label, y_label="fraction <= x", log_x=True, chart_id=chart_id)
        )
    return "\n".join(charts)


_TIME_BINS = 200  # an engine with more steps than this is drawn as its mean step attention per 1/200 of the run


def _attention_over_time(result: RunResult, s: dict[str, Any]) -> str:
    """Each engine's step attention (its layer calls summed) against when the step ended: every step, or the mean
    per 1/_TIME_BINS of the run for an engine with more steps; the slowest engines (report.shown_engines) when
    there are more than the table lists."""
    rec = result.recorder
    duration = max(rec.duration_s, 1e-9)
    width = duration / _TIME_BINS
    series = []
    binned = False
    for i, x in enumerate(shown_engines(s["engine"])):
        steps = [(t, 1000 * a) for t, engine, _, _, _, a, _ in rec.engine_steps if engine == x["engine"]]
        if len(steps) > _TIME_BINS:
            binned = True
            sums: dict[int, list[float]] = {}
            for t, ms in steps:
                sums.setdefault(min(int(t / width), _TIME_BINS - 1), []).append(ms)
            steps = [((b + 0.5) * width, sum(v) / len(v)) for b, v in sorted(sums.items())]
        steps.sort()
        series.append(
            Series(
                f"engine {x['engine']}",
                [t for t, _ in steps],
                [a for _, a in steps],
                _POINT_COLORS[i % len(_POINT_COLORS)],
            )
        )
    return line_chart(
        series, title="Step attention over the run, per engine", x_label="time (s)",
        y_label="step attention (ms)" + (", mean per bin" if binned else ""), chart_id="engine-attention",
    )  # fmt: skip


def _throughput_charts(s: dict[str, Any]) -> str:
    """Prefill and decode tokens/s over time, a chart each on its own y scale: decode's rate is often a
    hundredth of prefill's, a flat line along the bottom of prefill's axis."""
    t = s["timeline"]
    charts = []
    for kind in ("prefill", "decode"):
        series = [Series(f"{kind} tokens/s", t["t"], t[f"{kind}_tokens_per_s"], COLORS[f"tput_{kind}"])]
        charts.append(
            line_chart(
                series,
                title=f"{kind.capitalize()} throughput over time",
                x_label="time (s)",
                y_label=f"{kind} tokens/s (model tokens)",
                chart_id=f"throughput-{kind}",
            )
        )
    return "\n".join(charts)


def _kv_chart(s: dict[str, Any]) -> str:
    t = s["timeline"]
    if not t["server_t"]:
        return "<p>Run with --metrics-url to see the server's KV blocks in use over time.</p>"
    series = [Series("KV blocks used", t["server_t"], t["kv_blocks_used"], COLORS["kv_used"])]
    return line_chart(series, title="Server KV blocks in use", x_label="time (s)", y_label="blocks", chart_id="kv")


def _sweep_chart(param: str, points: Sequence[tuple[str, RunResult, dict[str, Any]]]) -> str:
    xs = [s["tokens_per_s"]["total"] for _, _, s in points]
    ys = [_p99(s) for _, _, s in points]
    keep = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    series = [Series(f"by {param}", [x for x, _ in keep], [y for _, y in keep], COLORS["sweep"], markers=True)]
    step = "engine step attention" if points[0][2].get("engine") else "step latency"
    return line_chart(
        series, title=f"Throughput against p99 {step}", x_label="tokens/s", y_label="p99 latency (ms)",
        chart_id="sweep",
    )  # fmt: skip


def _engine_sweep_charts(param: str, points: Sequence[tuple[str, RunResult, dict[str, Any]]]) -> list[str]:
    """Against the swept value: layer call p50 and p99 (one chart), TTFT p99 and TPOT p99 (a chart each, each on
    its own scale: TTFT is often many steps long, TPOT about one, a flat line along the bottom of TTFT's axis)."""
    xs = [_value(label, i) for i, (label, _, _) in enumerate(points)]

    def series(name: str, kind: str, p: str, color: str) -> Series:
        keep = [(x, s["engine"][f"{kind}_ms"][p]) for x, (_, _, s) in zip(xs, points, strict=True)]
        keep = [(x, y) for x, y in keep if y is not None]
        return Series(name, [x for x, _ in keep], [y for _, y in keep], COLORS[color], markers=True)

    layer = [series(p, "layer_call", p, f"sweep_layer_{p}") for p in ("p50", "p99")]
    ttft = [series("TTFT p99", "ttft", "p99", "sweep_ttft")]
    tpot = [series("TPOT p99", "tpot", "p99", "sweep_tpot")]
    charts = [
        (layer, "Layer call latency", "layer call (ms)", "sweep-layer"),
        (ttft, "Time to first token, p99", "TTFT p99 (ms)", "sweep-ttft"),
        (tpot, "Time per output token, p99", "TPOT p99 (ms)", "sweep-tpot"),
    ]
    return [
        line_chart(s, title=f"{title} against {param}", x_label=param, y_label=y_label, chart_id=chart_id)
        for s, title, y_label, chart_id in charts
    ]


def _value(label: str, i: int) -> float:
    """A sweep point's value for an x axis: its label's number (else its place)."""
    try:
        return float(label)
    except ValueError:
        return float(i)


def _sweep_table(param: str, points: Sequence[tuple[str, RunResult, dict[str, Any]]]) -> str:
    if points[0][2].get("engine"):
        return _engine_sweep_table(param, points)
    head = f'<tr><th class="k">{escape(param)}</th><th>seq/s</th><th>tokens/s</th><th>p50 (ms)</th>'
    head += "<th>p99 (ms)</th><th>errors</th></tr>"
    rows = "".join(
        f'<tr><td class="k">{escape(label)}</td><td>{s["sequences_per_s"]:.2f}</td>'
        f"<td>{s['tokens_per_s']['total']:.0f}</td><td>{fmt_ms(_step(s)['p50'])}</td><td>{fmt_ms(_p99(s))}</td>"
        f"<td>{sum(s['errors'].values())}</td></tr>"
        for label, _, s in points
    )
    return f"<table>{head}{rows}</table>"


def _engine_sweep_table(param: str, points: Sequence[tuple[str, RunResult, dict[str, Any]]]) -> str:
    cols = (
        ("layer call p50", "layer_call", "p50"), ("layer call p99", "layer_call", "p99"),
        ("step attention p99", "step_attention", "p99"), ("TTFT p99", "ttft", "p99"), ("TPOT p99", "tpot", "p99"),
    )  # fmt: skip
    head = f'<tr><th class="k">{escape(param)}</th><th>seq/s</th><th>tokens/s</th>'
    head += "".join(f"<th>{name} (ms)</th>" for name, _, _ in cols) + "<th>preemptions</th><th>errors</th></tr>"
    rows = "".join(
        f'<tr><td class="k">{escape(label)}</td><td>{s["sequences_per_s"]:.2f}</td>'
        f"<td>{s['tokens_per_s']['total']:.0f}</td>"
        + "".join(f"<td>{fmt_ms(s['engine'][f'{kind}_ms'][p])}</td>" for _, kind, p in cols)
        + f"<td>{s['engine']['preemptions']}</td><td>{sum(s['errors'].values())}</td></tr>"
        for label, _, s in points
    )
    return f"<table>{head}{rows}</table>"


def _sweep_cdf(param: str, points: Sequence[tuple[str, RunResult, dict[str, Any]]]) -> str:
    series = []
    engine = points[0][2].get("engine") is not None
    for i, (label, result, _) in enumerate(points):
        seconds = _engine_seconds(result)["step_attention"] if engine else result.recorder.latencies("decode")
        xs, ys = _cdf(sorted(1000 * x for x in seconds))
        if xs:
            series.append(Series(f"{param}={label}", xs, ys, _POINT_COLORS[i % len(_POINT_COLORS)]))
    return line_chart(
        series, title="Engine step attention CDF" if engine else "Decode step latency CDF",
        x_label="latency (ms, log scale)", y_label="fraction <= x", log_x=True, chart_id="sweep-cdf",
    )  # fmt: skip


def _step(s: dict[str, Any]) -> dict[str, Any]:
    """The decode-step latencies, or the prefill pieces' when there were no decodes; an engine's step attention
    (an engine step's layer calls, as a decode step's are a sequence's)."""
    if s.get("engine"):
        step: dict[str, Any] = s["engine"]["step_attention_ms"]
        return step
    lat: dict[str, dict[str, Any]] = s["latency_ms"]
    return lat["decode"] if lat["decode"]["count"] else lat["prefill"]


def _p99(s: dict[str, Any]) -> float | None:
    value = _step(s)["p99"]
    return None if value is None else float(value)


def _cdf(sorted_ms: list[float]) -> tuple[list[float], list[float]]:
    """At most _MAX_POINTS points of the empirical CDF (the largest value always included)."""
    n = len(sorted_ms)
    if not n:
        return [], []
    idx = sorted({round(i * (n - 1) / (_MAX_POINTS - 1)) for i in range(_MAX_POINTS)}) if n > _MAX_POINTS else range(n)
    return [sorted_ms[i] for i in idx], [(i + 1) / n for i in idx]
