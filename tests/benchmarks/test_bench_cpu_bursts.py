"""The `cpu-bursts` workload (engine/benchmarks/attainment/cpu_bursts.py), how `sloserve bench
run --busy N` keeps a trace's quiet and busy runs apart in its results and tables
(attainment/busy.py), and the options it refuses before anything starts."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.benchmarks.attainment.busy import neighbour_limit_s, side_by_side
from engine.benchmarks.attainment.cpu_bursts import (BURST_SIZE, DOCUMENT_OUTPUT_TOKENS,
                                                     DOCUMENT_PROMPT, URGENT_OUTPUT_TOKENS,
                                                     URGENT_PROMPT, URGENT_SHARE)
from engine.benchmarks.attainment.report import markdown_table
from engine.benchmarks.attainment.results import RequestResult, RunResult, aggregate
from engine.benchmarks.attainment.workloads import WORKLOADS, build_workload


def _trace(tokenizer_folder: str, num_requests: int = 120, seed: int = 0,
           max_prompt_len: int | None = None, predict=lambda n: 0.001 * n):
    from transformers import AutoTokenizer

    return build_workload("cpu-bursts", num_requests, 0.5, seed,
                          AutoTokenizer.from_pretrained(tokenizer_folder), predict,
                          max_prompt_len=max_prompt_len)


def test_cpu_bursts_has_short_urgent_turns_in_bursts_among_long_documents(sim_model) -> None:
    assert "cpu-bursts" in WORKLOADS
    trace = _trace(sim_model)
    tiers = Counter(r.tier for r in trace.requests)
    assert tiers == {"urgent": round(120 * URGENT_SHARE), "document": 120 - tiers["urgent"]}
    assert trace.meta["workload"] == "cpu-bursts" and trace.duration_s <= 120 / 0.5
    for r in trace.requests:
        n = len(r.prompt_token_ids)
        if r.tier == "urgent":
            assert URGENT_PROMPT.lo <= n <= URGENT_PROMPT.hi
            assert r.output_tokens == URGENT_OUTPUT_TOKENS == 16
            # 250 ms at 32 tokens to 700 ms at 160, linear in between.
            assert r.ttft_slo_ms == pytest.approx(250 + (n - 32) / 128 * 450, abs=0.1)
        else:
            assert DOCUMENT_PROMPT.lo <= n <= DOCUMENT_PROMPT.hi
            assert r.output_tokens == DOCUMENT_OUTPUT_TOKENS == 8 and r.ttft_slo_ms == 30_000
    # Bursts: most urgent turns arrive within 0.2 s of another one.
    urgent = [r.arrival_s for r in trace.requests if r.tier == "urgent"]
    close = sum(1 for a, b in zip(urgent, urgent[1:]) if b - a < 0.2)
    assert close >= len(urgent) * (1 - 2 / (BURST_SIZE[0] + 1))


def test_cpu_bursts_objectives_are_absolute_and_follow_a_clipped_prompt(sim_model) -> None:
    slow = _trace(sim_model, predict=lambda n: 0.01 * n)
    fast = _trace(sim_model)
    # The calibrated line does not move an objective: the trace means the same on any machine.
    assert [(r.request_id, r.ttft_slo_ms) for r in slow.requests] == \
        [(r.request_id, r.ttft_slo_ms) for r in fast.requests]
    clipped = _trace(sim_model, max_prompt_len=100)
    assert max(len(r.prompt_token_ids) for r in clipped.requests) == 100
    for r in clipped.requests:
        if r.tier == "urgent":
            n = len(r.prompt_token_ids)
            assert r.ttft_slo_ms == pytest.approx(250 + (n - 32) / 128 * 450, abs=0.1)
    assert [r.request_id for r in _trace(sim_model).requests] == \
        [r.request_id for r in fast.requests]  # seeded


def _run(policy: str, busy: int, met: bool, cpu_s: float = 0.0) -> RunResult:
    ttft = 0.2 if met else 0.9
    return RunResult(runner="http", policy=policy, budget=2048, workload="cpu-bursts",
                     rate=0.5, seed=0, duration_s=10.0, busy=busy, requests=[
                         RequestResult("00000-urgent", "urgent", 0.0, 64, 16, 300.0,
                                       ttft_s=ttft, e2e_s=1.0, tpot_s=0.05),
                         RequestResult("00001-document", "document", 1.0, 3000, 8, 30_000.0,
                                       ttft_s=4.0, e2e_s=5.0, tpot_s=0.1)],
                     meta={"busy_load": {"processes": busy, "cpu_s": cpu_s,
                                         "cpu_share": cpu_s / 20.0 if busy else None,
                                         "machine_cpu_percent": 60.0 if busy else 20.0,
                                         "load_avg_1m_end": 2.5, "wall_s": 10.0}})


def test_quiet_and_busy_runs_of_one_trace_are_cells_of_their_own_side_by_side() -> None:
    runs = [_run("fcfs", 0, True), _run("fcfs", 2, False, 17.3),
            _run("slo", 0, True), _run("slo", 2, True, 18.0)]
    cells = aggregate(runs)
    assert [(c["policy"], c["busy"]) for c in cells] == [("fcfs", 0), ("slo", 0), ("fcfs", 2),
                                                         ("slo", 2)]
    # Each busy cell is paired with the baseline beside the same neighbours.
    slo_busy = cells[3]
    assert slo_busy["diff"]["tiers"]["urgent"]["ttft_slo_attainment"]["median"] == 1.0
    table = markdown_table(cells)
    assert table.startswith("| busy | policy |") and "| 2 | slo | 2048 |" in table
    sides = side_by_side(runs)
    assert "| fcfs @ 2048, quiet | fcfs @ 2048, busy 2 | slo @ 2048, quiet |" in sides
    assert "| urgent TTFT attainment (met/total) | 1/1 (100%) | 0/1 (0%) | 1/1 (100%) | " \
        "1/1 (100%) |" in sides
    assert "| document TTFT p50 / p99 (ms) | 4000 / 4000 |" in sides
    assert "| busy processes' CPU s (share of their wall time) | – | 17.3 (86%) | – | " \
        "18.0 (90%) |" in sides
    assert side_by_side([_run("fcfs", 0, True)]) == ""  # without --busy: no such table
    assert "the bound on the server's own step model" not in sides  # no server reported one


def test_a_busy_run_shows_the_bound_on_its_servers_own_step_model() -> None:
    """The busy column carries the clairvoyant bound costed by the busy server's step model
    (meta `clairvoyant_server_line`); the quiet column has none."""
    quiet, busy = _run("slo", 0, True), _run("slo", 2, False, 18.0)
    busy.meta["clairvoyant_server_line"] = {"tiers": {"urgent": 0.0, "document": 1.0}}
    sides = side_by_side([quiet, busy])
    assert "| urgent: the bound on the server's own step model (met/total) | – | 0/1 (0%) |" \
        in sides
    assert "| document: the bound on the server's own step model (met/total) | – | " \
        "1/1 (100%) |" in sides


def test_the_neighbours_bound_covers_the_servers_start_and_a_slow_replay(sim_model) -> None:
    trace = _trace(sim_model, num_requests=24)
    one = neighbour_limit_s(trace, lambda n: 0.001 * n)
    assert one > 300 + trace.duration_s
    assert neighbour_limit_s(trace, lambda n: 0.001 * n, replays=2) > one


@pytest.mark.parametrize("argv, message", [
    (["--busy", "1", "--runner", "http", "--url", "http://127.0.0.1:9"], "not --url"),
    (["--busy", "1", "--runner", "http", "--peer", "vllm=http://127.0.0.1:9"], "--peer"),
    (["--busy", "-1"], ">= 0"),
    (["--server-defaults"], "add --runner http"),
    (["--server-defaults", "--runner", "http", "--url", "http://127.0.0.1:9"],
     "add --runner http"),
    (["--server-defaults", "--runner", "http", "--budgets", "512"], "leave out --budgets"),
])
def test_busy_and_server_defaults_refuse_what_they_cannot_do(argv, message, tmp_path,
                                                             capsys) -> None:
    from engine.entrypoints.cli import main

    out = tmp_path / "out"
    assert main(["bench", "run", "--output-dir", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (out / "results.jsonl").exists()
