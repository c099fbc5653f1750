"""The bench's pure parts: percentiles, the metrics parser, workloads, the verifier, charts and the CSV."""

from __future__ import annotations

import asyncio
import io
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkattn_client import BatchEntry, LayerInfo, ReferenceModel, ServerInfo
from chunkattn_client.bench import html, promtext, report, svg
from chunkattn_client.bench.runner import BenchConfig, Recorder, RunResult, Verifier
from chunkattn_client.bench.stats import percentile, summarize
from chunkattn_client.bench.workload import (
    Lengths,
    LengthSource,
    SequenceSpec,
    Step,
    WorkloadError,
    choose_layers,
    read_trace,
    steps,
)

# -- percentiles ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "p", "want"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 90, 3.7),
        ([1, 2, 3, 4], 100, 4),
        ([1, 2, 3, 4], 0, 1),
        ([15, 20, 35, 40, 50], 40, 29.0),  # rank 1.6: 20 + 0.6 * 15
        ([15, 20, 35, 40, 50], 99, 49.6),  # rank 3.96: 40 + 0.96 * 10
        ([7], 99, 7),
    ],
)
def test_percentile_on_known_samples(values: list[float], p: float, want: float) -> None:
    assert percentile(values, p) == pytest.approx(want)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(1)
    for n in (2, 3, 10, 101, 1000):
        values = sorted(rng.expovariate(1.0) for _ in range(n))
        for p in (50, 90, 95, 99, 99.9):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12)


def test_percentile_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summarize() -> None:
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert s == {"count": 4, "mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p95": pytest.approx(3.85),
                 "p99": pytest.approx(3.97), "max": 4.0}  # fmt: skip
    assert summarize([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None,
                             "max": None}  # fmt: skip


# -- the metrics page -------------------------------------------------------------------------------------

PAGE = """# HELP chunkattn_requests_total Requests answered.
# TYPE chunkattn_requests_total counter
chunkattn_requests_total{code="OK",rpc="Attend"} 12.0
chunkattn_requests_total{rpc="Attend",code="NOT_FOUND"} 2.0
chunkattn_requests_total{code="OK",rpc="Release"} 1.0
chunkattn_tokens_total{kind="prefill"} 1.5e+03
chunkattn_kv_blocks_used 7.0
odd_total{path="a\\"b\\\\c\\nd"} 3 1700000000000
"""


def test_promtext_parses_samples_labels_and_escapes() -> None:
    s = promtext.parse(PAGE)
    assert s[("chunkattn_requests_total", (("code", "OK"), ("rpc", "Attend")))] == 12
    assert promtext.total(s, "chunkattn_requests_total", rpc="Attend") == 14
    assert promtext.total(s, "chunkattn_requests_total", code="OK") == 13
    assert promtext.total(s, "chunkattn_tokens_total", kind="prefill") == 1500
    assert promtext.total(s, "chunkattn_kv_blocks_used") == 7
    assert promtext.total(s, "missing") == 0
    assert s[("odd_total", (("path", 'a"b\\c\nd'),))] == 3
    assert promtext.label_values(s, "chunkattn_requests_total", "code") == {"OK", "NOT_FOUND"}
    before = promtext.parse('chunkattn_requests_total{code="OK",rpc="Attend"} 10\n')
    assert promtext.delta(s, before, "chunkattn_requests_total", rpc="Attend", code="OK") == 2


def test_promtext_refuses_garbage() -> None:
    with pytest.raises(promtext.MetricsError, match="line 1"):
        promtext.parse("this is not a metric line at all\n")


def test_promtext_fetch_failure_is_a_metrics_error() -> None:
    with pytest.raises(promtext.MetricsError, match="could not scrape"):
        promtext.fetch("http://127.0.0.1:9/metrics", timeout_s=2)


# -- workloads ------------------------------------------------------------------------------------------


def test_steps_split_the_prompt_and_add_one_decode_per_output_token() -> None:
    assert steps(SequenceSpec(20, 2), 8) == [
        Step("prefill", 0, 8), Step("prefill", 8, 8), Step("prefill", 16, 4), Step("decode", 20, 1),
        Step("decode", 21, 1),
    ]  # fmt: skip
    assert steps(SequenceSpec(5, 0), 0) == [Step("prefill", 0, 5)]
    assert steps(SequenceSpec(5, 1), 100) == [Step("prefill", 0, 5), Step("decode", 5, 1)]


def test_lengths_parse_and_sample() -> None:
    assert Lengths.parse("128", what="x", minimum=1) == Lengths(128, 128)
    fixed_or_range = Lengths.parse("3:9", what="x", minimum=1)
    rng = random.Random(0)
    assert {fixed_or_range.sample(rng) for _ in range(500)} == set(range(3, 10))
    for bad in ("0", "9:3", "a", "1:2:3", ""):
        with pytest.raises(WorkloadError, match="--prompt-len"):
            Lengths.parse(bad, what="--prompt-len", minimum=1)


def test_trace_is_read_in_order_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 5, "output_len": 3}\n\n{"prompt_len": 1, "output_len": 0, "x": 1}\n')
    trace = read_trace(path)
    assert trace == [SequenceSpec(5, 3), SequenceSpec(1, 0)]
    src = LengthSource(Lengths(1, 1), Lengths(1, 1), trace, seed=0)
    assert [src.next() for _ in range(3)] == [SequenceSpec(5, 3), SequenceSpec(1, 0), SequenceSpec(5, 3)]
    for text, match in [
        ('{"prompt_len": 0, "output_len": 3}\n', ":1: expected prompt_len >= 1"),
        ('{"prompt_len": 2}\n', ":1: expected a JSON object"),
        ("\n[1, 2]\n", ":2: expected a JSON object"),
        ('{"prompt_len": 2.5, "output_len": 1}\n', ":1: expected prompt_len >= 1"),
        ("\n", "lists no sequences"),
    ]:
        path.write_text(text)
        with pytest.raises(WorkloadError, match=match):
            read_trace(path)
    with pytest.raises(WorkloadError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def _info(kv_sources: tuple[int | None, ...] = (None, None, None), chunks: tuple[int, ...] = (4, 4, 0)) -> ServerInfo:
    layers = tuple(LayerInfo(i, c, 0, s, 0.5, False) for i, (c, s) in enumerate(zip(chunks, kv_sources, strict=True)))
    return ServerInfo("0", "torch", "cpu", 4, 2, 8, layers, 4, 100, 100, 1024, "float32", ("float32",), 0, 1 << 20)


def test_choose_layers() -> None:
    info = _info(kv_sources=(None, 0, None))
    assert choose_layers(info, "all") == (0, 1, 2)
    assert choose_layers(info, "2,0") == (0, 2)
    with pytest.raises(WorkloadError, match=r"layers 0\.\.2; got \[3\]"):
        choose_layers(info, "0,3")
    with pytest.raises(WorkloadError, match="layer 1 reads layer 0's KV"):
        choose_layers(info, "1,2")
    with pytest.raises(WorkloadError, match="expected 'all'"):
        choose_layers(info, "first")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({}, "--duration SECONDS or --sequences N"),
        ({"duration_s": 0.0}, "--duration must be > 0"),
        ({"sequences": 0}, "--sequences must be >= 1"),
        ({"sequences": 1, "rate": -1.0}, "--rate must be > 0"),
        ({"sequences": 1, "prefill_chunk": -1}, "--prefill-chunk"),
        ({"sequences": 1, "transport": "carrier pigeon"}, "--transport"),
        ({"sequences": 1, "concurrency": 0}, "--concurrency"),
    ],
)
def test_config_check_names_the_bad_option(kw: dict[str, object], match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        BenchConfig(target="x", **kw).check()  # type: ignore[arg-type]


# -- the verifier -----------------------------------------------------------------------------------------


def test_verifier_finds_a_wrong_output_and_passes_a_right_one() -> None:
    info = _info()
    verifier = Verifier(info, "float32", budget=1000, seed=0)
    check = None
    while check is None:  # half the sequences are sampled
        check = verifier.sample(num_calls=2)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((6, 2, 8)).astype(np.float32) for _ in range(2))
    entry = BatchEntry("s", 0, 6)
    right = ReferenceModel.for_server(info).attend(0, [entry], q, k, v).astype(np.float32)
    asyncio.run(check.check(0, entry, q, k, v, right))
    assert (verifier.checked, verifier.result()["mismatches"]) == (1, 0)
    q2 = rng.standard_normal((1, 4, 8)).astype(np.float32)
    k2, v2 = (rng.standard_normal((1, 2, 8)).astype(np.float32) for _ in range(2))
    asyncio.run(check.check(0, BatchEntry("s", 6, 1), q2, k2, v2, np.zeros((1, 4, 8), np.float32)))
    result = verifier.result()
    assert (result["checked"], result["mismatches"]) == (2, 1)
    assert result["first_mismatches"][0]["position"] == 6
    assert report.mismatched({"verify": result})


def test_verifier_budget_is_never_exceeded() -> None:
    verifier = Verifier(_info(), "float32", budget=5, seed=3)
    reserved = []
    for _ in range(100):
        check = verifier.sample(num_calls=2)
        if check is not None:
            reserved.append(check._left)
    assert sum(reserved) == 5


# -- charts and the CSV --------------------------------------------------------------------------------------


def test_nice_and_log_ticks() -> None:
    assert svg.nice_ticks(0, 97) == [0, 20, 40, 60, 80, 100]
    assert svg.nice_ticks(0.0, 0.93) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg.log_ticks(3, 700) == [2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_line_chart_draws_every_series_and_escapes_names() -> None:
    chart = svg.line_chart(
        [svg.Series("a<b", [1, 2, 3], [1, 4, 9], "#123456"), svg.Series("c", [1, 10], [0.5, 1], "#654321")],
        title="T & t", x_label="x", y_label="y", log_x=True, chart_id="c1",
    )  # fmt: skip
    assert chart.count("<polyline") == 2
    assert 'stroke="#123456"' in chart
    assert 'stroke="#654321"' in chart
    assert "a&lt;b" in chart
    assert "T &amp; t" in chart
    assert "no data" in svg.line_chart([], title="T", x_label="x", y_label="y")


def test_csv_has_one_row_per_point() -> None:
    lat = {k: 1.0 for k in ("p50", "p90", "p95", "p99", "max")} | {"count": 1, "mean": 1.0}
    s = {
        "duration_s": 1.0, "sequences": 2, "sequences_cut": 0, "calls": 8, "errors": {"UNAVAILABLE": 3},
        "tokens": {"prefill": 10, "decode": 4}, "tokens_per_s": {"total": 14.0}, "sequences_per_s": 2.0,
        "payload_mb_per_s": {"sent": 1.0, "received": 0.5}, "latency_ms": {k: lat for k in report.KINDS},
    }  # fmt: skip
    out = io.StringIO()
    report.write_csv([("1", s), ("2", s)], out)
    lines = out.getvalue().splitlines()
    assert lines[0].split(",") == list(report.CSV_COLUMNS)
    assert len(lines) == 3
    assert lines[1].split(",")[5] == "3"


def test_timeline_buckets_are_per_second_and_the_last_runs_to_the_end() -> None:
    from chunkattn_client.bench.runner import Recorder, RunResult

    rec = Recorder()
    rec.steps = [
        (0.2, "prefill", 100, 0.1),
        (0.9, "decode", 1, 0.01),
        (1.5, "decode", 1, 0.01),
        (2.6, "decode", 1, 0.01),
    ]
    rec.end = 2.8
    result = RunResult(BenchConfig(target="x", sequences=1), _info(), (0,), rec, None, None, [(0.5, 7.0, 1.0)], None)
    t = report.timeline(result)
    assert t["t"] == [0.0, 1.0]  # 2.8 s: [0, 1) and [1, 2.8)
    assert t["prefill_tokens_per_s"] == [100.0, 0.0]
    assert t["decode_tokens_per_s"] == [1.0, pytest.approx(2 / 1.8)]
    assert (t["server_t"], t["kv_blocks_used"]) == ([0.5], [7.0])


def test_recent_p50_looks_at_the_last_seconds_only() -> None:
    from chunkattn_client.bench.runner import Recorder

    rec = Recorder()
    now = rec.now()
    rec.steps = [(now - 100, "decode", 1, 9.0), (now, "decode", 1, 0.002), (now, "decode", 1, 0.004)]
    assert rec.recent_p50_ms() == pytest.approx(3.0)
    rec.steps = [(now, "prefill", 8, 0.010)]
    assert rec.recent_p50_ms() == pytest.approx(10.0)


# -- the HTML report: decode on its own scale, the server's tokens in model tokens -----------------------


def _run(server: dict[str, Any] | None) -> tuple[RunResult, dict[str, Any]]:
    """A 3 s run over the 3 layers of _info(): prefill ~10,000 tokens/s, decode 30-37 tokens/s."""
    rec = Recorder()
    rec.steps = [(0.5, "prefill", 10_000, 0.2), (1.5, "prefill", 8_000, 0.2)]
    for second, n in enumerate((30, 37, 35)):
        rec.steps += [(second + (i + 0.5) / n, "decode", 1, 0.01) for i in range(n)]
    rec.tokens = Counter(prefill=18_000, decode=102)
    rec.layer_tokens = Counter(prefill=3 * 18_000, decode=3 * 102)
    rec.calls, rec.sequences, rec.end = 3 * len(rec.steps), 2, 3.0
    result = RunResult(BenchConfig(target="x", sequences=2), _info(), (0, 1, 2), rec, None, server, [], None)
    return result, report.summary(result)


def _chart(page: str, chart_id: str) -> str:
    start = page.index(f'id="{chart_id}"')
    return page[start : page.index("</svg>", start)]


def _y_ticks(chart: str) -> list[float]:
    return [float(t.replace(",", "")) for t in re.findall(r'class="y-tick"[^>]*>([^<]+)</text>', chart)]


def _server_stats(layer_tokens: dict[str, int]) -> dict[str, Any]:
    return {
        "requests": {"Attend": {"OK": 3 * 69}}, "layer_tokens": layer_tokens, "received_bytes": 1,
        "sent_bytes": 1, "queue_ms_mean": 0.5, "compute_ms_mean": 2.0, "kv_blocks": 100,
        "kv_blocks_used_peak": 9, "kv_blocks_used_after": 0, "failed_scrapes": 0,
    }  # fmt: skip


def test_decode_throughput_has_its_own_chart_on_decodes_scale() -> None:
    result, s = _run(None)
    page = html.render([("", result, s)])
    assert "<script" not in page
    prefill, decode = _chart(page, "throughput-prefill"), _chart(page, "throughput-decode")
    assert "Decode throughput over time" in decode
    assert 'stroke="{}"'.format(html.COLORS["tput_decode"]) in decode
    assert 'stroke="{}"'.format(html.COLORS["tput_prefill"]) not in decode
    assert "decode tokens/s" not in prefill
    # Each chart's y axis is fitted to its own values: decode's tops out at 40 (37 tokens/s at most), not at
    # prefill's 10,000, where decode would be a flat line along the bottom.
    assert max(_y_ticks(prefill)) == 10_000
    assert max(_y_ticks(decode)) == 40
    points = re.search(r'points="([^"]+)"', decode)
    assert points is not None
    ys = [float(p.split(",")[1]) for p in points.group(1).split()]
    top, bottom = 36, svg.HEIGHT - 52  # the plot's edges (svg._TOP, svg._BOTTOM)
    assert min(ys) < top + 0.1 * (bottom - top)  # 37 of 40: near the top of the plot
    assert max(ys) < top + 0.3 * (bottom - top)  # 30 of 40: well above the bottom


def test_the_servers_tokens_are_shown_in_model_tokens() -> None:
    # The server counted each model token once per layer called (3 here), as chunkattn_tokens_total does.
    raw = {"prefill": 3 * 18_000, "decode": 3 * 102}
    result, s = _run(_server_stats(raw))
    srv = s["server"]
    assert srv["tokens"] == s["tokens"] == {"prefill": 18_000, "decode": 102}
    assert srv["layer_tokens"] == raw == s["layer_tokens"]  # the raw count is kept
    page = html.render([("", result, s)])
    label = "server: model tokens prefill / decode (chunkattn_tokens_total / 3 layers)"
    assert f'<th class="k">{label}</th><td class="k">18000 / 102</td>' in page
    assert '<th class="k">model tokens prefill / decode</th><td class="k">18000 / 102</td>' in page
    assert "model tokens counted prefill 18000, decode 102 (chunkattn_tokens_total / 3 layers)" in report.table(s)


def test_server_summary_divides_by_the_layers_called() -> None:
    out = report.server_summary(_server_stats({"prefill": 10, "decode": 3}), 4)
    assert out is not None
    assert out["tokens"] == {"prefill": 2.5, "decode": 0.75}  # calls that were not whole steps: a fraction
    assert out["layer_tokens"] == {"prefill": 10, "decode": 3}
    assert list(out).index("tokens") < list(out).index("layer_tokens")
    one = report.server_summary(_server_stats({"prefill": 8, "decode": 1}), 1)
    assert one is not None
    assert one["tokens"] == {"prefill": 8, "decode": 1}
    assert report.server_summary(None, 4) is None
    assert report.server_summary({"error": "unreachable"}, 4) == {"error": "unreachable"}
    assert (report.fmt_tokens(2.5), report.fmt_tokens(0.75), report.fmt_tokens(18_000)) == ("2.50", "0.75", "18000")
    assert report.server_tokens_unit(1) == "chunkattn_tokens_total / 1 layer"
