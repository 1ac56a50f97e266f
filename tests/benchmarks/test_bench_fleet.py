"""`sloserve bench run --replicas N --router ...`: one trace against a fleet of simulated GPUs
per router (Ray Serve), the routers side by side; and the `fleet-bursts` trace family."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from engine.benchmarks.attainment.results import RequestResult, RunResult
from engine.benchmarks.fleet.bursts import (BURST_SIZE, DOCUMENT_PROMPT, URGENT_OUTPUT_TOKENS,
                                            URGENT_PROMPT, URGENT_SHARE, build_fleet_bursts)
from engine.benchmarks.fleet.fleet_run import (fleet_table, late_past_a_decode_step, rejections,
                                              routing_misses)
from engine.benchmarks.measure.figures import read_figures

# Alone (the README's serial run): `bench run --replicas` starts a Ray instance of its own.
pytestmark = pytest.mark.serial


def test_fleet_bursts_has_bursts_of_urgent_turns_among_documents(sim_model) -> None:
    from transformers import AutoTokenizer

    trace = build_fleet_bursts(200, 8.0, 0, AutoTokenizer.from_pretrained(sim_model),
                               lambda n: 0.01)
    tiers = Counter(r.tier for r in trace.requests)
    assert tiers == {"urgent": round(200 * URGENT_SHARE), "document": 200 - tiers["urgent"]}
    assert trace.duration_s <= 200 / 8.0
    for r in trace.requests:
        n = len(r.prompt_token_ids)
        if r.tier == "urgent":
            assert URGENT_PROMPT.lo <= n <= URGENT_PROMPT.hi and 150 <= r.ttft_slo_ms <= 300
        else:
            assert DOCUMENT_PROMPT.lo <= n <= DOCUMENT_PROMPT.hi
            assert 10_000 <= r.ttft_slo_ms <= 30_000
    # Bursts: most urgent turns arrive within 0.1 s of another one.
    urgent = [r.arrival_s for r in trace.requests if r.tier == "urgent"]
    close = sum(1 for a, b in zip(urgent, urgent[1:]) if b - a < 0.1)
    assert close >= len(urgent) * (1 - 2 / (BURST_SIZE[0] + 1))
    assert [r.request_id for r in build_fleet_bursts(
        200, 8.0, 0, AutoTokenizer.from_pretrained(sim_model), lambda n: 0.01).requests] == \
        [r.request_id for r in trace.requests]


def test_fleet_chat_turns_resend_their_conversation_and_add_a_short_message(sim_model,
                                                                          tmp_path) -> None:
    from transformers import AutoTokenizer

    from engine.benchmarks.attainment.traces import Trace
    from engine.benchmarks.fleet.chat import (OPENING_PROMPT, THINK_S, TURNS_PER_CONVERSATION,
                                              build_fleet_chat)

    trace = build_fleet_chat(200, 8.0, 0, AutoTokenizer.from_pretrained(sim_model),
                             lambda n: 0.01)
    tiers = Counter(r.tier for r in trace.requests)
    assert len(trace.requests) == 200 and tiers["document"] == 50
    assert tiers["urgent"] == 150 - tiers["opening"] <= TURNS_PER_CONVERSATION * tiers["opening"]
    by_session: dict[str, list] = {}
    for r in trace.requests:
        assert (r.session is None) == (r.tier == "document")
        if r.session is not None:
            by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        opening, *follow_ups = turns
        assert opening.tier == "opening" and all(t.tier == "urgent" for t in follow_ups)
        assert OPENING_PROMPT.lo <= len(opening.prompt_token_ids) <= OPENING_PROMPT.hi
        for before, turn in zip(turns, follow_ups):
            # The whole conversation so far, an answer and a new message of 64-512 tokens
            # whose objective follows the new message, not the history.
            assert turn.prompt_token_ids[:len(before.prompt_token_ids)] == before.prompt_token_ids
            new = len(turn.prompt_token_ids) - len(before.prompt_token_ids) - URGENT_OUTPUT_TOKENS
            assert URGENT_PROMPT.lo <= new <= URGENT_PROMPT.hi
            assert 150 <= turn.ttft_slo_ms <= 300
            assert turn.arrival_s - before.arrival_s >= THINK_S - 1e-9
    # Saved and loaded with its sessions (an older trace without them loads as before).
    trace.save(tmp_path / "chat.jsonl")
    assert [r.session for r in Trace.load(tmp_path / "chat.jsonl").requests] == [
        r.session for r in trace.requests]


def _result(rid: str, tier: str, slo: float, ttft: float | None, **kw) -> RequestResult:
    return RequestResult(request_id=rid, tier=tier, arrival_s=0.0, prompt_tokens=100,
                         output_tokens=4 if ttft is not None else 0, ttft_slo_ms=slo,
                         ttft_s=ttft, e2e_s=None if ttft is None else ttft + 0.1, tpot_s=None,
                         **kw)


def _run(label: str, router: str, mode: str, requests: list[RequestResult]) -> RunResult:
    return RunResult(runner="fleet", policy=label, budget=2048, workload="fleet-bursts",
                     rate=8.0, seed=0, duration_s=10.0, requests=requests,
                     meta={"fleet": {"replicas": 2, "router": router, "on_doomed": mode}})


def test_the_table_checks_each_429_against_the_same_router_serving_it() -> None:
    served = _run("slack", "slack", "serve", [
        _result("a", "urgent", 200, 0.1, replica="r1"),
        _result("b", "urgent", 200, 0.5, replica="r2"),  # missed when served
        _result("c", "document", 20_000, 2.0, replica="r1")])
    rejected = _run("slack/reject", "slack", "reject", [
        _result("a", "urgent", 200, 0.1, replica="r1"),
        _result("b", "urgent", 200, None, error="HTTP 429", http_status=429,
                rejected_predicted_ttft_ms=450.0),
        _result("c", "document", 20_000, 2.0, replica="r2")])
    found = rejections(rejected, [served, rejected])
    assert found == {"rejected": 1, "predicted_past_slo": 1, "missed_under_serve": 1,
                     "serve_run": "slack"}
    table = fleet_table([served, rejected])
    assert "| rejected (429) | 0 | 1 |" in table
    assert "| 429s that missed when served | – | 1/1 (100%) |" in table
    assert "| requests per replica | 2 / 1 | 1 / 1 |" in table


def test_accepted_requests_late_by_more_than_a_decode_step_are_counted() -> None:
    """The bound for reject mode: an accepted request may miss by up to one decode step
    (the run's median TPOT, 30 ms here), not more; a 429 is not accepted."""
    def result(rid: str, ttft: float | None, **kw) -> RequestResult:
        return RequestResult(request_id=rid, tier="urgent", arrival_s=0.0, prompt_tokens=100,
                             output_tokens=4, ttft_slo_ms=200, ttft_s=ttft,
                             e2e_s=None if ttft is None else ttft + 0.09,
                             tpot_s=None if ttft is None else 0.03, **kw)

    run = _run("slack/reject", "slack", "reject", [
        result("in-time", 0.15, routed_predicted_ttft_ms=140.0),
        result("late-by-20ms", 0.22, routed_predicted_ttft_ms=190.0),
        # Late past a decode step: one the router foresaw (predicted 260 ms where it sent it),
        # one it did not (predicted in time: the routing decision's miss).
        result("foreseen", 0.25, routed_predicted_ttft_ms=260.0),
        result("unforeseen", 0.25, routed_predicted_ttft_ms=195.0),
        result("refused", None, error="HTTP 429", http_status=429)])
    assert late_past_a_decode_step(run) == (2, 4, pytest.approx(30.0))
    assert routing_misses(run) == (1, 3)
    table = fleet_table([run])
    assert "| accepted, late by more than a decode step (median TPOT) | 2/4 (50%) (30 ms) |" \
        in table
    assert "| of those predicted in time where routed: late by more than a decode step | " \
        "1/3 (33%) |" in table


@pytest.mark.timeout(600)
def test_bench_run_replicas_compares_routers_on_one_trace(sim_model, tmp_path) -> None:
    # Ray Serve comes with the cluster extra, which the README's test command installs.
    pytest.importorskip("ray.serve", reason="the fleet needs Ray Serve: pip install -e "
                                            "'.[test,cluster]'")
    from engine.entrypoints.cli import main

    from tests.utils.gpu_timed import simulated_run_argv

    out = tmp_path / "out"
    num_requests = 8
    assert main(simulated_run_argv(
        sim_model, tmp_path, "--replicas", "2", "--router", "slack", "pow2", "--workload",
        "fleet-bursts", "--num-requests", str(num_requests), "--rates", "4", "--seeds", "0",
        "--output-dir", str(out))) == 0
    table = (out / "fleet.md").read_text()
    head = next(line for line in table.splitlines() if line.startswith("|  |"))
    assert head == "|  | slack | pow2 |"
    assert "urgent TTFT attainment" in table and "document completed" in table
    doc = json.loads((out / "results.json").read_text())
    assert [r["policy"] for r in doc["runs"]] == ["slack", "pow2"]
    for run in doc["runs"]:
        assert run["runner"] == "fleet" and run["meta"]["fleet"]["replicas"] == 2
        assert len(run["requests"]) == num_requests
        assert len({r["request_id"] for r in run["requests"]}) == num_requests
        # Each request answered by a named replica, or failed with its reason.
        for r in run["requests"]:
            assert r["error"] is not None or (r["ttft_s"] is not None and r["replica"])
        assert len({r["replica"] for r in run["requests"] if r["replica"]}) <= 2
        # The router's prediction on the replica it chose came back with the response (once
        # that replica had reported; under either policy).
        predicted = [r["routed_predicted_ttft_ms"] for r in run["requests"]
                     if r["routed_predicted_ttft_ms"] is not None]
        assert predicted and all(ms > 0 for ms in predicted), run["requests"]
    records = read_figures(out / "results.jsonl")
    assert [r["kind"] for r in records] == (["request"] * num_requests + ["run"]) * 2 + \
        ["done"]
    assert (out / "summary.md").exists()


def test_router_names_pick_the_fleets_and_their_admission() -> None:
    from engine.benchmarks.fleet.fleet_run import fleet_modes

    assert fleet_modes(["slack", "pow2", "slack/reject"], ["serve"]) == [
        ("slack", "serve"), ("pow2", "serve"), ("slack", "reject")]
    assert fleet_modes(["slack", "pow2"], ["serve", "reject"]) == [
        ("slack", "serve"), ("pow2", "serve"), ("slack", "reject"), ("pow2", "reject")]
    for bad in (["fastest"], ["slack/drop"], ["slack", "slack/serve"]):
        with pytest.raises(ValueError):
            fleet_modes(bad, ["serve"])
