"""The GPU suite's summary: OUT_DIR/summary.md and OUT_DIR/suite.json (every step's figures in
one document) from what `bench/gpu_suite.sh` left in OUT_DIR.

Each section quotes a step's own figures (its JSON, or its log's `key: value` lines and
tables); a step that failed or ran out of time says so, with its log's last lines.

    python -m bench.gpu_summary OUT_DIR [--device cuda] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

_PYTEST_TOTALS = re.compile(r"^=*\s*(\d+ (passed|failed|error|errors|skipped|tests? collected"
                            r"|deselected).*?)\s*=*$")


def _steps(out: Path) -> dict[str, dict[str, int]]:
    steps = {}
    for line in (out / "steps.tsv").read_text().splitlines():
        name, rc, seconds, limit = line.split("\t")
        steps[name] = {"rc": int(rc), "seconds": int(seconds), "limit": int(limit)}
    return steps


def _outcome(step: dict[str, int] | None) -> str:
    if step is None:
        return "not run"
    if step["rc"] in (124, 137):
        return f"TIMED OUT at {step['limit']} s"
    return "passed" if step["rc"] == 0 else f"FAILED (exit {step['rc']})"


def _log(out: Path, name: str) -> str:
    path = out / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _tail(text: str, lines: int = 15) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _fenced(text: str) -> list[str]:
    return ["```text", text.rstrip(), "```"]


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _tests(out: Path, steps: dict[str, dict[str, int]], smoke: bool) -> list[str]:
    lines = ["## GPU tests", ""]
    if smoke:
        lines += ["Smoke: the GPU tests are collected, not run (CI runs them on the CPU).", ""]
    for name, label in (("tests-cuda", "tests/test_cuda.py, tests/test_gpu_memory_utilization.py"),
                        ("tests-triton-compiled",
                         "tests/test_triton_*.py, tests/test_kernel_warmup.py, kernels compiled")):
        log = _log(out, name)
        lines.append(f"- {label}: {_outcome(steps.get(name))}; pytest: "
                     f"`{_pytest_totals(out, name) or 'no totals line'}`")
        failures = [line for line in log.splitlines() if line.startswith(("FAILED", "ERROR"))]
        lines += [f"  - `{line}`" for line in failures[:20]]
    return lines + [""]


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


def _throughput(out: Path) -> list[str]:
    """bench.gpu_throughput's markdown (its table, graphs against eager, and with --profile
    the engine profile after them) as its JSON carries it, below a line with the graphs'
    speed-ups; else what it printed last in its log."""
    report = _json(out / "throughput.json")
    lines = ["## Throughput against the hardware bound and HF transformers", ""]
    if report is not None and isinstance(report, dict) and report.get("markdown"):
        return lines + _graphs_headline(report) + [report["markdown"].rstrip(), ""]
    log = _log(out, "throughput")
    heading = "### bench/gpu_throughput:"
    if heading in log:  # stdout, printed after everything on stderr
        return lines + [log[log.rindex(heading):].rstrip(), ""]
    table = [line for line in log.splitlines() if line.startswith("|")]
    return lines + (table if table else ["No table (see throughput.log):", "",
                                         *_fenced(_tail(log))]) + [""]


def _kernels(out: Path) -> list[str]:
    log = _log(out, "kernels")
    return ["## Kernels (bench.gpu_kernels)", "", *_fenced(_tail(log, 60)), ""]


def _preempt_latency(out: Path) -> list[str]:
    """A row per prompt size from bench/preempt_latency.py's JSON ({"sizes": [...]}); from an
    older single-size JSON, or none, its log's `key: value` lines (each size's block starts with
    its `layers: ..., prompt_tokens: N` line)."""
    lines = ["## Preemption latency (bench/preempt_latency.py)", ""]
    report = _json(out / "preempt_latency.json")
    if isinstance(report, dict) and report.get("sizes"):
        return lines + _preempt_latency_table(report) + [""]
    log = _log(out, "preempt-latency")
    keyed = [line for line in log.splitlines() if re.match(r"^[a-z_0-9]+: ", line)
             or line.startswith("target:")]
    return lines + [*_fenced("\n".join(keyed) if keyed else _tail(log)), ""]


def _nearest_rank(values: list[float], q: float) -> float:
    """bench/preempt_latency.py's percentile (nearest rank), so the table quotes its figures."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _preempt_latency_table(report: dict[str, Any]) -> list[str]:
    lines = [f"{report['layers']} layers, device {report['device']}; the urgent request alone: "
             f"{report['urgent_ttft_alone_ms']:.1f} ms. Target: p99 arrival to unwind < one "
             f"layer + 5 ms. Steps of up to 512 prefill tokens replay as pieces with CUDA "
             f"graphs, the vote between pieces; larger ones run eager.", "",
             "| prompt tokens | long step ran as | unwinds between pieces | long step median "
             "(ms) | layer (ms) | urgent SLO (ms) | unwound / trials | arrival to unwind p50 "
             "(ms) | p99 (ms) | p99 (layers) | target |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for size in report["sizes"]:
        ms, layer_ms = size["arrival_to_unwind_ms"], size["layer_ms"]
        unwinds = size.get("unwinds_between_pieces")
        ran_as = size.get("long_step_ran_as", "-")
        if ran_as == "mixed":
            ran_as += f" ({size['long_steps_as_pieces']}/{size['long_steps']} as pieces)"
        step_ms = statistics.median(size["long_step_ms"]) if size["long_step_ms"] else None
        if ms:
            p50, p99 = _nearest_rank(ms, 50), _nearest_rank(ms, 99)
            tail = (f"{p50:.2f} | {p99:.2f} | {p99 / layer_ms:.2f} | "
                    f"{'met' if p99 < layer_ms + 5 else 'NOT met'} |")
        else:
            tail = "- | - | - | nothing unwound |"
        lines.append(f"| {size['prompt_tokens']} | {ran_as} | "
                     f"{'-' if unwinds is None else unwinds} | {_ms(step_ms)} | "
                     f"{layer_ms:.2f} | {size['urgent_slo_ms']:.1f} | "
                     f"{size['unwound']}/{size['trials']} | {tail}")
    return lines


def _stream_gaps(out: Path) -> list[str]:
    report = _json(out / "stream_gaps.json")
    lines = ["## First requests after startup (bench.stream_gaps)", ""]
    if report is None:
        return lines + ["No report (see stream-gaps.log):", "",
                        *_fenced(_tail(_log(out, "stream-gaps"))), ""]
    lines += [f"Server start to healthy: {report['startup_s']} s. "
              + (f"Startup log: `{report['startup_log'][-1].strip()}`"
                 if report["startup_log"] else ""), "",
              "| context | first TTFT (ms) | first max gap (ms) | warm max gap (ms) | "
              "decode step (ms) | gap / step |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        step = f"{r['decode_step_ms']:.1f}" if r["decode_step_ms"] is not None else "-"
        lines.append(f"| {r['context']} | {r['first']['ttft_ms']:.1f} | "
                     f"{r['first_max_gap_ms']:.1f} | {r.get('warm_max_gap_ms', 0.0):.1f} | "
                     f"{step} | {r['max_gap_over_step']} |")
    lines.append(f"\nFirst requests with a gap over {report['stall_multiple']:g}x the decode "
                 f"step: {report['stalled']}/{len(report['rows'])} (the warm request's largest "
                 f"gap beside it is the host's noise floor).")
    return lines + [""]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _burst(out: Path) -> list[str]:
    lines = ["## SLO burst (long documents, short urgent turns)", "",
             "TTFT is the client's (first streamed byte over HTTP); the server's own TTFT "
             "(`metrics.ttft_ms`) beside it on HTTP runs.", "",
             "| runner | policy | urgent TTFT SLO met | urgent SLO (ms) | urgent median TTFT "
             "client (ms) | server (ms) | max abs client-server (ms) | p99 stream gap (ms) | "
             "max stream gap (ms) | SLO preemptions |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    found = False
    for runner in ("inprocess", "http"):
        doc = _json(out / f"burst-{runner}" / "results.json")
        if doc is None:
            lines.append(f"| {runner} | no results (see burst-{runner}.log) | | | | | | | | |")
            continue
        found = True
        for run in doc["runs"]:
            s = run["summary"]
            urgent = s["tiers"].get("urgent", {})
            met = (f"{urgent['num_slo_met']}/{urgent['num_slo_requests']}"
                   if urgent else "-")
            lines.append(
                f"| {runner} | {run['policy']} | {met} | {_ms(urgent.get('median_ttft_slo_ms'))}"
                f" | {_ms(urgent.get('median_ttft_ms'))} | "
                f"{_ms(urgent.get('median_server_ttft_ms'))} | "
                f"{_ms(s.get('max_abs_ttft_client_minus_server_ms'))} | "
                f"{_ms(s.get('p99_max_stream_gap_ms'))} | {_ms(s.get('max_stream_gap_ms'))} | "
                f"{s.get('num_preemptions_slo')} |")
    if not found:
        lines += ["", *_fenced(_tail(_log(out, "burst-http")))]
    return lines + [""]


def _pytest_totals(out: Path, name: str) -> str | None:
    totals = [m.group(1) for line in _log(out, name).splitlines()
              if (m := _PYTEST_TOTALS.match(line.strip()))]
    return totals[-1] if totals else None


def collect(out: Path) -> dict[str, Any]:
    """Every step's figures in one document (OUT_DIR/suite.json)."""
    burst = {}
    for runner in ("inprocess", "http"):
        doc = _json(out / f"burst-{runner}" / "results.json")
        if doc is not None:
            burst[runner] = {"runs": [{k: run[k] for k in ("runner", "policy", "budget",
                                                           "workload", "summary", "engine")}
                                      for run in doc["runs"]],
                             "aggregate": doc.get("aggregate")}
    return {"steps": _steps(out),
            "tests": {name: _pytest_totals(out, name)
                      for name in ("tests-cuda", "tests-triton-compiled")},
            "equality": _json(out / "equality.json"),
            "throughput": _json(out / "throughput.json"),
            "kernels": _json(out / "kernels.json"),
            "preempt_latency": _json(out / "preempt_latency.json"),
            "stream_gaps": _json(out / "stream_gaps.json"),
            "burst": burst}


def summarize(out: Path, device: str, smoke: bool) -> str:
    import torch

    steps = _steps(out)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    lines = [f"# GPU suite{' (smoke: tiny shapes on a CPU, figures are not measurements)' if smoke else ''}",
             "", f"{when}; device {device} {gpu}; torch {torch.__version__}, "
             f"triton {triton_version}. `bash bench/gpu_suite.sh` wrote this.", "",
             "| step | result | seconds |", "|---|---|---:|"]
    lines += [f"| {name} | {_outcome(step)} | {step['seconds']} |" for name, step in steps.items()]
    lines.append("")
    for section in (_tests(out, steps, smoke), _equality(out), _throughput(out), _kernels(out),
                    _preempt_latency(out), _stream_gaps(out), _burst(out)):
        lines += section
    failed = [name for name, step in steps.items() if step["rc"] != 0]
    for name in failed:
        lines += [f"### {name}: last lines of its log", "", *_fenced(_tail(_log(out, name))), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    text = summarize(out, args.device, args.smoke)
    (out / "summary.md").write_text(text + "\n")
    (out / "suite.json").write_text(json.dumps(collect(out), indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
