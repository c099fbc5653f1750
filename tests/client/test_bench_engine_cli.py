"""``chunkattn bench --workload engine`` against real server subprocesses: 1, 2 and 4 engines over the block API
and the sequence API, unary, stream and the data plane, every call checked against the float64 reference; the
server's own counts agree and it holds nothing afterwards; preemption in a small space; a timed open-loop run;
bad flags."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkattn_client import ChunkAttnClient
from chunkattn_client.cli import main
from chunkattn_client.limits import MAX_BLOCK_SPACES
from tests.client.test_bench_cli import CHROMIUM, NO_CHROMIUM, colour_pixels, screenshot
from tests.helpers.server_process import SMALL, ServerProcess, counter

pytestmark = pytest.mark.server

PLANE = ("--data-plane-tcp", "127.0.0.1:0", "--data-plane-ipc", "auto")
LAYERS = 4
# Requests whose prompts cross SMALL's chunks of 16 and the step budget, some waiting for a running slot.
WORKLOAD = ("--prompt-len", "5:50", "--output-len", "1:7", "--max-num-batched-tokens", "24", "--max-num-seqs", "3")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(*SMALL, "--num-blocks", "4096", *PLANE) as s:
        yield s


def bench(capsys: pytest.CaptureFixture[str], target: str, tmp: Path, *flags: str) -> tuple[int, Any, str]:
    """``chunkattn bench --workload engine`` in this process: (exit code, its JSON, its stdout)."""
    out = tmp / "run.json"
    rc = main(["bench", "--target", target, "--progress", "none", "--workload", "engine", "--json", str(out), *flags])
    printed = capsys.readouterr()
    return rc, json.loads(out.read_text()) if out.exists() else None, printed.out + printed.err


def holds_nothing(server: ServerProcess) -> None:
    with ChunkAttnClient(server.target, timeout_s=10) as c:
        info = c.info()
    assert (info.free_blocks, info.block_spaces, info.active_sequences) == (info.num_blocks, 0, 0)


@pytest.mark.parametrize(
    ("engines", "api", "transport", "plane", "scheduling"),
    [
        (1, "blocks", "unary", "grpc", "sync"),
        (2, "blocks", "stream", "grpc", "async"),
        (4, "blocks", "unary", "zmq", "sync"),
        (2, "sequence", "unary", "grpc", "async"),
        (4, "sequence", "stream", "zmq", "sync"),
    ],
)
def test_engines_run_verified_and_the_servers_counts_agree(
    server: ServerProcess,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    engines: int,
    api: str,
    transport: str,
    plane: str,
    scheduling: str,
) -> None:
    before = server.metrics()
    rc, s, printed = bench(
        capsys, server.target, tmp_path, "--engines", str(engines), "--api", api, "--transport", transport,
        "--data-plane", plane, "--concurrency", "4", "--sequences", str(6 * engines), "--verify", "40",
        "--metrics-url", server.metrics_url, *WORKLOAD, *(["--async-scheduling"] if scheduling == "async" else []),
    )  # fmt: skip
    after = server.metrics()

    def d(name: str, **labels: str) -> int:
        return int(counter(after, name, **labels) - counter(before, name, **labels))

    assert rc == 0, printed
    assert (s["sequences"], s["sequences_cut"], s["sequences_failed"], s["errors"]) == (6 * engines, 0, 0, {})
    assert s["verify"]["checked"] == 40, s["verify"]
    assert s["verify"]["mismatches"] == 0, s["verify"]
    assert s["params"]["engines"] == engines
    assert s["params"]["api"] == api
    assert s["params"]["async_scheduling"] == (scheduling == "async")
    assert s["params"]["data_plane"] == ("grpc" if plane == "grpc" else "zmq:ipc")
    # Every layer call the bench made, the server answered as a call of its addressing; every model token went
    # through every layer once.
    mode = "blocks" if api == "blocks" else "sequence"
    assert s["calls"] == d("chunkattn_attend_calls_total", mode=mode) > 0
    assert d("chunkattn_attend_calls_total") == s["calls"]
    assert sum(s["layer_tokens"].values()) == LAYERS * sum(s["tokens"].values())
    # the server's queue and compute time per call, streamed or not
    assert s["server"]["queue_ms_mean"] is not None
    assert s["server"]["compute_ms_mean"] > 0
    for kind in ("prefill", "decode"):  # filed as the server files them: a row of one token is a decode
        assert s["layer_tokens"][kind] == d("chunkattn_tokens_total", kind=kind), kind
    # A request of P prompt and O output tokens is P + O - 1 tokens of forward passes (no preemption here).
    assert s["engine"]["preemptions"] == 0
    assert s["engine"]["steps"] * LAYERS <= s["calls"]
    assert s["engine"]["ttft_ms"]["count"] == 6 * engines
    holds_nothing(server)


def test_a_small_space_preempts_and_stays_verified(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Short prompts that grow long (8 admitted at once, as vLLM admits a request whose prompt fits) in a space
    that holds about two at their longest: vLLM's preemption (the last admitted freed, later recomputed over blocks
    others wrote since), every call still checked."""
    rc, s, printed = bench(
        capsys, server.target, tmp_path, "--concurrency", "8", "--sequences", "16", "--prompt-len", "4:12",
        "--output-len", "30:60", "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--kv-blocks", "80",
        "--verify", "400",
    )  # fmt: skip
    assert rc == 0, printed
    assert s["engine"]["preemptions"] > 0
    assert s["verify"]["checked"] == 400
    assert s["verify"]["mismatches"] == 0
    assert s["sequences"] == 16
    holds_nothing(server)


def test_a_timed_open_loop_run_cuts_what_is_in_flight_and_frees_it(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for api in ("blocks", "sequence"):
        rc, s, printed = bench(
            capsys, server.target, tmp_path, "--engines", "2", "--api", api, "--rate", "30", "--duration", "1.5",
            "--prompt-len", "20:60", "--output-len", "20:40", "--max-num-batched-tokens", "64", "--model-step-ms",
            "4",
        )  # fmt: skip
        assert rc == 0, printed
        assert s["sequences_cut"] > 0, s
        assert s["engine"]["steps"] > 0, s
        holds_nothing(server)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens is an engine step's token budget: at least 1"),
        (["--engines", str(MAX_BLOCK_SPACES + 1)], f"--engines must be 1 to {MAX_BLOCK_SPACES}"),
        (["--engines", "4", "--kv-blocks", "1000000"], "of the server's blocks, and it has 4096 free"),
        (["--kv-blocks", "10", "--prompt-len", "100"], "--kv-blocks 10: one request of 132 tokens takes"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--output-len", "0"], "an engine's request generates at least 1 token"),
        (["--spec-tokens", "2"], "--spec-tokens and --prefill-chunk are the sequences workload's"),
        (["--model-step-ms", "-1"], "--model-step-ms must be >= 0"),
        (["--rate", "5", "--max-concurrency", "4"], "--max-concurrency is the sequences workload's"),
    ],
)
def test_bad_engine_flags_exit_2_with_a_clear_message(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    rc, _, printed = bench(capsys, server.target, tmp_path, "--sequences", "1", *flags)
    assert rc == 2
    assert message in printed


def test_engine_flags_need_the_engine_workload_and_a_trace_with_bad_lines_is_refused(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags in (["--engines", "2"], ["--model-step-ms", "5", "--max-num-seqs", "4"]):
        rc = main(["bench", "--target", server.target, "--sequences", "1", *flags])
        assert rc == 2
        err = capsys.readouterr().err
        assert "the engine workload's, add --workload engine" in err
        assert all(flag in err for flag in flags if flag.startswith("--")), err
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 10, "output_len": 2}\n{"prompt_len": "ten", "output_len": 2}\n')
    rc, _, printed = bench(capsys, server.target, tmp_path, "--trace", str(trace))
    assert rc == 2
    assert f"{trace}:2: expected prompt_len >= 1 and output_len >= 0" in printed
    trace.write_text('{"prompt_len": 10, "output_len": 0}\n')
    rc, _, printed = bench(capsys, server.target, tmp_path, "--trace", str(trace))
    assert rc == 2
    assert "an engine's request generates at least 1 token (output_len >= 1)" in printed


def test_engines_past_the_tenants_space_limit_are_refused_before_any_is_opened(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ChunkAttnClient(server.target, timeout_s=10) as c:
        space = c.open_block_space(4)
        try:
            rc, _, printed = bench(capsys, server.target, tmp_path, "--sequences", "1", "--engines", "64")
            assert rc == 2
            assert "your tenant already has 1 block space(s) open on the server" in printed
            assert c.info().block_spaces == 1  # none of the 64 was opened
        finally:
            c.close_block_space(space.space_id)
    holds_nothing(server)


def test_verify_fails_an_engine_run_whose_answers_are_off(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer the server got wrong (here: the bench's copy of it shifted, in layer 2 only) is a mismatch that
    names the engine and the layer, and the run exits 3."""
    from chunkattn_client.bench.engine import EngineBench

    send = EngineBench._send

    async def off(self: EngineBench, engine: Any, method: str, layer: int, *args: Any, **options: Any) -> Any:
        out = await send(self, engine, method, layer, *args, **options)
        return out + 0.5 if layer == 2 else out

    monkeypatch.setattr(EngineBench, "_send", off)
    rc, s, printed = bench(capsys, server.target, tmp_path, "--sequences", "4", "--verify", "40", *WORKLOAD)
    assert rc == 3, printed
    assert s["verify"]["mismatches"] == 10  # every fourth call of the first 40: layer 2's
    assert {m["layer"] for m in s["verify"]["first_mismatches"]} == {2}
    assert s["verify"]["first_mismatches"][0]["engine"] == 0


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_engine_reports_render_with_their_plots_in_chromium(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page, sweep_page = tmp_path / "engine.html", tmp_path / "engines.html"
    rc, _, printed = bench(
        capsys, server.target, tmp_path, "--engines", "2", "--duration", "3", "--concurrency", "3",
        "--prompt-len", "8:40", "--output-len", "4:16", "--max-num-batched-tokens", "32",
        "--model-step-ms", "3", "--metrics-url", server.metrics_url, "--html", str(page),
    )  # fmt: skip
    assert rc == 0, printed
    rc, _, printed = bench(
        capsys, server.target, tmp_path, "--sweep", "engines=1,2", "--sequences", "4", "--prompt-len", "8:30",
        "--output-len", "4", "--html", str(sweep_page),
    )  # fmt: skip
    assert rc == 0, printed
    screenshot(page, tmp_path / "engine.png", 3400)
    screenshot(sweep_page, tmp_path / "engines.png", 3000)
    seen = colour_pixels(tmp_path / "engine.png")
    # The run page's charts: its calls' and steps' CDF (a step is its attention and --model-step-ms: apart), its
    # users' CDF (and whole requests), the tokens over time.
    for name in (
        "cdf_layer_call",
        "cdf_step_attention",
        "cdf_step",
        "cdf_ttft",
        "cdf_tpot",
        "cdf_sequence",
        "tput_prefill",
    ):
        assert seen[name] >= 150, (name, seen)
    swept = colour_pixels(tmp_path / "engines.png")
    for name in ("sweep_layer_p50", "sweep_layer_p99", "sweep_ttft", "sweep_tpot"):
        assert swept[name] >= 100, (name, swept)


def test_a_stream_that_failed_is_replaced_and_the_engines_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server stopped (SIGSTOP) for 1.5 s under --timeout 0.5: the calls then waiting fail DEADLINE_EXCEEDED, their
    steps' requests fail, each engine opens a new stream, and once the server runs again the engines finish
    requests again (not one error per later step)."""
    with ServerProcess(*SMALL) as stopped:

        def pause() -> None:
            time.sleep(0.7)
            stopped.proc.send_signal(signal.SIGSTOP)
            time.sleep(1.5)
            stopped.proc.send_signal(signal.SIGCONT)

        pauser = threading.Thread(target=pause)
        pauser.start()
        rc, s, printed = bench(
            capsys, stopped.target, tmp_path, "--engines", "2", "--transport", "stream", "--duration", "3.5",
            "--timeout", "0.5", "--allow-errors", *WORKLOAD,
        )  # fmt: skip
        pauser.join()
    assert rc == 0, printed
    assert set(s["errors"]) == {"DEADLINE_EXCEEDED"}, s["errors"]
    # each engine's waiting call times out once per second of the pause (then its step's requests fail and the
    # next step tries on a new stream), not once per step to the end of the run
    assert s["errors"]["DEADLINE_EXCEEDED"] <= 8, s["errors"]
    assert sum(s["timeline"]["decode_tokens_per_s"][2:]) > 0, s["timeline"]  # the last second: decodes again


def test_model_step_ms_is_slept_as_asked_over_many_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--model-step-ms 12 over a 48-layer model is 0.25 ms per layer, under the event loop's sleep granularity
    (~1 ms): owed time is slept in lumps, so a step is its attention and about 12 ms, not 48 overshooting sleeps.
    (A check of the amount slept, with room for a loaded machine, not a timing of the server.)"""
    with ServerProcess(*SMALL, "--layers", "48") as deep:
        rc, s, printed = bench(
            capsys, deep.target, tmp_path, "--sequences", "2", "--concurrency", "1", "--prompt-len", "8",
            "--output-len", "10", "--model-step-ms", "12",
        )  # fmt: skip
    assert rc == 0, printed
    e = s["engine"]
    model = (e["step_ms"]["p50"] or 0) - (e["step_attention_ms"]["p50"] or 0)
    assert 10 <= model <= 35, e  # 48 sleeps of ~1.1 ms each would be ~53


@pytest.mark.slow
def test_the_tenants_opening_rate_is_waited_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs back to back whose spaces take more than a large pool's opening allowance (the pool's size per
    10 s) between them: the server refuses the second's space for the tenant's opening rate ("retry in N s",
    about 1.5 s here), and the bench waits that long and runs, rather than failing."""
    with ServerProcess(*SMALL, "--num-blocks", "70000") as big:
        flags = ("--sequences", "2", "--kv-blocks", "40000", *WORKLOAD)
        first = bench(capsys, big.target, tmp_path, *flags)
        second = bench(capsys, big.target, tmp_path, *flags)
        refused = counter(big.metrics(), "chunkattn_requests_total", rpc="OpenBlockSpace", code="RESOURCE_EXHAUSTED")
    assert first[0] == 0, first[2]
    assert second[0] == 0, second[2]
    assert refused >= 1, "the second space was meant to be refused for the opening rate first"
