"""The device throughput benchmark's report: the table rows (engine and HF side by side, each
against its bound), the graphs-against-eager rows, and the markdown printed on stdout (the
table, graphs against eager, each engine's startup, the profile)."""

from __future__ import annotations

from typing import Any


def side_figures(side: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """A side's figures by row label, in table order: prefill, decode at each batch, mixed
    (each that the side measured: the eager engine has no prefill)."""
    if "error" in side:
        return {}
    figures = {"prefill": ("prefill", side["prefill"])} if "prefill" in side else {}
    figures.update({f"decode {b}": ("decode", row) for b, row in side["decode"].items()})
    if "mixed" in side:
        figures["mixed"] = ("mixed", side["mixed"])
    return figures


def table_rows(engine: dict[str, Any], hf: dict[str, Any]) -> list[dict[str, Any]]:
    """Prefill, decode at each batch, then the mixed kind (the engine's alone: HF has no such
    step): engine and HF side by side (None for a side that failed or has no such figure)."""
    ours, theirs = side_figures(engine), side_figures(hf)
    rows = []
    for label in [*ours, *(k for k in theirs if k not in ours)]:
        phase, base = ours.get(label) or theirs[label]
        a, b = ours.get(label, (None, None))[1], theirs.get(label, (None, None))[1]
        rows.append({
            "phase": phase,
            "batch": base.get("batch", 1),
            "chunk": base.get("chunk"),
            "context": base["prompt_len"] if phase == "prefill" else round(base["mean_context"]),
            "engine_tokens_per_s": a and a["tokens_per_s"],
            "hf_tokens_per_s": b and b["tokens_per_s"],
            "bound_tokens_per_s": base["bound"]["tokens_per_s"],
            "engine_pct_of_bound": a and a["pct_of_bound"],
            "hf_pct_of_bound": b and b["pct_of_bound"],
            "engine_tpot_ms": a and a.get("tpot_ms"),
            "hf_tpot_ms": b and b.get("tpot_ms"),
            "bound_tpot_ms": base["bound"].get("tpot_ms")})
    return rows


def graphs_vs_eager_row(phase: str, fast: dict[str, Any] | None,
                        slow: dict[str, Any]) -> dict[str, Any]:
    """One kind of the eager engine (`slow`) beside the graphs engine's (`fast`, None where
    that side failed): ms per step, tokens/s, speed-up = eager ms / graphs ms."""
    g_ms, e_ms = fast and fast["tpot_ms"], slow["tpot_ms"]
    return {
        "phase": phase, "batch": slow["batch"], "chunk": slow.get("chunk"),
        "tokens_per_step": slow.get("tokens_per_step", slow["batch"]),
        "graphs_step_ms": g_ms, "eager_step_ms": e_ms,
        "graphs_tokens_per_s": fast and fast["tokens_per_s"],
        "eager_tokens_per_s": slow["tokens_per_s"],
        "speedup": e_ms / g_ms if g_ms and e_ms else None}


def graphs_vs_eager_rows(engine: dict[str, Any], eager: dict[str, Any]) -> list[dict[str, Any]]:
    """The eager engine's kinds (decode at --eager-batches, mixed) beside the same kinds of the
    graphs engine (`graphs_vs_eager_row`)."""
    graphs = side_figures(engine)
    return [graphs_vs_eager_row(phase, graphs.get(label, (None, None))[1], slow)
            for label, (phase, slow) in side_figures(eager).items()]


def _cell(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _batch_cell(row: dict[str, Any]) -> str:
    return str(row["batch"]) if row["chunk"] is None else f"{row['batch']} + {row['chunk']}"


def markdown(result: dict[str, Any]) -> str:
    limits, sizes = result["limits"], result["sizes"]
    with_hf = not result["hf"].get("skipped")
    title = (f"### bench/gpu_throughput: {result['shape']} on {result['device']['name']} "
             f"({result['device']['type']}), {result['dtype']}")
    lines = [title, ""]
    if result["smoke"]:
        lines += ["**SMOKE RUN** (tiny shapes): the figures are not measurements.", ""]
    hf_note = (f"transformers {result['hf'].get('transformers', '?')} (HF: a second process, "
               f"sdpa attention, its own KV cache, greedy)" if with_hf
               else "HF transformers not measured (--no-hf)")
    lines += [
        f"torch {result['torch']}, {hf_note}. Limits measured in this "
        f"run: copy bandwidth {limits['copy_bandwidth_gbs']:,.0f} GB/s (bytes read + written), "
        f"{limits['matmul_dtype']} matmul {limits['matmul_tflops']:,.3g} TFLOP/s "
        f"({limits['matmul_size']}^3). Prefill: {sizes['prefill_len']}-token prompts, one per "
        f"step; bound = the prompt's FLOPs at the matmul rate. Decode: {sizes['context']}-token "
        f"random prompts, no prefix caching, median over at least {sizes['decode_steps']} "
        f"full-batch steps; "
        f"bound = weights + K/V bytes per step at the copy bandwidth; TPOT = ms per output "
        f"token of one sequence; context = mean keys per decode step. Mixed (batch "
        f"D + C): D decodes and one C-token chunk of a {sizes['prefill_len']}-token prompt per "
        f"step; tok/s counts both, TPOT is the step, bound as decode's with the chunk's FLOPs "
        f"and K/V reads added.", ""]
    if with_hf:
        lines += [
            "| phase | batch | context | engine tok/s | HF tok/s | engine / HF | bound tok/s "
            "| engine % of bound | HF % of bound | engine TPOT ms | HF TPOT ms | bound TPOT ms |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    else:
        # No HF columns to leave empty: the engine against the bound alone.
        lines += ["| phase | batch | context | engine tok/s | bound tok/s | engine % of bound "
                  "| engine TPOT ms | bound TPOT ms |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for row in result["rows"]:
        ours, theirs = row["engine_tokens_per_s"], row["hf_tokens_per_s"]
        if not with_hf:
            lines.append(
                f"| {row['phase']} | {_batch_cell(row)} | {row['context']} | {_cell(ours)} "
                f"| {_cell(row['bound_tokens_per_s'])} | {_cell(row['engine_pct_of_bound'])} "
                f"| {_cell(row['engine_tpot_ms'], 2)} | {_cell(row['bound_tpot_ms'], 2)} |")
            continue
        ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
        lines.append(
            f"| {row['phase']} | {_batch_cell(row)} | {row['context']} | {_cell(ours)} "
            f"| {_cell(theirs)} | {ratio} | {_cell(row['bound_tokens_per_s'])} "
            f"| {_cell(row['engine_pct_of_bound'])} | {_cell(row['hf_pct_of_bound'])} "
            f"| {_cell(row['engine_tpot_ms'], 2)} | {_cell(row['hf_tpot_ms'], 2)} "
            f"| {_cell(row['bound_tpot_ms'], 2)} |")
    for side in ("engine", "hf"):
        if "error" in result[side] and not result[side].get("skipped"):
            lines += ["", f"**{side} not measured:** {result[side]['error']}"]
    lines += graphs_markdown(result)
    lines += startup_markdown(result.get("startup") or {})
    if result.get("profile"):
        from engine.benchmarks.device_throughput.engine_profile import markdown as profile_markdown

        lines += profile_markdown(result["profile"])
    return "\n".join(lines)


def _report_cell(key: str, value: Any) -> str:
    """One field of a runner's startup report: bytes also in GiB, seconds to 3 digits."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int) and key.endswith("bytes"):
        return f"{value:,} ({value / 2**30:.2f} GiB)"
    if isinstance(value, float):
        return f"{value:,.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def startup_markdown(startup: dict[str, dict[str, Any]]) -> list[str]:
    """Each engine's start (lines): wall seconds of `LLM(...)`, this bench's warm-up after it,
    and the runner's own startup report, field by field, as far as it has one."""
    if not startup:
        return []
    lines = ["", "#### Engine startup", "",
             "build s: `LLM(...)` wall time (weights, the engine's kernel warm-up, CUDA graph "
             "capture); bench warm-up s: this bench's first requests after it (a first-use "
             "compile the engine's warm-up missed shows here); the rest: the runner's startup "
             "report (workers/startup/serving_startup.py).", "",
             "| engine | build s | bench warm-up s | runner's startup report |",
             "|---|--:|--:|---|"]
    names = {"engine": "graphs (as configured)", "eager": "--enforce-eager"}
    for name, figures in startup.items():
        report = figures.get("report")
        if report is None:
            described = "none (the runner reports none, or is in another process)"
        else:
            described = ", ".join(f"{key} {_report_cell(key, value)}"
                                  for key, value in report.items()
                                  if not isinstance(value, (dict, list))) or "empty"
        label = names.get(name, name)
        if figures.get("async_scheduling"):
            label += ", async scheduling"
        lines.append(f"| {label} | {_cell(figures.get('build_s'), 2)} "
                     f"| {_cell(figures.get('bench_warmup_s'), 2)} | {described} |")
    return lines


def _graphs_used(side: dict[str, Any]) -> str:
    if "graphs" not in side:  # a run cut short (the GPU suite summary's partial figures)
        return "not probed (the run ended before)"
    probe = side["graphs"] or {}
    sizes, replays = probe.get("decode_graph_sizes"), probe.get("decode_graph_replays")
    if sizes is None:
        return "not known (the runner is in another process)"
    if not sizes:
        return "no decode graphs captured"
    used = (f"decode graphs for {len(sizes)} batch sizes ({sizes[0]}..{sizes[-1]}), "
            f"{replays} replays")
    pieces = probe.get("piecewise_step_sizes") or []
    if pieces:
        used += (f"; pieces for {len(pieces)} step sizes ({pieces[0]}..{pieces[-1]} tokens), "
                 f"{probe.get('piecewise_replays')} replayed steps")
    return used


def graphs_markdown(result: dict[str, Any]) -> list[str]:
    """The graphs-against-eager table (lines), after the throughput table."""
    if "eager" not in result:
        return []
    engine, eager = result["engine"], result["eager"]
    lines = ["", "#### CUDA graphs against --enforce-eager", ""]
    if "error" in eager:
        return lines + [f"**eager engine not measured:** {eager['error']}"]
    lines += [
        "The same step kinds, same sizes and prompts, on a second engine with "
        "enforce_eager=True (this process, before the graphs engine; "
        + ("memory it left allocated: "
           f"{eager['memory_left_gb']:.2f} GB" if eager.get("memory_left_gb") is not None
           else "CPU: no device memory to free" if result["device"]["type"] == "cpu"
           else "memory it left allocated: not measured")
        + "). ms/step: median step, start to next start (decode: TPOT); speed-up = eager ms "
        "/ graphs ms. Graphs engine: " + ("-" if "error" in engine else _graphs_used(engine))
        + "; eager engine: " + _graphs_used(eager) + "."
        + (" On the CPU there are no CUDA graphs: both columns ran the same eager code, and the "
           "speed-up is noise around 1." if result["device"]["type"] == "cpu" else ""), "",
        "| step | batch | tokens/step | graphs ms/step | eager ms/step | graphs tok/s "
        "| eager tok/s | speed-up |",
        "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for row in result["graphs_vs_eager"]:
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(
            f"| {row['phase']} | {_batch_cell(row)} | {row['tokens_per_step']} "
            f"| {_cell(row['graphs_step_ms'], 2)} | {_cell(row['eager_step_ms'], 2)} "
            f"| {_cell(row['graphs_tokens_per_s'])} | {_cell(row['eager_tokens_per_s'])} "
            f"| {speedup} |")
    return lines
