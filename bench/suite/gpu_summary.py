"""The GPU suite's summary: OUT_DIR/summary.md and OUT_DIR/suite.json (every step's figures in
one document) from what the suite (bench/suite/gpu_suite.sh) left in OUT_DIR.

Each section quotes a step's own figures (its JSON, or its log's `key: value` lines and
tables); a step that failed or ran out of time says so, with its log's last lines.

Partial results: a benchmark writes its final JSON at exit, and each figure to the JSON's
.jsonl twin as it is measured (engine/benchmarks/measure/figures.py). A step killed at its limit has no
JSON, but
its .jsonl holds what it measured: the section reports that, marked "(partial: step timed
out)" (or killed, failed), instead of nothing.

OUT_DIR/steps.tsv, one row a step: `name  rc  seconds  limit`, rc an exit status or a word the
suite writes: `running` (written before the step starts; still there, the suite itself was
killed: "killed (did not finish)"), `killed` (the call was interrupted mid-step), `skipped` (the
call's deadline left too little time). 124 or 137 is a step killed at its limit (TIMED OUT).
Every step in it gets a row in the steps table, those without a section of their own too.
OUT_DIR/notes.txt (the suite's notes, e.g. a failed graph capture that made every later step
run --enforce-eager) goes at the top, under the title.

    python -m bench.suite.gpu_summary OUT_DIR [--device cuda] [--smoke] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.benchmarks.measure.figures import jsonl_twin, read_figures
from engine.benchmarks.measure.stats import percentile

# "N/M tests collected (K deselected)" when a marker picks some (-m gpu).
_PYTEST_TOTALS = re.compile(r"^=*\s*(\d+(/\d+)? (passed|failed|error|errors|skipped|"
                            r"tests? collected|deselected).*?)\s*=*$")
TIMEOUT_RCS = (124, 137)
# Steps whose figures are in a burst-* folder (bench run's OUTPUT_DIR).
BURST_PREFIX = "burst-"

Step = dict[str, Any]


def _int_or_word(text: str) -> int | str:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text


def _steps(out: Path) -> dict[str, Step]:
    """steps.tsv's rows by step name: rc an int, or the suite's word for it (`running`,
    `killed`, `skipped`); a row cut short or missing fields is kept with what it has."""
    path = out / "steps.tsv"
    steps: dict[str, Step] = {}
    if not path.exists():
        return steps
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if not fields[0].strip():
            continue
        name, rest = fields[0].strip(), [_int_or_word(f) for f in fields[1:4]]
        rest += [None] * (3 - len(rest))
        steps[name] = {"rc": rest[0], "seconds": rest[1], "limit": rest[2]}
    return steps


def _outcome(step: Step | None) -> str:
    if step is None:
        return "not run"
    rc = step["rc"]
    if rc == "running":
        # Its row was written before it started, and never replaced: the suite was killed.
        return "killed (did not finish)"
    if rc == "killed":
        return "killed (the call was interrupted)"
    if rc == "skipped":
        return "skipped (the call's deadline left too little time)"
    if rc in TIMEOUT_RCS:
        return f"TIMED OUT at {step['limit']} s"
    if rc == 0:
        return "passed"
    return f"FAILED (exit {rc})"


def _ended_badly(step: Step | None) -> bool:
    return step is not None and step["rc"] not in (0, "skipped")


def _partial_note(step: Step | None) -> str:
    """What a section built from a .jsonl says: why the step's JSON is missing."""
    if step is None:
        why = "no final JSON"
    elif step["rc"] in TIMEOUT_RCS:
        why = "step timed out"
    elif step["rc"] in ("running", "killed"):
        why = "step killed"
    elif step["rc"] == 0:
        why = "no final JSON"
    else:
        why = "step failed"
    return f"(partial: {why})"


def _log(out: Path, name: str) -> str:
    path = out / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _tail(text: str, lines: int = 15) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _fenced(text: str) -> list[str]:
    return ["```text", text.rstrip() or "(empty)", "```"]


def _json(path: Path) -> Any:
    """The JSON at `path`; None when there is none, or only part of one (a step killed while
    writing it)."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(errors="replace"))
    except ValueError:
        return None


def _records(path: Path) -> list[dict[str, Any]]:
    """The .jsonl twin of a step's JSON `path` (engine/benchmarks/measure/figures.py): what it measured so
    far."""
    return read_figures(jsonl_twin(path))


def _tests(out: Path, steps: dict[str, Step], smoke: bool) -> list[str]:
    lines = ["## GPU tests", ""]
    if smoke:
        lines += ["Smoke: the GPU tests are collected, not run (CI runs them on the CPU).", ""]
    for name, label in (("tests-cuda", "-m gpu tests/gpu"),
                        ("tests-triton-compiled", "-m gpu tests/kernels, kernels compiled")):
        log = _log(out, name)
        lines.append(f"- {label}: {_outcome(steps.get(name))}; pytest: "
                     f"`{_pytest_totals(out, name) or 'no totals line'}`")
        failures = [line for line in log.splitlines() if line.startswith(("FAILED", "ERROR"))]
        if not failures:  # killed before pytest's short summary: -v's own lines say
            failures = [f"{m.group(1)} {m.group(2)}" for line in log.splitlines()
                        if (m := re.match(r"^(\S+::\S+) (FAILED|ERROR)\b", line))]
        lines += [f"  - `{line}`" for line in failures[:20]]
        running = _test_running_when_killed(log)
        if _ended_badly(steps.get(name)) and running:
            lines.append(f"  - running when it ended: `{running}`")
    return lines + [""]


def _test_running_when_killed(log: str) -> str | None:
    """The test pytest -v had started and not finished: its id is the log's last test line
    with no outcome after it."""
    for line in reversed(log.splitlines()):
        match = re.match(r"^(\S+::\S+)", line)
        if match:
            finished = re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", line)
            return None if finished else match.group(1)
    return None


def _equality(out: Path) -> list[str]:
    report = _json(out / "equality.json")
    lines = ["## Greedy equality against HF transformers (float32)", ""]
    if report is None:
        return lines + ["No report (see equality.log):", "", *_fenced(_tail(_log(out, "equality"))),
                        ""]
    model = report["model"]
    lines += [f"Random checkpoints: hidden {model['hidden_size']}, "
              f"{model['num_hidden_layers']} layers, {model['num_attention_heads']} heads / "
              f"{model['num_key_value_heads']} KV heads, vocabulary {model['vocab_size']}; "
              f"device {report['device']} {report.get('gpu', '')}".rstrip(), "",
              "| arch | scenario | outputs equal | probe | result |", "|---|---|---:|---|---|"]
    for arch, scenarios in report["archs"].items():
        for name, s in scenarios.items():
            probe = ", ".join(f"{k} {v}" for k, v in s["probe"].items())
            lines.append(f"| {arch} | {name} | {s['equal']}/{s['prompts']} | {probe} | "
                         f"{'passed' if s['passed'] else 'FAILED'} |")
            for m in s["mismatches"]:
                lines.append(f"|  | mismatch | prompt {m['prompt_len']} tokens, first at "
                             f"output {m['first_diff']} | reference top-2 margin "
                             f"{m['reference_top2_margin']:.4g} | |")
    return lines + [""]


def _graphs_headline(report: dict[str, Any]) -> list[str]:
    """What the CUDA graphs buy, in one line above the throughput section's tables."""
    rows = report.get("graphs_vs_eager") or []
    if not rows:
        return []
    cells = []
    for row in rows:
        kind = (f"{row['phase']} {row['batch']}" if row.get("chunk") is None
                else f"{row['phase']} {row['batch']} + {row['chunk']}")
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        cells.append(f"{kind} {speedup}")
    return [f"CUDA graphs against --enforce-eager (speed-up = eager ms per step / graphs ms): "
            f"{', '.join(cells)}.", ""]


def _throughput(out: Path, name: str = "throughput",
                steps: dict[str, Step] | None = None) -> list[str]:
    """The device throughput benchmark's markdown (engine/benchmarks/device_throughput: its
    table, graphs against eager, each engine's startup, and with --profile the engine profile
    after them) as its JSON carries it, below a line with the graphs' speed-ups; without the
    JSON, the same built from its .jsonl's figures (marked partial); else what it printed last
    in its log. `name`: the step (throughput,
    throughput-hf), whose files are NAME.json, NAME.jsonl and NAME.log."""
    step = (steps or {}).get(name)
    path = out / f"{name}.json"
    report = _json(path)
    # The core call's step runs without HF (graphs against eager); the full call's beside HF,
    # with the engine's profile.
    title = {"throughput": "## Throughput against the hardware bound, CUDA graphs against eager",
             "throughput-hf": "## Throughput against HF transformers, and the engine's profile"
             }.get(name, f"## Throughput ({name})")
    lines = [title, ""]
    if report is not None and isinstance(report, dict) and report.get("markdown"):
        return lines + _graphs_headline(report) + [report["markdown"].rstrip(), ""]
    partial = _throughput_from_records(_records(path))
    if partial is not None:
        return lines + [f"**{_partial_note(step)}**: the figures {name} measured before it "
                        f"ended, from {name}.jsonl.", ""] + _graphs_headline(partial) + [
            partial["markdown"].rstrip(), ""]
    log = _log(out, name)
    heading = "### bench/gpu_throughput:"
    if heading in log:  # stdout, printed after everything on stderr
        return lines + [log[log.rindex(heading):].rstrip(), ""]
    table = [line for line in log.splitlines() if line.startswith("|")]
    return lines + (table if table else [f"No table (see {name}.log):", "",
                                         *_fenced(_tail(log))]) + [""]


def _throughput_from_records(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A gpu_throughput result rebuilt from its .jsonl records (its `markdown` included), or
    None when it had not measured its limits yet (no figure has a bound without them)."""
    from engine.benchmarks.device_throughput import report

    run = next((r for r in records if r["kind"] == "run"), None)
    limits = next((r for r in records if r["kind"] == "limits"), None)
    if run is None or limits is None:
        return None
    ended = "not measured: the step ended first"
    sides: dict[str, dict[str, Any]] = {}
    for record in records:
        side = record.get("side")
        if side is None:
            continue
        figures = sides.setdefault(side, {"decode": {}})
        fields = {k: v for k, v in record.items() if k not in ("kind", "side")}
        kind = record["kind"]
        if kind == "decode":
            figures["decode"][str(fields["batch"])] = fields
        elif kind == "error":
            figures["error"] = fields["error"]
        elif kind in ("prefill", "mixed", "graphs", "startup"):
            figures[kind] = fields
    engine = sides.get("engine", {"error": ended})
    eager = sides.get("eager", {"error": "skipped (--no-eager)", "skipped": True}
                      if run.get("no_eager") else {"error": ended})
    hf = sides.get("hf", {"error": "skipped (--no-hf)", "skipped": True}
                   if run.get("no_hf") else {"error": ended})
    result = {
        "smoke": run.get("smoke", False), "shape": run.get("shape", "?"),
        "device": run.get("device") or {"type": "?", "name": "?"},
        "dtype": run.get("dtype", "?"), "torch": run.get("torch", "?"), "sizes": run["sizes"],
        "limits": {k: v for k, v in limits.items() if k != "kind"},
        "engine": engine, "eager": eager, "hf": hf,
        "startup": {name: side["startup"] for name, side in (("engine", engine),
                                                             ("eager", eager))
                    if "startup" in side},
        "rows": report.table_rows(engine, hf),
        # Every kind the eager engine measured, "-" where the graphs engine had not yet.
        "graphs_vs_eager": ([] if "error" in eager
                            else report.graphs_vs_eager_rows(engine, eager))}
    result["markdown"] = report.markdown(result)
    return result


def _kernels(out: Path) -> list[str]:
    log = _log(out, "kernels")
    # The whole report (79 lines on the H100): its first table holds the decode rows at batch 1.
    return ["## Kernels (bench.kernels.gpu_kernels)", "", *_fenced(_tail(log, 120)), ""]


# The structured step's figures, in the order the table shows them.
_STRUCTURED_FIGURES = ("batch", "plain_tpot_ms", "constrained_tpot_ms", "tpot_overhead",
                       "bitmask_fill_ms_per_step", "bitmask_fill_share_of_tpot",
                       "first_compile_ms", "cached_compile_ms")


def _structured(out: Path, steps: dict[str, Step] | None = None) -> list[str]:
    """sloserve bench structured's JSON as a table (its target: tpot_overhead <= 0.10)."""
    lines = ["## Structured outputs (sloserve bench structured)", ""]
    report = _json(out / "structured.json")
    if report is None:
        step = (steps or {}).get("structured")
        # A failed step's log tail follows the sections.
        return lines + [f"**{_partial_note(step)}**: no figures.", ""]
    lines += ["| figure | value |", "|---|---:|"]
    lines += [f"| {name} | {report.get(name, '-')} |" for name in _STRUCTURED_FIGURES]
    return lines + ["", f"Target: {report.get('target', '-')}.", ""]


def _preempt_latency(out: Path, steps: dict[str, Step] | None = None) -> list[str]:
    """A row per prompt size from bench/e2e/preempt_latency.py's JSON ({"sizes": [...]}), or from
    its .jsonl's `size` records (and the trials of a size it did not finish) when the step
    ended without its JSON; from an older single-size JSON, or none, its log's `key: value`
    lines (each size's block starts with its `layers: ..., prompt_tokens: N` line)."""
    lines = ["## Preemption latency (bench/e2e/preempt_latency.py)", ""]
    path = out / "preempt_latency.json"
    report = _json(path)
    if isinstance(report, dict) and report.get("sizes"):
        return lines + _preempt_latency_table(report) + [""]
    partial = _preempt_latency_from_records(_records(path))
    if partial is not None:
        step = (steps or {}).get("preempt-latency")
        lines += [f"**{_partial_note(step)}**: what preempt-latency measured before it ended, "
                  f"from preempt_latency.jsonl.", ""]
        if partial["sizes"]:
            lines += _preempt_latency_table(partial)
        unfinished = partial["unfinished_trials"]
        if unfinished:
            size = unfinished[0]["prompt_tokens"]
            unwound = [t["arrival_to_unwind_ms"] for t in unfinished if t.get("unwound")]
            step_ms = ", ".join(f"{t['long_step_ms']:.1f}" for t in unfinished)
            unwind_ms = ", ".join(f"{ms:.2f}" for ms in unwound) or "-"
            lines += ["", f"Prompt size {size}, not finished: {len(unfinished)} trials, "
                      f"{len(unwound)} unwound; long step ms {step_ms}; arrival to unwind ms "
                      f"{unwind_ms}."]
        return lines + [""]
    log = _log(out, "preempt-latency")
    keyed = [line for line in log.splitlines() if re.match(r"^[a-z_0-9]+: ", line)
             or line.startswith("target:")]
    return lines + [*_fenced("\n".join(keyed) if keyed else _tail(log)), ""]


def _preempt_latency_from_records(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The JSON's form from the .jsonl (its finished sizes), the trials of a size not
    finished beside it; None before the urgent request alone was measured (every row's SLO
    and the table's header need it)."""
    run = next((r for r in records if r["kind"] == "run"), None)
    alone = next((r for r in records if r["kind"] == "urgent_alone"), None)
    if run is None or alone is None:
        return None
    sizes = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "size"]
    finished = {size["prompt_tokens"] for size in sizes}
    unfinished = [r for r in records if r["kind"] == "trial"
                  and r["prompt_tokens"] not in finished]
    return {"model": run.get("model"), "device": run.get("device"), "layers": run.get("layers"),
            "threads": run.get("threads"),
            "urgent_ttft_alone_ms": alone["urgent_ttft_alone_ms"], "sizes": sizes,
            "unfinished_trials": unfinished, "partial": True}


def _preempt_latency_table(report: dict[str, Any]) -> list[str]:
    lines = [f"{report['layers']} layers, device {report['device']}; the urgent request alone: "
             f"{report['urgent_ttft_alone_ms']:.1f} ms. Target: p99 arrival to unwind < one "
             f"layer + 5 ms. Steps of up to 512 prefill tokens replay as pieces with CUDA "
             f"graphs, the vote between pieces; larger ones run eager. First token: arrival to "
             f"the urgent request's first token after the unwind (the device's queued layers "
             f"and its own step included), what its client sees.", "",
             "| prompt tokens | long step ran as | unwinds between pieces | long step median "
             "(ms) | layer (ms) | urgent SLO (ms) | unwound / trials | arrival to unwind p50 "
             "(ms) | p99 (ms) | p99 (layers) | target | first token p50 (ms) | p99 (ms) | "
             "within SLO |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for size in report["sizes"]:
        ms, layer_ms = size["arrival_to_unwind_ms"], size["layer_ms"]
        unwinds = size.get("unwinds_between_pieces")
        ran_as = size.get("long_step_ran_as", "-")
        if ran_as == "mixed":
            ran_as += f" ({size['long_steps_as_pieces']}/{size['long_steps']} as pieces)"
        step_ms = statistics.median(size["long_step_ms"]) if size["long_step_ms"] else None
        if ms:
            p50, p99 = percentile(ms, 50), percentile(ms, 99)
            tail = (f"{p50:.2f} | {p99:.2f} | {p99 / layer_ms:.2f} | "
                    f"{'met' if p99 < layer_ms + 5 else 'NOT met'} |")
        else:
            tail = "- | - | - | nothing unwound |"
        # Absent from reports made before the bench timed it.
        first = [t for t in size.get("arrival_to_first_token_ms", []) if t == t]
        if first:
            tail += (f" {percentile(first, 50):.2f} | {percentile(first, 99):.2f} | "
                     f"{size['first_token_within_slo']}/{len(ms)} |")
        else:
            tail += " - | - | - |"
        lines.append(f"| {size['prompt_tokens']} | {ran_as} | "
                     f"{'-' if unwinds is None else unwinds} | {_ms(step_ms)} | "
                     f"{layer_ms:.2f} | {size['urgent_slo_ms']:.1f} | "
                     f"{size['unwound']}/{size['trials']} | {tail}")
    return lines


def _stream_gaps(out: Path, steps: dict[str, Step] | None = None) -> list[str]:
    path = out / "stream_gaps.json"
    report = _json(path)
    lines = ["## First requests after startup (bench.e2e.stream_gaps)", ""]
    if report is None:
        report = _stream_gaps_from_records(_records(path))
        if report is not None:
            lines += [f"**{_partial_note((steps or {}).get('stream-gaps'))}**: the contexts "
                      f"measured before stream-gaps ended, from stream_gaps.jsonl.", ""]
    if report is None:
        return lines + ["No report (see stream-gaps.log):", "",
                        *_fenced(_tail(_log(out, "stream-gaps"))), ""]
    startup_line = (f"Startup log: `{report['startup_log'][-1].strip()}`"
                    if report["startup_log"] else "")
    lines += [f"Server start to healthy: {report['startup_s']} s. " + startup_line, "",
              "| context | first TTFT (ms) | first max gap (ms) | warm max gap (ms) | "
              "decode step (ms) | gap / step |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        step = f"{r['decode_step_ms']:.1f}" if r["decode_step_ms"] is not None else "-"
        lines.append(f"| {r['context']} | {r['first']['ttft_ms']:.1f} | "
                     f"{r['first_max_gap_ms']:.1f} | {r.get('warm_max_gap_ms', 0.0):.1f} | "
                     f"{step} | {r['max_gap_over_step']} |")
    multiple = report.get("stall_multiple")
    over = "the stall multiple" if multiple is None else f"{multiple:g}x"
    lines.append(f"\nFirst requests with a gap over {over} the decode "
                 f"step: {report['stalled']}/{len(report['rows'])} (the warm request's largest "
                 f"gap beside it is the host's noise floor).")
    return lines + [""]


def _stream_gaps_from_records(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The JSON's form from the .jsonl: the rows measured so far (None before the server was
    up)."""
    startup = next((r for r in records if r["kind"] == "startup"), None)
    if startup is None:
        return None
    run = next((r for r in records if r["kind"] == "run"), {})
    rows = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "row"]
    return {"startup_s": startup["startup_s"], "startup_log": startup.get("startup_log") or [],
            "stall_multiple": run.get("stall_multiple"), "rows": rows,
            "stalled": sum(bool(r.get("stalled")) for r in rows), "partial": True}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _burst_folders(out: Path, steps: dict[str, Step]) -> list[str]:
    """The burst steps' folder names (burst-inprocess, burst-http-2048, ...): those steps.tsv
    names and those on disk, in the suite's order."""
    names = [name for name in steps if name.startswith(BURST_PREFIX)]
    names += sorted(p.name for p in out.glob(f"{BURST_PREFIX}*")
                    if p.is_dir() and p.name not in names)
    return names


def _burst_doc(out: Path, folder: str) -> tuple[dict[str, Any] | None, bool]:
    """(bench run's results: its results.json, else the runs its results.jsonl holds; whether
    the latter)."""
    doc = _json(out / folder / "results.json")
    if doc is not None:
        return doc, False
    runs = [{k: v for k, v in r.items() if k != "kind"}
            for r in read_figures(out / folder / "results.jsonl") if r["kind"] == "run"]
    return ({"runs": runs, "aggregate": None}, True) if runs else (None, False)


def _burst(out: Path, steps: dict[str, Step] | None = None) -> list[str]:
    steps = steps or {}
    lines = ["## SLO burst (long documents, short urgent turns)", "",
             "TTFT is the client's (first streamed byte over HTTP); the server's own TTFT "
             "(`metrics.ttft_ms`) beside it on HTTP runs.", "",
             "| runner | policy | urgent TTFT SLO met | urgent SLO (ms) | urgent median TTFT "
             "client (ms) | server (ms) | max abs client-server (ms) | p99 stream gap (ms) | "
             "max stream gap (ms) | SLO preemptions |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    folders = _burst_folders(out, steps) or ["burst-inprocess", "burst-http"]
    missing = []
    for folder in folders:
        runner = folder.removeprefix(BURST_PREFIX)
        doc, partial = _burst_doc(out, folder)
        if doc is None:
            lines.append(f"| {runner} | no results (see {folder}.log) | | | | | | | | |")
            missing.append(folder)
            continue
        label = f"{runner} {_partial_note(steps.get(folder))}" if partial else runner
        for run in doc["runs"]:
            s = run["summary"]
            urgent = s["tiers"].get("urgent", {})
            met = (f"{urgent['num_slo_met']}/{urgent['num_slo_requests']}"
                   if urgent else "-")
            lines.append(
                f"| {label} | {run['policy']} | {met} | {_ms(urgent.get('median_ttft_slo_ms'))}"
                f" | {_ms(urgent.get('median_ttft_ms'))} | "
                f"{_ms(urgent.get('median_server_ttft_ms'))} | "
                f"{_ms(s.get('max_abs_ttft_client_minus_server_ms'))} | "
                f"{_ms(s.get('p99_max_stream_gap_ms'))} | {_ms(s.get('max_stream_gap_ms'))} | "
                f"{s.get('num_preemptions_slo')} |")
    for folder in missing:
        log = _log(out, folder)
        if log:
            lines += ["", f"{folder}.log, last lines:", "", *_fenced(_tail(log))]
    return lines + [""]


def _smoke(out: Path, steps: dict[str, Step]) -> list[str]:
    """bench/suite/gpu_smoke.py: did the engine start and serve, with CUDA graphs (smoke.json, or
    the phases its smoke.jsonl holds)."""
    if "smoke" not in steps and not (out / "smoke.json").exists():
        return []
    lines = ["## Smoke: the shape cut to 2 layers, CUDA graphs (bench/suite/gpu_smoke.py)", ""]
    report = _json(out / "smoke.json")
    if not isinstance(report, dict):
        records = _records(out / "smoke.json")
        # Each phase is written when its engine started and again when it ended: the last.
        phases: dict[Any, dict[str, Any]] = {}
        for r in records:
            if r.get("kind") in ("engine_started", "engine"):
                phases[r.get("enforce_eager")] = r
        verdict = next((r["verdict"] for r in records if r.get("kind") == "verdict"), None)
        if not phases:
            return lines + ["No report (see smoke.log):", "", *_fenced(_tail(_log(out, "smoke"))),
                            ""]
        report = {"verdict": verdict or "not reached", "phases": list(phases.values())}
        lines += [f"**{_partial_note(steps.get('smoke'))}**: from smoke.jsonl.", ""]
    lines += [f"Verdict: **{report.get('verdict')}**.", "",
              "| engine | start (s) | serve (s) | replays | startup report | error |",
              "|---|--:|--:|---|---|---|"]
    for phase in report.get("phases") or []:
        startup = phase.get("startup")
        described = ("-" if not startup else ", ".join(
            f"{k} {v}" for k, v in startup.items() if not isinstance(v, (dict, list))))
        lines.append(f"| {'--enforce-eager' if phase.get('enforce_eager') else 'graphs'} | "
                     f"{_ms(phase.get('start_s'))} | {_ms(phase.get('serve_s'))} | "
                     f"{phase.get('replays', '-')} | {described} | "
                     f"{phase.get('error') or '-'} |")
    return lines + [""]


def _calibration(out: Path, steps: dict[str, Step]) -> list[str]:
    """The TTFT line the calibrate step wrote (ttft_model.json), which the burst steps use."""
    if "calibrate" not in steps:
        return []
    line = _json(out / "ttft_model.json")
    lines = ["## TTFT line (calibrate)", ""]
    if not isinstance(line, dict):
        return lines + ["No ttft_model.json (see calibrate.log):", "",
                        *_fenced(_tail(_log(out, "calibrate"))), ""]
    fields = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in line.items() if not isinstance(v, (dict, list)))
    return lines + [f"ttft_model.json: {fields}.", ""]


def _pytest_totals(out: Path, name: str) -> str | None:
    totals = [m.group(1) for line in _log(out, name).splitlines()
              if (m := _PYTEST_TOTALS.match(line.strip()))]
    return totals[-1] if totals else None


def _figures_or_partial(path: Path) -> Any:
    """A step's JSON for suite.json, or what its .jsonl holds ({"partial": true, "records":
    [...]}), or None."""
    report = _json(path)
    if report is not None:
        return report
    records = _records(path)
    return {"partial": True, "records": records} if records else None


def collect(out: Path) -> dict[str, Any]:
    """Every step's figures in one document (OUT_DIR/suite.json)."""
    steps = _steps(out)
    burst = {}
    for folder in _burst_folders(out, steps):
        doc, partial = _burst_doc(out, folder)
        if doc is not None:
            burst[folder.removeprefix(BURST_PREFIX)] = {
                "runs": [{k: run.get(k) for k in ("runner", "policy", "budget", "workload",
                                                  "summary", "engine")}
                         for run in doc["runs"]],
                "aggregate": doc.get("aggregate"), "partial": partial}
    return {"steps": steps,
            "notes": _notes(out),
            "tests": {name: _pytest_totals(out, name)
                      for name in ("tests-cuda", "tests-triton-compiled")},
            "smoke": _figures_or_partial(out / "smoke.json"),
            "calibration": _json(out / "ttft_model.json"),
            "equality": _json(out / "equality.json"),
            "structured": _json(out / "structured.json"),
            "throughput": _figures_or_partial(out / "throughput.json"),
            "throughput_hf": _figures_or_partial(out / "throughput-hf.json"),
            "kernels": _json(out / "kernels.json"),
            "preempt_latency": _figures_or_partial(out / "preempt_latency.json"),
            "stream_gaps": _figures_or_partial(out / "stream_gaps.json"),
            "burst": burst}


def _notes(out: Path) -> list[str]:
    path = out / "notes.txt"
    if not path.exists():
        return []
    return [line.rstrip() for line in path.read_text(errors="replace").splitlines()
            if line.strip()]


def _guarded_section(name: str, build: Callable[[], list[str]]) -> list[str]:
    """A section, or a line saying it could not be built: the summary is written from the
    suite's EXIT trap, after whatever happened, and one odd file must not cost the rest."""
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - reported in the summary itself
        traceback.print_exc()
        return [f"## {name}", "", f"Could not summarize: {type(exc).__name__}: {exc}", ""]


# The step a section belongs to: a section is written when its step is in steps.tsv (or, with
# no steps.tsv rows at all, always: an older folder).
_SECTION_STEPS = {"tests": ("tests-cuda", "tests-triton-compiled"), "equality": ("equality",),
                  "structured": ("structured",),
                  "throughput": ("throughput",), "throughput-hf": ("throughput-hf",),
                  "kernels": ("kernels",), "preempt-latency": ("preempt-latency",),
                  "stream-gaps": ("stream-gaps",)}


def summarize(out: Path, device: str, smoke: bool, dry_run: bool = False) -> str:
    import torch

    steps = _steps(out)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    if dry_run:
        kind = " (dry run: each step stopped once its engine configuration was built)"
    elif smoke:
        kind = " (smoke: tiny shapes on a CPU, figures are not measurements)"
    else:
        kind = ""
    lines = [f"# GPU suite{kind}", ""]
    notes = _notes(out)
    if notes:
        lines += [f"- {note}" for note in notes] + [""]
    lines += [f"{when}; device {device} {gpu}; torch {torch.__version__}, "
              f"triton {triton_version}. `bash bench/suite/gpu_suite.sh` wrote this.", "",
              "| step | result | seconds |", "|---|---|---:|"]
    lines += [f"| {name} | {_outcome(step)} | {_ms_or(step['seconds'])} |"
              for name, step in steps.items()]
    lines.append("")
    if dry_run:
        # Nothing was measured: each step's last line says how far it got.
        for name in steps:
            last = _tail(_log(out, name), 1)
            lines.append(f"- {name}: `{last or 'no output'}`")
        return "\n".join(lines + [""])

    def wanted(section: str) -> bool:
        return not steps or any(name in steps for name in _SECTION_STEPS[section])

    sections: list[tuple[str, Callable[[], list[str]]]] = [
        ("Smoke", lambda: _smoke(out, steps)),
        ("GPU tests", lambda: _tests(out, steps, smoke) if wanted("tests") else []),
        ("Equality", lambda: _equality(out) if wanted("equality") else []),
        ("Structured outputs", lambda: _structured(out, steps) if wanted("structured") else []),
        ("Throughput", lambda: _throughput(out, "throughput", steps)
         if wanted("throughput") else []),
        ("Throughput (throughput-hf)", lambda: _throughput(out, "throughput-hf", steps)
         if "throughput-hf" in steps else []),
        ("TTFT line", lambda: _calibration(out, steps)),
        ("Kernels", lambda: _kernels(out) if wanted("kernels") else []),
        ("Preemption latency", lambda: _preempt_latency(out, steps)
         if wanted("preempt-latency") else []),
        ("First requests after startup", lambda: _stream_gaps(out, steps)
         if wanted("stream-gaps") else []),
        ("SLO burst", lambda: _burst(out, steps)
         if not steps or _burst_folders(out, steps) else [])]
    for name, build in sections:
        lines += _guarded_section(name, build)
    for name, step in steps.items():
        if _ended_badly(step):
            lines += [f"### {name}: {_outcome(step)}; last lines of its log", "",
                      *_fenced(_tail(_log(out, name))), ""]
    return "\n".join(lines)


def _ms_or(value: Any) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="the suite's --dry-run: nothing measured, each step's last line")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    text = summarize(out, args.device, args.smoke, args.dry_run)
    (out / "summary.md").write_text(text + "\n")
    try:
        suite = collect(out)
    except Exception as exc:  # noqa: BLE001 - the summary above is written; say what failed
        traceback.print_exc()
        suite = {"steps": _steps(out), "error": f"{type(exc).__name__}: {exc}"}
    (out / "suite.json").write_text(json.dumps(suite, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
