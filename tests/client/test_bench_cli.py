"""``chunkattn bench``, ``info`` and ``health`` against real server subprocesses (short runs)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkattn_client import ChunkAttnClient
from chunkattn_client.cli import main
from chunkattn_server.config import DEFAULT_MAX_MESSAGE_MIB
from tests.helpers.server_process import SMALL, ServerProcess, counter, free_port

MAX_MESSAGE = DEFAULT_MAX_MESSAGE_MIB << 20  # a default server's

CHUNKATTN = str(Path(sys.executable).with_name("chunkattn"))  # the installed console script
LAYERS = 4


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL) as s:
        yield s


def bench(capsys: pytest.CaptureFixture[str], server: ServerProcess, tmp: Path, *flags: str) -> tuple[int, Any]:
    """Run ``chunkattn bench`` in this process; returns (exit code, the JSON it wrote)."""
    out = tmp / "run.json"
    rc = main(["bench", "--target", server.target, "--progress", "none", "--json", str(out), *flags])
    capsys.readouterr()
    return rc, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.server
@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_counts_agree_with_the_servers_metrics(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], transport: str
) -> None:
    before = server.metrics()
    rc, s = bench(
        capsys, server, tmp_path, "--transport", transport, "--sequences", "6", "--concurrency", "3",
        "--prompt-len", "10:40", "--output-len", "4:12", "--prefill-chunk", "16", "--verify", "40",
        "--metrics-url", server.metrics_url, "--dtype", "float16",
    )  # fmt: skip
    after = server.metrics()

    def d(name: str, **labels: str) -> int:
        return int(counter(after, name, **labels) - counter(before, name, **labels))

    assert rc == 0
    assert (s["sequences"], s["sequences_cut"], s["sequences_failed"], s["errors"]) == (6, 0, 0, {})
    for kind in ("prefill", "decode"):
        assert s["layer_tokens"][kind] == d("chunkattn_tokens_total", kind=kind) > 0
        assert s["server"]["layer_tokens"][kind] == d("chunkattn_tokens_total", kind=kind)
        # The server's count shown in model tokens: once per layer called, so divided by the layers.
        assert s["server"]["tokens"][kind] == d("chunkattn_tokens_total", kind=kind) / LAYERS
    # Every model token went through every layer once.
    assert sum(s["layer_tokens"].values()) == LAYERS * sum(s["tokens"].values())
    assert sum(s["server"]["tokens"].values()) == sum(s["tokens"].values())
    rpc = "Attend" if transport == "unary" else "AttendStream"
    assert s["calls"] == d("chunkattn_requests_total", rpc=rpc, code="OK")
    assert s["bytes"] == {
        "sent": d("chunkattn_received_bytes_total"),
        "received": d("chunkattn_sent_bytes_total"),
    }
    assert s["latency_ms"]["sequence"]["count"] == 6
    assert s["latency_ms"]["decode"]["count"] == s["tokens"]["decode"]
    assert s["verify"]["checked"] == 40
    assert s["verify"]["mismatches"] == 0
    assert s["server"]["kv_blocks_used_after"] == 0  # end_of_sequence freed every sequence
    with ChunkAttnClient(server.target) as c:
        assert c.info().active_sequences == 0
    lat = s["latency_ms"]["decode"]
    assert lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"]


@pytest.mark.server
def test_a_trace_drives_the_exact_lengths_it_lists(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = [(5, 3), (33, 0), (17, 20), (2, 4)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": p, "output_len": o}) + "\n" for p, o in trace))
    before = server.metrics()
    rc, s = bench(capsys, server, tmp_path, "--trace", str(path), "--prefill-chunk", "8", "--layers", "0,3")
    after = server.metrics()
    assert rc == 0
    assert s["sequences"] == 4  # a trace without --duration runs once through
    assert s["tokens"] == {"prefill": 5 + 33 + 17 + 2, "decode": 3 + 0 + 20 + 4}
    assert s["latency_ms"]["prefill"]["count"] == 1 + 5 + 3 + 1  # pieces of <= 8 tokens
    assert s["latency_ms"]["decode"]["count"] == 27
    # Pieces of one token (33 = 4 x 8 + 1, 17 = 2 x 8 + 1) are single-token entries, which the server counts as
    # decode tokens; either way every token crossed both layers.
    server_tokens = {
        k: counter(after, "chunkattn_tokens_total", kind=k) - counter(before, "chunkattn_tokens_total", kind=k)
        for k in ("prefill", "decode")
    }
    assert s["layer_tokens"] == server_tokens == {"prefill": 2 * (57 - 2), "decode": 2 * (27 + 2)}
    assert s["layers_called"] == [0, 3]


@pytest.mark.server
def test_a_timed_run_cuts_sequences_at_the_deadline_and_frees_them(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, s = bench(
        capsys, server, tmp_path, "--duration", "3", "--concurrency", "2", "--prompt-len", "8",
        "--output-len", "100000", "--transport", "stream",
    )  # fmt: skip
    assert rc == 0
    assert s["sequences"] == 0
    assert s["sequences_cut"] == 2
    # Past the deadline by at most one call per sequence. 3 s, not less: on a loaded 2-core CI machine a
    # 1.5 s run once ended before any decode step.
    assert 3 <= s["duration_s"] < 4
    assert s["tokens"]["decode"] > 0
    with ChunkAttnClient(server.target) as c:
        info = c.info()
    assert (info.active_sequences, info.free_blocks) == (0, info.num_blocks)


@pytest.mark.server
def test_sweep_open_loop_and_the_csv(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path = tmp_path / "sweep.csv"
    rc, s = bench(
        capsys, server, tmp_path, "--sweep", "concurrency=1,3", "--sequences", "3", "--prompt-len", "4",
        "--output-len", "3", "--csv", str(csv_path),
    )  # fmt: skip
    assert rc == 0
    points = s["sweep"]["points"]
    assert s["sweep"]["param"] == "concurrency"
    assert [p["value"] for p in points] == [1, 3]
    assert [p["params"]["concurrency"] for p in points] == [1, 3]
    assert all(p["sequences"] == 3 for p in points)
    assert [p["max_in_flight"] for p in points] == [1, 3]  # the closed loop really keeps N in flight
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["point"] for r in rows] == ["1", "3"]
    assert rows[0]["sequences"] == "3"

    open_loop = (
        "--rate",
        "200",
        "--max-concurrency",
        "1",
        "--sequences",
        "6",
        "--prompt-len",
        "4",
        "--output-len",
        "2",
    )
    rc, s = bench(capsys, server, tmp_path, *open_loop)
    assert rc == 0
    assert s["sequences"] == 6
    assert s["max_in_flight"] == 1
    # 200 arrivals/s against one slot: sequences queue, and their latency counts from arrival.
    assert s["open_loop"]["arrival_wait_ms"]["count"] == 6
    assert s["open_loop"]["arrival_wait_ms"]["max"] > 0
    assert s["latency_ms"]["sequence"]["max"] >= s["open_loop"]["arrival_wait_ms"]["max"]
    assert s["params"]["mode"] == "open loop, 200.0/s"
    assert s["open_loop"]["offered_per_s"] == 200


@pytest.mark.server
def test_failed_calls_are_reported_and_fail_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pool too small for the prompt: RESOURCE_EXHAUSTED on every sequence, nothing left allocated."""
    with ServerProcess(*SMALL, "--num-blocks", "8") as small:
        args = ("--sequences", "3", "--prompt-len", "64", "--output-len", "2")
        rc, s = bench(capsys, small, tmp_path, *args)
        assert rc == 1
        assert s["errors"] == {"RESOURCE_EXHAUSTED": 3}
        assert s["sequences_failed"] == 3
        assert "blocks" in s["error_examples"]["RESOURCE_EXHAUSTED"]
        rc, s = bench(capsys, small, tmp_path, *args, "--allow-errors")
        assert rc == 0
        assert s["errors"] == {"RESOURCE_EXHAUSTED": 3}
        with ChunkAttnClient(small.target) as c:
            info = c.info()
        assert (info.active_sequences, info.free_blocks) == (0, 8)


@pytest.mark.server
def test_a_server_killed_mid_run_gives_unavailable_and_a_nonzero_exit(tmp_path: Path) -> None:
    with ServerProcess(*SMALL) as doomed:
        out = tmp_path / "killed.json"
        cmd = [CHUNKATTN, "bench", "--target", doomed.target, "--duration", "120", "--concurrency", "3",
               "--prompt-len", "16", "--output-len", "64", "--progress", "plain", "--json", str(out),
               "--timeout", "20", "--max-errors", "20"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while counter(doomed.metrics(), "chunkattn_requests_total", rpc="Attend") < 30:
                assert time.monotonic() < deadline, "the bench never got going"
                assert proc.poll() is None, proc.communicate()[0]
                time.sleep(0.2)
            doomed.proc.send_signal(signal.SIGKILL)
            doomed.proc.wait()
            output, _ = proc.communicate(timeout=60)  # hangs here if the bench hangs
        finally:
            proc.kill()
        assert proc.returncode == 1, output
    s = json.loads(out.read_text())
    assert s["errors"].get("UNAVAILABLE", 0) >= 1
    assert set(s["errors"]) <= {"UNAVAILABLE", "CANCELLED"}
    assert "stopped after 20 failed calls" in s["aborted"]
    assert "errors: UNAVAILABLE" in output
    assert s["duration_s"] < 60


@pytest.mark.server
def test_verify_covers_alibi_and_kv_sharing_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Info carries each layer's ALiBi slopes and KV source, so the bench's reference can recompute any layer."""
    config = tmp_path / "model.json"
    layers = [
        {"chunk_size": 8, "alibi_slopes": [0.5, 0.25, 0.125, 0.0625]},
        {"chunk_size": 8, "kv_source": 0, "scale": 0.2},
        {"chunk_size": 0},
    ]
    config.write_text(json.dumps({"layers": layers, "heads": 4, "kv_heads": 2, "head_size": 8, "block_size": 4}))
    with ServerProcess("--config", str(config)) as s:
        with ChunkAttnClient(s.target) as c:
            info = c.info()
        assert info.layers[0].alibi_slopes == (0.5, 0.25, 0.125, 0.0625)
        assert (info.layers[1].kv_source, info.layers[2].alibi_slopes) == (0, ())
        rc, out = bench(
            capsys, s, tmp_path, "--sequences", "4", "--prompt-len", "3:20", "--output-len", "12", "--verify", "60"
        )
        assert rc == 0
        assert out["verify"]["checked"] == 60
        assert out["verify"]["mismatches"] == 0


@pytest.mark.server
def test_warmup_is_not_measured(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = server.metrics()
    rc, s = bench(
        capsys, server, tmp_path, "--warmup", "1", "--sequences", "3", "--prompt-len", "12", "--output-len", "5",
        "--metrics-url", server.metrics_url,
    )  # fmt: skip
    after = server.metrics()
    assert rc == 0
    measured = sum(s["layer_tokens"].values())
    assert measured == LAYERS * 3 * (12 + 5)
    assert sum(s["server"]["layer_tokens"].values()) == measured  # the bench's before-scrape follows the warm-up
    assert sum(s["server"]["tokens"].values()) == 3 * (12 + 5)  # in model tokens
    assert counter(after, "chunkattn_tokens_total") - counter(before, "chunkattn_tokens_total") > measured


@pytest.mark.server
def test_verify_fails_the_run_on_a_wrong_output_or_too_few_checks(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    short = ("--sequences", "1", "--prompt-len", "4", "--output-len", "1")
    rc, s = bench(capsys, server, tmp_path, *short, "--verify", "100")  # at most 8 calls to check
    assert rc == 3
    assert not s["verify"]["complete"]
    assert s["verify"]["mismatches"] == 0

    import chunkattn_client.bench.verify as verify

    monkeypatch.setattr(verify, "within_tolerance", lambda out, want, dtype: (False, 1.0))
    rc, s = bench(
        capsys, server, tmp_path, "--sequences", "4", "--prompt-len", "4", "--output-len", "1", "--verify", "2"
    )
    assert rc == 3
    assert s["verify"]["mismatches"] == 2
    assert s["verify"]["first_mismatches"][0]["error"] == 1.0


@pytest.mark.server
def test_a_stalled_server_ends_the_run_with_deadline_exceeded(tmp_path: Path) -> None:
    """SIGSTOP: calls on open streams get no answer; the bench's deadlines end the run, and it cleans up."""
    with ServerProcess(*SMALL) as stalled:
        out = tmp_path / "stalled.json"
        cmd = [CHUNKATTN, "bench", "--target", stalled.target, "--duration", "3", "--concurrency", "2",
               "--prompt-len", "16", "--output-len", "100000", "--transport", "stream", "--timeout", "2",
               "--progress", "none", "--json", str(out)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while counter(stalled.metrics(), "chunkattn_requests_total", rpc="AttendStream") < 20:
                assert time.monotonic() < deadline, "the bench never got going"
                time.sleep(0.1)
            stalled.proc.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            output, _ = proc.communicate(timeout=60)
            took = time.monotonic() - started
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
            proc.kill()
        assert proc.returncode == 1, output
        s = json.loads(out.read_text())
        assert s["errors"] == {"DEADLINE_EXCEEDED": 2}
        assert took < 15  # a 2 s call deadline, a 2 s release deadline, no 5 s graceful close
        with ChunkAttnClient(stalled.target, timeout_s=30) as c:  # resumed and still serving
            assert c.health() == "SERVING"


@pytest.mark.server
def test_ctrl_c_stops_the_run_and_still_reports(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "interrupted.json"
    cmd = [CHUNKATTN, "bench", "--target", server.target, "--duration", "120", "--concurrency", "2",
           "--prompt-len", "16", "--output-len", "100000", "--progress", "none", "--json", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, output
    s = json.loads(out.read_text())
    assert s["aborted"] == "interrupted (Ctrl-C)"
    assert s["sequences_cut"] == 2
    assert s["calls"] > 0
    assert "ABORTED: interrupted (Ctrl-C)" in output
    with ChunkAttnClient(server.target) as c:
        assert c.info().active_sequences == 0


@pytest.mark.server
def test_speculative_decoding_verifies_and_truncates_against_a_real_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Verify calls of 3 drafts + 1 across chunk boundaries (C = 16), their rejected drafts truncated, every
    checked output equal to the reference of the kept tokens."""
    with ServerProcess(*SMALL, "--spec-window", "3") as s:
        before = s.metrics()
        rc, out = bench(
            capsys, s, tmp_path, "--spec-tokens", "3", "--accept-rate", "0.5", "--verify", "80", "--sequences", "4",
            "--concurrency", "2", "--prompt-len", "10:30", "--output-len", "24", "--metrics-url", s.metrics_url,
        )  # fmt: skip
        after = s.metrics()
    assert rc == 0
    assert (out["sequences"], out["errors"], out["verify"]["mismatches"], out["verify"]["checked"]) == (4, {}, 0, 80)
    assert out["tokens"]["decode"] == 4 * 24  # kept tokens: each verify step's chosen one and accepted drafts
    spec = out["speculation"]
    steps = out["latency_ms"]["decode"]["count"]
    assert spec["drafts"] == 3 * steps
    assert 0 < spec["accepted"] < spec["drafts"]
    assert spec["accepted"] + steps == 4 * 24
    assert spec["truncations"] == steps - 4  # every verify step but a sequence's last (which releases it)
    assert spec["truncations"] == counter(after, "chunkattn_sequences_truncated_total") - counter(
        before, "chunkattn_sequences_truncated_total"
    )
    assert out["server"]["kv_blocks_used_after"] == 0


@pytest.mark.server
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-len", "8"], "--duration SECONDS or --sequences N"),
        (["--sequences", "1", "--layers", "0,9"], "layers 0..3; got [9]"),
        (["--sequences", "1", "--sweep", "colour=1,2"], "--sweep: expected PARAM=V1,V2"),
        (["--sequences", "1", "--prompt-len", "0"], "--prompt-len: expected 1 <= LOW <= HIGH"),
        (["--sequences", "1", "--prompt-len", "100000000"], f"over the message limit of {MAX_MESSAGE}"),
        (["--sequences", "1", "--metrics-url", "http://127.0.0.1:9/metrics"], "could not scrape"),
        (["--sequences", "1", "--rate", "5", "--sweep", "concurrency=1,2"], "sweep rate instead"),
        (["--sequences", "1", "--html", "/nonexistent/dir/r.html"], "cannot write /nonexistent/dir/r.html"),
        (["--sequences", "1", "--spec-tokens", "2", "--accept-rate", "1.5"], "--accept-rate in [0, 1], got 2 and 1.5"),
        (["--sequences", "1", "--spec-tokens", "3"], "keeps 0 before a chunked layer's current chunk"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    server: ServerProcess, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    rc = main(["bench", "--target", server.target, "--progress", "none", *flags])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_no_server_exits_2_and_says_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--target", f"127.0.0.1:{free_port()}", "--sequences", "1", "--timeout", "5"])
    assert rc == 2
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.server
def test_info_and_health(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--target", server.target]) == 0
    text = capsys.readouterr().out
    assert "4 layers (1 x global, 3 x C=16), 4 heads, 2 KV heads, head size 16" in text
    assert main(["info", "--target", server.target, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [x["chunk_size"] for x in info["layers"]] == [16, 16, 16, 0]
    assert main(["health", "--target", server.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main(["health", "--target", f"127.0.0.1:{free_port()}", "--timeout", "2"]) == 1
    assert "unreachable (UNAVAILABLE" in capsys.readouterr().out


@pytest.mark.server
def test_the_console_script_is_installed(server: ServerProcess) -> None:
    r = subprocess.run([CHUNKATTN, "health", "--target", server.target], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, "SERVING")


# -- the HTML report in a real browser ------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = (
    "Debian's chromium is not installed: `make test` installs it when it runs as root with apt-get"
    " (scripts/install-apt.sh); elsewhere run `apt-get install chromium`"
)


def screenshot(page: Path, png: Path, height: int) -> None:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--hide-scrollbars", f"--window-size=1100,{height}",
             f"--screenshot={png}", page.as_uri()],
            check=True, capture_output=True, timeout=120, env={**os.environ, "HOME": profile},
        )  # fmt: skip


def colour_pixels(png: Path) -> dict[str, int]:
    """How many pixels of each chart colour the screenshot holds (within a small distance, for antialiasing)."""
    from PIL import Image

    from chunkattn_client.bench.html import COLORS

    image = Image.open(png).convert("RGB")
    counts = {name: 0 for name in COLORS}
    want = {name: tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for name, c in COLORS.items()}
    pixels: list[tuple[int, Any]] = image.getcolors(maxcolors=1 << 24) or []
    for n, pixel in pixels:
        for name, rgb in want.items():
            if sum(abs(a - b) for a, b in zip(pixel, rgb, strict=True)) <= 12:
                counts[name] += n
    return counts


@pytest.mark.server
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_html_report_renders_with_its_plots_in_chromium(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page, sweep_page = tmp_path / "report.html", tmp_path / "sweep.html"
    rc, _ = bench(
        capsys, server, tmp_path, "--duration", "3", "--concurrency", "2", "--prompt-len", "8:40",
        "--output-len", "4:16", "--metrics-url", server.metrics_url, "--html", str(page),
    )  # fmt: skip
    assert rc == 0
    rc, _ = bench(
        capsys, server, tmp_path, "--sweep", "concurrency=1,2", "--sequences", "4", "--prompt-len", "8",
        "--output-len", "4", "--html", str(sweep_page),
    )  # fmt: skip
    assert rc == 0
    for html in (page.read_text(), sweep_page.read_text()):
        assert "<script" not in html
        assert "src=" not in html
        assert "<link" not in html
    screenshot(page, tmp_path / "report.png", 3000)  # the run page is ~2,620 px tall
    screenshot(sweep_page, tmp_path / "sweep.png", 2000)
    seen = colour_pixels(tmp_path / "report.png")
    # Every series of the run's three charts is drawn: a line of a few hundred pixels at least.
    for name in ("cdf_prefill", "cdf_decode", "cdf_sequence", "tput_prefill", "tput_decode", "kv_used"):
        assert seen[name] >= 150, (name, seen)
    assert seen["sweep"] == 0
    assert colour_pixels(tmp_path / "sweep.png")["sweep"] >= 150
