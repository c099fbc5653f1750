"""A run's numbers: the JSON summary, CSV rows and the table printed on stdout."""

from __future__ import annotations

import csv
import math
import platform
from collections.abc import Sequence
from typing import Any, TextIO

from chunkattn_client import __version__
from chunkattn_client.bench.recorder import RunResult
from chunkattn_client.bench.stats import PERCENTILES, percentile, summarize

KINDS = ("prefill", "decode", "sequence")  # latency kinds: prefill piece, decode step, whole sequence
LATENCY_KEYS = (*(f"p{p}" for p in PERCENTILES), "max")
# The engine workload's latencies (its summary's "engine" key, each ``<kind>_ms``): each layer call, an engine
# step's layer calls summed, the whole step (with --model-step-ms), and what its users saw: time to first token,
# time per output token after it. Its requests' latency stays under latency_ms "sequence".
ENGINE_KINDS = ("layer_call", "step_attention", "step", "ttft", "tpot")
TABLE_NAMES = {  # the latency table's rows
    "prefill": "prefill piece",
    "decode": "decode step",
    "sequence": "sequence",
    "layer_call": "layer call",
    "step_attention": "step attention",
    "step": "engine step",
    "ttft": "TTFT",
    "tpot": "TPOT",
    "request": "request",
}


def summary(result: RunResult) -> dict[str, Any]:
    """The run as JSON-ready data (docs/bench.md, "Outputs", gives every key)."""
    rec = result.recorder
    duration = max(rec.duration_s, 1e-9)
    tokens = {kind: rec.tokens[kind] for kind in ("prefill", "decode")}

    return {
        "chunkattn_client": __version__,
        "started_utc": rec.started_utc,
        "client_host": platform.node(),
        "params": result.config.params(),
        "layers_called": list(result.layers),
        "server_model": {
            "layers": len(result.info.layers),
            "chunk_sizes": [x.chunk_size for x in result.info.layers],
            "num_heads": result.info.num_heads,
            "num_kv_heads": result.info.num_kv_heads,
            "head_size": result.info.head_size,
            "backend": result.info.backend,
            "device": result.info.device,
            "cache_dtype": result.info.cache_dtype,
            "compute_dtype": result.info.compute_dtype,
        },
        "duration_s": rec.duration_s,
        "sequences": rec.sequences,
        "sequences_cut": rec.sequences_cut,
        "sequences_failed": rec.sequences_failed,
        "calls": rec.calls,
        "max_in_flight": rec.max_in_flight,
        "errors": dict(sorted(rec.errors.items())),
        "error_examples": dict(sorted(rec.error_examples.items())),
        "release_errors": dict(sorted(rec.release_errors.items())),
        "aborted": result.aborted,
        "tokens": tokens,
        "layer_tokens": {kind: rec.layer_tokens[kind] for kind in ("prefill", "decode")},
        "tokens_per_s": {**{k: n / duration for k, n in tokens.items()}, "total": sum(tokens.values()) / duration},
        "sequences_per_s": rec.sequences / duration,
        "payload_mb_per_s": {
            "sent": rec.bytes_sent / duration / 1e6,
            "received": rec.bytes_received / duration / 1e6,
        },
        "bytes": {"sent": rec.bytes_sent, "received": rec.bytes_received},
        "latency_ms": {kind: _ms_summary(rec.latencies(kind)) for kind in KINDS},
        "open_loop": None
        if result.config.rate is None
        else {
            # the engine workload's --rate is each engine's: offered over all of them
            "offered_per_s": result.config.rate * (result.config.engines if result.config.workload == "engine" else 1),
            "achieved_per_s": rec.sequences / duration,
            "arrival_wait_ms": _ms_summary(rec.arrival_wait),
        },
        "verify": result.verify,
        "speculation": speculation(result),
        "engine": engine_summary(result),
        "server": server_summary(result.server, len(result.layers)),
        "timeline": timeline(result),
    }


def speculation(result: RunResult) -> dict[str, Any] | None:
    """Speculative decoding's counts (None without --spec-tokens): drafts sent in verify calls, drafts
    accepted (the step's kept tokens but its chosen one), their ratio, and Truncate calls made."""
    if not result.config.spec_tokens:
        return None
    rec = result.recorder
    return {
        "spec_tokens": result.config.spec_tokens,
        "accept_rate": result.config.accept_rate,
        "drafts": rec.drafts,
        "accepted": rec.accepted,
        "acceptance": rec.accepted / rec.drafts if rec.drafts else None,
        "truncations": rec.truncations,
    }


def engine_summary(result: RunResult) -> dict[str, Any] | None:
    """The engine workload's numbers (None for the sequences workload): what its engines were, their steps
    (tokens, rows of the first layer's call and decodes per step, means), each layer call's, step's and user's
    latencies (ENGINE_KINDS, in ms) and each engine's own steps, so that one slow engine shows."""
    if result.config.workload != "engine":
        return None
    rec, cfg = result.recorder, result.config
    layout = result.engine or {}
    steps = rec.engine_steps
    duration = max(rec.duration_s, 1e-9)
    seconds = {
        "layer_call": rec.layer_latency,
        "step_attention": [x[5] for x in steps],
        "step": [x[6] for x in steps],
        "ttft": rec.ttft,
        "tpot": rec.tpot,
    }
    per_engine = []
    for i in range(cfg.engines):
        mine = [x for x in steps if x[1] == i]
        attention = sorted(1000 * x[5] for x in mine)
        per_engine.append(
            {
                "engine": i,
                "steps": len(mine),
                "tokens": sum(x[2] for x in mine),
                "step_attention_ms": {f"p{p}": percentile(attention, p) if attention else None for p in (50, 99)},
            }
        )
    layer_tokens = sum(rec.layer_tokens.values())
    return {
        "engines": cfg.engines,
        "api": cfg.api,
        "kv_blocks": layout.get("kv_blocks"),
        "groups": layout.get("groups"),
        "planes": layout.get("planes"),
        "steps": len(steps),
        "steps_per_s": len(steps) / duration,
        "tokens_per_step": _mean([x[2] for x in steps]),
        "rows_per_step": _mean([x[3] for x in steps]),
        "decodes_per_step": _mean([x[4] for x in steps]),
        "tokens_per_call": layer_tokens / rec.calls if rec.calls else None,
        **{f"{kind}_ms": _ms_summary(seconds[kind]) for kind in ENGINE_KINDS},
        "preemptions": rec.preemptions,
        "per_engine": per_engine,
    }


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def server_summary(server: dict[str, Any] | None, layers: int) -> dict[str, Any] | None:
    """The server's counts with its tokens in the client's unit.

    The server's ``chunkattn_tokens_total`` counts an entry's tokens on every Attend call, so a model token
    sent to ``layers`` layers counts ``layers`` times. ``tokens`` is that count divided by ``layers`` (model
    tokens, as the client's ``tokens``; a fraction only when the server counted calls that were not whole
    steps of this run), and ``layer_tokens`` the raw count (as the client's ``layer_tokens``). The server
    files a single-token entry under decode, so a one-token prefill piece lands there.
    """
    if not server or "error" in server:
        return server
    raw = server["layer_tokens"]
    out: dict[str, Any] = {}
    for key, value in server.items():
        if key == "layer_tokens":
            out["tokens"] = {kind: _per_model_token(n, layers) for kind, n in raw.items()}
        out[key] = value
    return out


def _per_model_token(n: int, layers: int) -> int | float:
    if layers <= 0 or n % layers == 0:
        return n // max(layers, 1)
    return round(n / layers, 2)


def server_tokens_unit(layers: int) -> str:
    """How the server's model tokens were counted, for a label."""
    return f"chunkattn_tokens_total / {layers} layer{'' if layers == 1 else 's'}"


def fmt_tokens(n: float) -> str:
    """A token count: whole, or with two decimals when the server's count did not divide by the layers."""
    return f"{n:.2f}" if n != int(n) else str(int(n))


def _ms_summary(seconds: list[float]) -> dict[str, float | int | None]:
    return {k: v if k == "count" or v is None else v * 1000 for k, v in summarize(seconds).items()}


def timeline(result: RunResult) -> dict[str, list[float]]:
    """Per second of the run: tokens/s by kind (by when each step ended; an engine step's decodes are decode
    tokens, the rest of its tokens prefill), and the server's KV blocks used.

    Bucket i covers [i, i + 1) seconds; the last one runs to the end of the run (from 1 to 2 s long), so
    no bucket is a sliver whose rate means nothing.
    """
    rec = result.recorder
    duration = rec.duration_s
    buckets = max(1, math.floor(duration))
    widths = [1.0] * (buckets - 1) + [max(duration - (buckets - 1), 1e-9)]
    prefill, decode = [0.0] * buckets, [0.0] * buckets
    for t, kind, n, _ in rec.steps:
        (prefill if kind == "prefill" else decode)[min(int(t), buckets - 1)] += n
    for t, _, n, _, decodes, _, _ in rec.engine_steps:
        prefill[min(int(t), buckets - 1)] += n - decodes
        decode[min(int(t), buckets - 1)] += decodes
    return {
        "t": [float(i) for i in range(buckets)],
        "prefill_tokens_per_s": [n / w for n, w in zip(prefill, widths, strict=True)],
        "decode_tokens_per_s": [n / w for n, w in zip(decode, widths, strict=True)],
        "server_t": [t for t, _, _ in result.server_series],
        "kv_blocks_used": [u for _, u, _ in result.server_series],
        "engine_jobs_in_flight": [j for _, _, j in result.server_series],
    }


def failed(s: dict[str, Any]) -> bool:
    return bool(s["errors"]) or s["aborted"] is not None


def mismatched(s: dict[str, Any]) -> bool:
    """--verify found a wrong output, or could not check as many calls as it was asked to."""
    return s["verify"] is not None and (s["verify"]["mismatches"] > 0 or not s["verify"]["complete"])


# -- CSV ----------------------------------------------------------------------------------------------

_CSV_KIND = {"step": "engine_step"}
CSV_COLUMNS = (
    "point", "duration_s", "sequences", "sequences_cut", "calls", "errors", "tokens_prefill", "tokens_decode",
    "tokens_per_s", "sequences_per_s", "sent_mb_per_s", "received_mb_per_s",
    *(f"{kind}_{k}_ms" for kind in KINDS for k in LATENCY_KEYS),
    # The engine workload's (empty for the sequences workload): its summary's "engine" numbers.
    "engines", "engine_steps", "engine_steps_per_s", "engine_tokens_per_step", "engine_rows_per_step",
    "engine_decodes_per_step", "engine_tokens_per_call", "engine_preemptions",
    *(f"{_CSV_KIND.get(kind, kind)}_{k}_ms" for kind in ENGINE_KINDS for k in LATENCY_KEYS),
)  # fmt: skip


def write_csv(rows: Sequence[tuple[str, dict[str, Any]]], out: TextIO) -> None:
    """One row per run (per sweep point), named by ``point``."""
    w = csv.writer(out)
    w.writerow(CSV_COLUMNS)
    for point, s in rows:
        w.writerow(
            [
                point,
                f"{s['duration_s']:.3f}",
                s["sequences"],
                s["sequences_cut"],
                s["calls"],
                sum(s["errors"].values()),
                s["tokens"]["prefill"],
                s["tokens"]["decode"],
                f"{s['tokens_per_s']['total']:.1f}",
                f"{s['sequences_per_s']:.3f}",
                f"{s['payload_mb_per_s']['sent']:.2f}",
                f"{s['payload_mb_per_s']['received']:.2f}",
                *(_fmt(s["latency_ms"][kind][k]) for kind in KINDS for k in LATENCY_KEYS),
                *_engine_csv(s.get("engine")),
            ]
        )


def _engine_csv(e: dict[str, Any] | None) -> list[str]:
    if e is None:
        return [""] * (8 + len(ENGINE_KINDS) * len(LATENCY_KEYS))
    return [
        str(e["engines"]),
        str(e["steps"]),
        f"{e['steps_per_s']:.3f}",
        _fmt(e["tokens_per_step"]),
        _fmt(e["rows_per_step"]),
        _fmt(e["decodes_per_step"]),
        _fmt(e["tokens_per_call"]),
        str(e["preemptions"]),
        *(_fmt(e[f"{kind}_ms"][k]) for kind in ENGINE_KINDS for k in LATENCY_KEYS),
    ]


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


# -- the table ------------------------------------------------------------------------------------------


def table(s: dict[str, Any]) -> str:
    """The human summary of one run."""
    p = s["params"]
    unit = "sequences" if s.get("engine") is None else "requests"  # an engine's sequences: its requests
    lines = [
        f"chunkattn bench: {p['target']}, {p['mode']}, {p['transport']} over {p['data_plane']}, {p['dtype']},"
        f" prompt {p['prompt_len']}, output {p['output_len']}, layers {p['layers']}",
        f"duration {s['duration_s']:.1f} s; {unit} {s['sequences']} done, {s['sequences_cut']} cut at the"
        f" end, {s['sequences_failed']} failed; at most {s['max_in_flight']} in flight; calls {s['calls']}",
        f"throughput: {s['sequences_per_s']:.2f} seq/s; tokens/s prefill {s['tokens_per_s']['prefill']:.0f},"
        f" decode {s['tokens_per_s']['decode']:.0f}; payload MB/s sent {s['payload_mb_per_s']['sent']:.1f},"
        f" received {s['payload_mb_per_s']['received']:.1f}",
        *engine_lines(s.get("engine")),
        "",
        f"{'latency (ms)':<18}{'n':>8}" + "".join(f"{k:>10}" for k in LATENCY_KEYS),
    ]
    for kind, lat in latency_rows(s):
        lines.append(
            f"{TABLE_NAMES[kind]:<18}{lat['count']:>8}" + "".join(f"{fmt_ms(lat[k]):>10}" for k in LATENCY_KEYS)
        )
    ol = s["open_loop"]
    if ol:
        wait = ol["arrival_wait_ms"]
        slot = f"; wait for a free slot p50 {fmt_ms(wait['p50'])} ms, max {fmt_ms(wait['max'])} ms"
        lines.append(
            f"open loop: offered {ol['offered_per_s']:g} seq/s, achieved {ol['achieved_per_s']:.2f}"
            + (slot if wait["count"] else "")  # an engine queues its arrivals: no slot to wait for
        )
    lines.append("")
    if s["errors"]:
        lines.append("errors: " + ", ".join(f"{code} {n}" for code, n in s["errors"].items()))
        for code, message in s["error_examples"].items():
            lines.append(f"  {code}: {message[:160]}")
    else:
        lines.append("errors: none")
    if s["release_errors"]:
        lines.append(
            "releases of unfinished sequences that failed: "
            + ", ".join(f"{code} {n}" for code, n in s["release_errors"].items())
        )
    if s["aborted"]:
        lines.append(f"ABORTED: {s['aborted']}")
    spec = s.get("speculation")
    if spec:
        share = "" if spec["acceptance"] is None else f" ({100 * spec['acceptance']:.0f}%)"
        lines.append(
            f"speculative decoding: {spec['spec_tokens']} drafts per verify step, {spec['accepted']} of"
            f" {spec['drafts']} accepted{share}; {spec['truncations']} truncations"
        )
    v = s["verify"]
    if v is not None:
        verdict = (
            "MISMATCH" if v["mismatches"] else "ok" if v["complete"] else "INCOMPLETE (run longer or lower --verify)"
        )
        lines.append(
            f"verify: {v['checked']} of {v['requested']} calls checked against the float64 reference,"
            f" {v['mismatches']} mismatches, max error {v['max_error']:.2e}: {verdict}"
        )
    srv = s["server"]
    if srv and "error" in srv:
        lines.append(f"server metrics: {srv['error']}")
    elif srv:
        lines.append(
            f"server: queue {fmt_ms(srv['queue_ms_mean'])} ms, compute {fmt_ms(srv['compute_ms_mean'])} ms mean per"
            f" call; model tokens counted prefill {fmt_tokens(srv['tokens']['prefill'])}, decode"
            f" {fmt_tokens(srv['tokens']['decode'])} ({server_tokens_unit(len(s['layers_called']))});"
            f" KV blocks peak {srv['kv_blocks_used_peak']} of {srv['kv_blocks']} (sampled each second),"
            f" {srv['kv_blocks_used_after']} after"
        )
    return "\n".join(lines)


def latency_rows(s: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The latency table's rows (kind, ms summary): prefill pieces, decode steps and whole sequences; for the
    engine workload (whose steps batch prefills and decodes of many requests) its ENGINE_KINDS and whole
    requests ("request")."""
    lat, e = s["latency_ms"], s.get("engine")
    if e is None:
        return [(kind, lat[kind]) for kind in KINDS]
    return [*((kind, e[f"{kind}_ms"]) for kind in ENGINE_KINDS), ("request", lat["sequence"])]


PER_ENGINE_SHOWN = 8  # engines listed on stdout and in the HTML table: the slowest by step attention p99


def shown_engines(e: dict[str, Any]) -> list[dict[str, Any]]:
    """The engines a table lists: all of them, or the PER_ENGINE_SHOWN with the highest step attention p99
    (in engine order)."""
    engines: list[dict[str, Any]] = e["per_engine"]
    if len(engines) <= PER_ENGINE_SHOWN:
        return engines
    slowest = sorted(engines, key=lambda x: -(x["step_attention_ms"]["p99"] or 0.0))[:PER_ENGINE_SHOWN]
    return sorted(slowest, key=lambda x: int(x["engine"]))


def describe_groups(groups: Sequence[dict[str, Any]] | None) -> str:
    """KV cache groups, by chunk size: "4 (chunk 16: layers 0-2, 3 groups; full: layer 3)"."""
    if not groups:
        return "-"
    by_chunk: dict[int, list[list[int]]] = {}
    for g in groups:
        by_chunk.setdefault(int(g["chunk_size"]), []).append(list(g["layers"]))
    parts = []
    for chunk, of in by_chunk.items():
        layers = [layer for g in of for layer in g]
        parts.append(
            f"{f'chunk {chunk}' if chunk else 'full'}: layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}"
            + (f", {len(of)} groups" if len(of) > 1 else "")
        )
    return f"{len(groups)} ({'; '.join(parts)})"


def _ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] as "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def engine_lines(e: dict[str, Any] | None) -> list[str]:
    """The engine workload's lines of the table: its engines, their steps, and each engine's step attention."""
    if e is None:
        return []
    n = e["engines"]
    lines = [
        f"engines: {n}, {e['api']} API, {e['kv_blocks']} KV blocks each, {e['planes']} plane(s);"
        f" KV cache groups {describe_groups(e['groups'])}",
        f"engine steps: {e['steps']} ({e['steps_per_s']:.1f}/s); per step {_fmt1(e['tokens_per_step'])} tokens,"
        f" {_fmt1(e['rows_per_step'])} rows, {_fmt1(e['decodes_per_step'])} decodes (means);"
        f" {_fmt1(e['tokens_per_call'])} tokens per call; {e['preemptions']} preemptions",
    ]
    if n > 1:
        shown = shown_engines(e)
        lines.append(
            "per engine (steps, tokens, step attention p50/p99 ms)"
            + (f", the {len(shown)} of {n} with the highest p99" if len(shown) < n else "")
            + ": "
            + "; ".join(
                f"{x['engine']}: {x['steps']}, {x['tokens']}, {fmt_ms(x['step_attention_ms']['p50'])}"
                f"/{fmt_ms(x['step_attention_ms']['p99'])}"
                for x in shown
            )
        )
    return lines


def _fmt1(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def sweep_table(param: str, rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One line per sweep point."""
    if any(s.get("engine") for _, s in rows):
        return _engine_sweep_table(param, rows)
    head = f"{param:>12}{'seq/s':>9}{'tok/s':>10}{'decode p50':>12}{'decode p99':>12}{'prefill p99':>13}{'errors':>8}"
    lines = [head]
    for point, s in rows:
        lat = s["latency_ms"]
        lines.append(
            f"{point:>12}{s['sequences_per_s']:>9.2f}{s['tokens_per_s']['total']:>10.0f}"
            f"{fmt_ms(lat['decode']['p50']):>12}{fmt_ms(lat['decode']['p99']):>12}{fmt_ms(lat['prefill']['p99']):>13}"
            f"{sum(s['errors'].values()):>8}"
        )
    return "\n".join(lines)


def _engine_sweep_table(param: str, rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    head = (
        f"{param:>12}{'seq/s':>9}{'tok/s':>10}{'layer p50':>11}{'layer p99':>11}{'attn p99':>10}{'TTFT p99':>10}"
        f"{'TPOT p99':>10}{'preempt':>9}{'errors':>8}"
    )
    lines = [head]
    for point, s in rows:
        e = s["engine"] or {}
        p99 = {kind: (e.get(f"{kind}_ms") or {}).get("p99") for kind in ENGINE_KINDS}
        lines.append(
            f"{point:>12}{s['sequences_per_s']:>9.2f}{s['tokens_per_s']['total']:>10.0f}"
            f"{fmt_ms((e.get('layer_call_ms') or {}).get('p50')):>11}{fmt_ms(p99['layer_call']):>11}"
            f"{fmt_ms(p99['step_attention']):>10}{fmt_ms(p99['ttft']):>10}{fmt_ms(p99['tpot']):>10}"
            f"{e.get('preemptions', '-'):>9}{sum(s['errors'].values()):>8}"
        )
    return "\n".join(lines)


def fmt_ms(x: float | None) -> str:
    """A latency in ms for a table: two decimals below 100, none above; "-" for no value."""
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"
