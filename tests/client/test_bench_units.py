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


# -- the engine workload's report ---------------------------------------------------------------------------

# Four engine steps of two engines over layers 0 and 1 (2 layer calls each): (end s, engine, tokens, rows,
# decodes, attention s, step s). Prefill tokens 10 + 4 + 0 + 0 = 14, decodes 0 + 2 + 3 + 1 = 6.
ENGINE_STEPS = [
    (0.2, 0, 10, 2, 0, 0.010, 0.012),
    (0.5, 1, 6, 3, 2, 0.020, 0.025),
    (1.2, 0, 3, 3, 3, 0.004, 0.005),
    (2.5, 1, 1, 1, 1, 0.002, 0.003),
]
LAYOUT = {"kv_blocks": 10, "groups": [{"chunk_size": 4, "layers": [0, 1]}], "planes": 1, "spaces": ["a", "b"]}


def _engine_run(
    engines: int = 2, slower: float = 1.0, steps: list[tuple[float, int, int, int, int, float, float]] | None = None
) -> tuple[RunResult, dict[str, Any]]:
    """A 2.8 s engine run: ENGINE_STEPS (their attention and layer calls ``slower`` times as long), 3 requests."""
    rec = Recorder()
    given = ENGINE_STEPS if steps is None else steps
    rec.engine_steps = [(t, e, n, r, d, a * slower, s * slower) for t, e, n, r, d, a, s in given]
    rec.layer_latency = [slower * ms / 1000 for ms in range(1, 9)]  # 1..8 ms
    rec.ttft, rec.tpot = [0.1, 0.3, 0.2], [0.01, 0.03]
    rec.sequence_latency = [0.5, 0.9, 1.0]
    rec.tokens = Counter(prefill=14, decode=6)
    rec.layer_tokens = Counter(prefill=2 * 14, decode=2 * 6)
    rec.calls, rec.sequences, rec.preemptions, rec.end = 8, 3, 2, 2.8
    config = BenchConfig(target="x", sequences=3, workload="engine", engines=engines, kv_blocks=10)
    result = RunResult(config, _info(), (0, 1), rec, None, None, [], None, LAYOUT)
    return result, report.summary(result)


def test_engine_summary_from_known_steps() -> None:
    _, s = _engine_run()
    e = s["engine"]
    assert (e["engines"], e["api"], e["kv_blocks"], e["groups"], e["planes"]) == (2, "blocks", 10, LAYOUT["groups"], 1)
    assert e["steps"] == 4
    assert e["steps_per_s"] == pytest.approx(4 / 2.8)
    assert (e["tokens_per_step"], e["rows_per_step"], e["decodes_per_step"]) == (5.0, 2.25, 1.5)
    assert e["tokens_per_call"] == 40 / 8  # layer tokens over calls
    assert e["preemptions"] == 2
    lc = e["layer_call_ms"]
    assert (lc["count"], lc["p50"], lc["p99"], lc["max"]) == (8, pytest.approx(4.5), pytest.approx(7.93), 8.0)
    att = e["step_attention_ms"]  # 2, 4, 10, 20 ms
    assert (att["count"], att["p50"], att["p99"], att["max"]) == (4, pytest.approx(7.0), pytest.approx(19.7), 20.0)
    assert e["step_ms"]["p50"] == pytest.approx(8.5)  # 3, 5, 12, 25 ms
    assert (e["ttft_ms"]["count"], e["ttft_ms"]["p50"], e["ttft_ms"]["max"]) == (3, pytest.approx(200), 300)
    assert (e["tpot_ms"]["count"], e["tpot_ms"]["p50"]) == (2, pytest.approx(20))
    # Each engine's own steps: engine 0's attention 10 and 4 ms, engine 1's 20 and 2 ms.
    assert e["per_engine"] == [
        {"engine": 0, "steps": 2, "tokens": 13, "step_attention_ms": {"p50": 7.0, "p99": pytest.approx(9.94)}},
        {"engine": 1, "steps": 2, "tokens": 7, "step_attention_ms": {"p50": 11.0, "p99": pytest.approx(19.82)}},
    ]
    # The per-sequence kinds are empty (an engine step batches many requests' prefills and decodes): honest zeros.
    assert (s["latency_ms"]["prefill"]["count"], s["latency_ms"]["decode"]["count"]) == (0, 0)
    assert s["latency_ms"]["sequence"]["p50"] == pytest.approx(900)
    # The timeline's tokens/s come from the engine steps: [0, 1) and [1, 2.8).
    t = s["timeline"]
    assert t["prefill_tokens_per_s"] == [14.0, 0.0]
    assert t["decode_tokens_per_s"] == [2.0, pytest.approx(4 / 1.8)]


def test_an_engine_that_made_no_step_is_listed_with_no_latency() -> None:
    _, s = _engine_run(engines=3)
    assert s["engine"]["per_engine"][2] == {"engine": 2, "steps": 0, "tokens": 0,
                                            "step_attention_ms": {"p50": None, "p99": None}}  # fmt: skip
    empty = report.engine_summary(_engine_run(steps=[])[0])
    assert empty is not None
    assert (empty["steps"], empty["tokens_per_step"], empty["step_attention_ms"]["p50"]) == (0, None, None)


def _row(table: str, name: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(name + "  "))
    return line[len(name) :].split()


def test_engine_table_shows_the_engines_and_their_latencies() -> None:
    _, s = _engine_run()
    out = report.table(s)
    assert "requests 3 done, 0 cut at the end" in out
    assert "engines: 2, blocks API, 10 KV blocks each, 1 plane(s); KV cache groups 1 (chunk 4: layers 0-1)" in out
    assert "engine steps: 4 (1.4/s); per step 5.0 tokens, 2.2 rows, 1.5 decodes (means); 5.0 tokens per call;" in out
    assert "2 preemptions" in out
    assert "per engine (steps, tokens, step attention p50/p99 ms): 0: 2, 13, 7.00/9.94; 1: 2, 7, 11.00/19.82" in out
    # The latency table: the engine's rows instead of the (empty) prefill piece and decode step rows.
    assert "prefill piece" not in out
    assert "decode step" not in out
    assert _row(out, "layer call") == ["8", "4.50", "7.30", "7.65", "7.93", "8.00"]
    assert _row(out, "step attention") == ["4", "7.00", "17.00", "18.50", "19.70", "20.00"]
    assert _row(out, "TTFT") == ["3", "200", "280", "290", "298", "300"]
    assert _row(out, "TPOT") == ["2", "20.00", "28.00", "29.00", "29.80", "30.00"]
    assert _row(out, "request")[:2] == ["3", "900"]
    one = report.table(_engine_run(engines=1, steps=ENGINE_STEPS[:1])[1])
    assert "per engine (" not in one  # one engine: the run's numbers are its own


def test_a_sequences_run_has_no_engine_parts() -> None:
    result, s = _run(None)
    assert s["engine"] is None
    out = report.table(s)
    assert "engine" not in out
    assert _row(out, "decode step")[0] == "102"
    assert "sequences 2 done" in out
    csv_out = io.StringIO()
    report.write_csv([("run", s)], csv_out)
    header, row = (line.split(",") for line in csv_out.getvalue().splitlines())
    cells = dict(zip(header, row, strict=True))
    assert cells["decode_p50_ms"] == "10.000"
    assert all(cells[c] == "" for c in header[header.index("engines") :])
    page = html.render([("", result, s)])
    for chart_id in ("engine-cdf", "users-cdf", "engine-attention"):
        assert f'id="{chart_id}"' not in page
    assert 'id="latency-cdf"' in page
    assert "step attention" not in page


def test_engine_csv_columns() -> None:
    _, s = _engine_run()
    out = io.StringIO()
    report.write_csv([("2", s)], out)
    header, row = (line.split(",") for line in out.getvalue().splitlines())
    assert header == list(report.CSV_COLUMNS)
    cells = dict(zip(header, row, strict=True))
    assert (cells["engines"], cells["engine_steps"], cells["engine_preemptions"]) == ("2", "4", "2")
    assert (cells["engine_tokens_per_step"], cells["engine_tokens_per_call"]) == ("5.000", "5.000")
    assert (cells["layer_call_p50_ms"], cells["layer_call_p99_ms"]) == ("4.500", "7.930")
    assert (cells["step_attention_p99_ms"], cells["engine_step_p50_ms"]) == ("19.700", "8.500")
    assert (cells["ttft_p50_ms"], cells["tpot_max_ms"]) == ("200.000", "30.000")
    assert cells["decode_p50_ms"] == ""  # no per-sequence decode steps in an engine run
    assert cells["sequence_p50_ms"] == "900.000"


def _points(chart: str) -> list[list[tuple[float, float]]]:
    return [
        [(float(x), float(y)) for x, y in (p.split(",") for p in m.split())]
        for m in re.findall(r'<polyline[^>]*points="([^"]+)"', chart)
    ]


def test_engine_html_run_page() -> None:
    result, s = _engine_run()
    page = html.render([("", result, s)])
    assert "<script" not in page
    assert 'id="latency-cdf"' not in page  # its prefill and decode kinds are empty: the engine's CDFs instead
    calls = _chart(page, "engine-cdf")
    for kind, n in (("layer_call", 8), ("step_attention", 4), ("step", 4)):
        line = re.search(r'points="([^"]+)"[^>]*stroke="{}"'.format(html.COLORS[f"cdf_{kind}"]), calls)
        assert line is not None, kind
        assert len(line.group(1).split()) == n  # one point per value
    users = _chart(page, "users-cdf")
    for color, name in (("cdf_ttft", "TTFT"), ("cdf_tpot", "TPOT"), ("cdf_sequence", "whole request")):
        assert f'data-name="{name}"' in users
        assert f'stroke="{html.COLORS[color]}"' in users
    over_time = _chart(page, "engine-attention")
    assert [len(p) for p in _points(over_time)] == [2, 2]  # each engine's two steps
    assert 'data-name="engine 0"' in over_time
    assert 'data-name="engine 1"' in over_time
    assert '<th class="k">engine steps (per s)</th><td class="k">4 (1.4)</td>' in page
    assert '<th class="k">step attention (ms)</th><td>4</td><td>7.00</td>' in page
    assert '<th class="k">TTFT (ms)</th><td>3</td><td>200</td>' in page
    assert '<td class="k">1</td><td>2</td><td>7</td><td>11.00</td><td>19.82</td>' in page  # engine 1's row
    assert "prefill piece (ms)" not in page
    # The timeline's tokens/s from the engine steps: decode's chart tops out near its 2.2 tokens/s.
    assert max(_y_ticks(_chart(page, "throughput-decode"))) == 2.5


def test_engine_attention_over_a_long_run_is_a_mean_per_bin() -> None:
    steps = [(i / 1000, 0, 1, 1, 1, 0.001 * (1 + i % 2), 0.003) for i in range(2800)]  # 1 and 2 ms, alternating
    result, s = _engine_run(engines=1, steps=steps)
    chart = _chart(html.render([("", result, s)]), "engine-attention")
    (line,) = _points(chart)
    assert len(line) == 200
    assert "mean per bin" in chart
    assert max(_y_ticks(chart)) == 1.5  # the means (1.5 ms), not the 2 ms steps
    ys = {y for _, y in line}
    assert len(ys) == 1  # every bin holds as many 1 ms as 2 ms steps


def test_many_engines_show_the_slowest() -> None:
    # 10 engines, engine i's one step taking i + 1 ms: the 8 slowest are 2..9.
    steps = [(0.1 * i, i, 1, 1, 1, 0.001 * (i + 1), 0.001 * (i + 1)) for i in range(10)]
    result, s = _engine_run(engines=10, steps=steps)
    shown = report.shown_engines(s["engine"])
    assert [x["engine"] for x in shown] == list(range(2, 10))
    assert "per engine (steps, tokens, step attention p50/p99 ms), the 8 of 10 with the highest p99: 2: 1" in (
        report.table(s)
    )
    page = html.render([("", result, s)])
    assert "The 8 of 10 engines with the highest step attention p99." in page
    assert 'data-name="engine 0"' not in _chart(page, "engine-attention")
    assert 'data-name="engine 9"' in _chart(page, "engine-attention")


def test_engine_sweep_table_and_page() -> None:
    points = [(str(n), *_engine_run(engines=n, slower=n)) for n in (1, 2, 4)]
    table = report.sweep_table("engines", [(label, s) for label, _, s in points])
    head, *rows = table.splitlines()
    assert head.split() == ["engines", "seq/s", "tok/s", "layer", "p50", "layer", "p99", "attn", "p99", "TTFT", "p99",
                            "TPOT", "p99", "preempt", "errors"]  # fmt: skip
    assert rows[0].split() == ["1", "1.07", "7", "4.50", "7.93", "19.70", "298", "29.80", "2", "0"]
    assert rows[2].split()[:6] == ["4", "1.07", "7", "18.00", "31.72", "78.80"]  # layer calls and steps 4x as long
    page = html.render(points, "engines")
    assert "Throughput against p99 engine step attention" in _chart(page, "sweep")
    assert "<td>7.93</td><td>19.70</td><td>298</td><td>29.80</td><td>2</td><td>0</td>" in page
    layer = _chart(page, "sweep-layer")
    assert 'stroke="{}"'.format(html.COLORS["sweep_layer_p50"]) in layer
    assert 'stroke="{}"'.format(html.COLORS["sweep_layer_p99"]) in layer
    assert [len(p) for p in _points(layer)] == [3, 3]
    assert re.findall(r'class="x-tick"[^>]*>([^<]+)<', layer) == ["1", "2", "3", "4"]  # the values
    assert max(_y_ticks(layer)) == 40  # p99 at 4 engines: 31.72 ms
    for chart_id in ("sweep-ttft", "sweep-tpot"):
        assert len(_points(_chart(page, chart_id))) == 1
    assert "Engine step attention CDF" in _chart(page, "sweep-cdf")
    assert len(_points(_chart(page, "sweep-cdf"))) == 3
    # A sweep of the sequences workload keeps its table.
    result, s = _run(None)
    assert report.sweep_table("concurrency", [("1", s)]).split("\n")[0].split()[3:5] == ["decode", "p50"]
    assert 'id="sweep-layer"' not in html.render([("1", result, s)], "concurrency")


def test_chart_colours_are_far_apart() -> None:
    """No two chart colours within the screenshot test's tolerance of each other (colour_pixels: 12)."""
    colours = [*html.COLORS.values(), *html._POINT_COLORS]
    rgb = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in colours]
    for i in range(len(rgb)):
        for j in range(i):
            assert sum(abs(a - b) for a, b in zip(rgb[i], rgb[j], strict=True)) > 36, (colours[i], colours[j])


def test_describe_groups() -> None:
    groups = [{"chunk_size": 16, "layers": [i]} for i in (0, 1, 2, 4)] + [{"chunk_size": 0, "layers": [3]}]
    assert report.describe_groups(groups) == "5 (chunk 16: layers 0-2, 4, 4 groups; full: layer 3)"
    assert report.describe_groups(None) == "-"
