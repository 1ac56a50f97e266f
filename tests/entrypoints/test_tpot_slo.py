"""TPOT objectives: where a request's time-per-output-token objective comes from
(offline argument; HTTP body, header, server default), how it is measured (vLLM's TPOT: the mean
gap after the first token) and where it is reported (response metrics, Prometheus counters)."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.ipc.core_messages import AddRequest, CoreOutputs
from engine.outputs import EngineCoreOutput, RequestMetrics, SchedulerStats
from engine.serving.api_server import ServerSettings
from engine.serving.metrics import ServerMetrics
from tests.utils.inprocess_server import FakeCore, app_client
from tests.utils.server_helpers import collect_stream, sse_data


def test_tpot_is_the_mean_gap_after_the_first_token():
    m = RequestMetrics(arrival_time=0.0, first_token_time=1.0, finish_time=1.9,
                       num_output_tokens=4, tpot_slo_ms=300.0)
    assert m.tpot == pytest.approx(0.3)
    assert m.tpot_slo_met is True
    m.tpot_slo_ms = 299.0
    assert m.tpot_slo_met is False
    one = RequestMetrics(arrival_time=0.0, first_token_time=1.0, finish_time=1.0,
                         num_output_tokens=1, tpot_slo_ms=1.0)
    assert one.tpot is None and one.tpot_slo_met is True  # no gap to miss
    running = RequestMetrics(arrival_time=0.0, first_token_time=1.0, num_output_tokens=3,
                             tpot_slo_ms=1.0)
    assert running.tpot_slo_met is None  # judged when it finishes
    assert RequestMetrics(arrival_time=0.0).tpot_slo_met is None  # no objective


def test_offline_requests_carry_and_report_their_objectives(tiny_model):
    llm = LLM(model=tiny_model("llama"), dtype="float32", num_kv_blocks=32, max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        loose, tight, none = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params,
                                          ttft_slo_ms=[60_000, 60_000, None],
                                          tpot_slo_ms=[60_000, 1e-6, None])
        assert loose.metrics.tpot_slo_ms == 60_000 and loose.metrics.tpot_slo_met is True
        assert loose.metrics.ttft_slo_ms == 60_000 and loose.metrics.ttft_slo_met is True
        assert tight.metrics.tpot is not None and tight.metrics.tpot_slo_met is False
        assert none.metrics.tpot_slo_met is None
        with pytest.raises(ValueError, match="tpot_slo_ms must be a positive number"):
            llm.generate({"prompt_token_ids": [5]}, params, tpot_slo_ms=0)
    finally:
        llm.shutdown()


def test_http_objective_from_body_header_or_default(tiny_model):
    from transformers import AutoTokenizer

    model_dir = tiny_model("llama")
    fake = FakeCore(len(AutoTokenizer.from_pretrained(model_dir)))
    settings = ServerSettings(served_model_name="tiny", default_tpot_slo_ms=80.0)

    async def run() -> None:
        async with app_client(model_dir, settings, fake=fake) as (http, _):
            base = {"prompt": "Deadlines matter", "max_tokens": 1}
            for body, headers, expected in (({"tpot_slo_ms": 25}, {"X-SLO-TPOT-MS": "50"}, 25),
                                            ({}, {"X-SLO-TPOT-MS": "50"}, 50), ({}, {}, 80)):
                response = await http.post("/v1/completions", json={**base, **body},
                                           headers=headers)
                assert response.status_code == 200, response.text
                assert response.json()["metrics"]["tpot_slo_ms"] == expected
            assert [r.tpot_slo_ms for r in fake.requests] == [25.0, 50.0, 80.0]
            for body, headers, param in (({"tpot_slo_ms": 0}, {}, "tpot_slo_ms"),
                                         ({}, {"X-SLO-TPOT-MS": "soon"}, "x-slo-tpot-ms")):
                response = await http.post("/v1/completions", json={**base, **body},
                                           headers=headers)
                assert response.status_code == 400, response.text
                assert param in response.text
            assert len(fake.requests) == 3  # nothing refused reached the engine

    asyncio.run(run())


def finish_with_slack(message: AddRequest) -> tuple[list, bool]:
    """Two tokens; the core reports 42 ms of slack at admission for a request with a deadline."""
    slack = None if message.ttft_slo_ms is None else 0.042
    outs = [EngineCoreOutput(req_id=message.request_id, new_token_ids=[5],
                             slack_at_admission_s=slack),
            EngineCoreOutput(req_id=message.request_id, new_token_ids=[6], finish_reason="length",
                             slack_at_admission_s=slack)]
    return [CoreOutputs(outputs=[out], stats=SchedulerStats()) for out in outs], False


def test_http_metrics_report_the_slack_at_admission(tiny_model):
    """What the core reports as the request's slack at admission reaches the response's
    `metrics` (and the final chunk's, when streamed) in ms; None without a deadline."""
    from transformers import AutoTokenizer

    model_dir = tiny_model("llama")
    fake = FakeCore(len(AutoTokenizer.from_pretrained(model_dir)), script=finish_with_slack)

    async def run() -> None:
        async with app_client(model_dir, fake=fake) as (http, _):
            base = {"prompt": "Deadlines matter", "max_tokens": 2}
            response = await http.post("/v1/completions", json={**base, "ttft_slo_ms": 500})
            assert response.status_code == 200, response.text
            assert response.json()["metrics"]["slack_at_admission_ms"] == pytest.approx(42.0)
            response = await http.post("/v1/completions", json=base)
            assert response.json()["metrics"]["slack_at_admission_ms"] is None
            body = {**base, "ttft_slo_ms": 500, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                streamed = collect_stream(sse_data([line async for line in
                                                    response.aiter_lines()]))
            assert streamed["done"] and streamed["error"] is None
            assert streamed["metrics"]["slack_at_admission_ms"] == pytest.approx(42.0)

    asyncio.run(run())


def test_engine_reports_the_slack_at_admission(tiny_model):
    """End to end: the scheduler's slack at admission reaches the request's metrics."""
    llm = LLM(model=tiny_model("llama"), dtype="float32", num_kv_blocks=32, max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        with_slo, without = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params,
                                         ttft_slo_ms=[60_000, None])
        assert without.metrics.slack_at_admission_s is None
        # Nearly the whole minute was left when it was admitted.
        assert 50 < with_slo.metrics.slack_at_admission_s < 60
    finally:
        llm.shutdown()


def test_tpot_counters_count_finished_requests_with_an_objective():
    """Counted from the edge's stamps (engine.serving.edge_clock), once a choice finished."""
    metrics = ServerMetrics("tiny")
    for slo_ms in (300.0, 100.0, None):
        metrics.on_edge_finish(RequestMetrics(arrival_time=0.0, first_token_time=1.0,
                                              finish_time=1.4, num_output_tokens=3,
                                              tpot_slo_ms=slo_ms))
    text = metrics.render().decode()
    assert 'sloserve:tpot_slo_met_total{model_name="tiny"} 1.0' in text
    assert 'sloserve:tpot_slo_missed_total{model_name="tiny"} 1.0' in text


def test_an_enormous_objective_caps_nothing_and_overflows_nothing():
    """Found by the HTTP fuzz test: tpot_slo_ms = 1e308 with a fast fitted line made the TPOT
    cap convert an infinite token count to int and took EngineCore down."""
    import time

    from monitor.step_time_model import MAX_TOKENS_WITHIN, StepTimeModel
    from tests.utils.scheduling import FakeRunner, make_request, make_scheduler

    assert StepTimeModel(seconds_per_token=1e-9).max_tokens_within(1e305) == MAX_TOKENS_WITHIN
    sched = make_scheduler(num_blocks=64, budget=64, policy="slo")
    sched.step_time_predictor.current = StepTimeModel(seconds_per_token=1e-9, intercept_s=0.0)
    runner = FakeRunner(sched)
    for i, slo in enumerate((1e308, 1e-300, 50.0)):
        request = make_request(f"r{i}", 20, max_tokens=4, ignore_eos=True,
                               arrival=time.monotonic())
        request.tpot_slo_ms = slo
        request.ttft_slo_ms = 1e308
        sched.add_request(request)
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert not sched.has_unfinished_requests()
