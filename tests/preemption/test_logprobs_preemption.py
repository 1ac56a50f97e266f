"""Logprobs survive mid-forward preemption: in every mode (recompute, pause, suspend) the victim
and the urgent request get the same tokens, sampled logprobs and prompt logprobs as in a run
where nothing was stopped (each run paired with the probe that the step really was unwound)."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from tests.utils.mid_forward import _engine, _on_long_step, _prompt, _run

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, logprobs=2,
                        prompt_logprobs=1)


def _request(req_id: str, prompt: list[int], slo_ms: float | None) -> Request:
    return Request(request_id=req_id, prompt_token_ids=prompt, ttft_slo_ms=slo_ms,
                   sampling_params=PARAMS)


def _scores(request: Request) -> dict:
    assert request.prompt_logprobs is not None
    return {"tokens": request.output_token_ids,
            "prompt_ids": request.prompt_logprobs.token_ids,
            "prompt": request.prompt_logprobs.logprobs,
            "prompt_top": request.prompt_logprobs.top_token_ids}


def _finish(engine: EngineCore, requests: list[Request]) -> dict[str, dict]:
    """Runs to completion, collecting each request's sampled logprobs as they are committed."""
    sampled: dict[str, list[float]] = {r.request_id: [] for r in requests}
    original = engine.scheduler.update_from_output

    def recording(scheduler_output, runner_output):
        updated = original(scheduler_output, runner_output)
        for request in updated:
            if request.last_logprobs is not None:
                sampled[request.request_id].extend(request.last_logprobs.logprobs)
        return updated

    engine.scheduler.update_from_output = recording
    _run(engine)
    return {r.request_id: {**_scores(r), "sampled": sampled[r.request_id]} for r in requests}


def _assert_same(got: dict, want: dict) -> None:
    for req_id in want:
        g, w = got[req_id], want[req_id]
        assert g["tokens"] == w["tokens"] and g["prompt_ids"] == w["prompt_ids"], req_id
        assert g["prompt_top"] == w["prompt_top"], req_id
        assert g["prompt"] == pytest.approx(w["prompt"], abs=1e-4), req_id
        assert g["sampled"] == pytest.approx(w["sampled"], abs=1e-4), req_id


@pytest.mark.parametrize("mode", ["recompute", "pause", "suspend"])
def test_logprobs_are_unchanged_by_every_preemption_mode(model: str, mode: str) -> None:
    prompts = {"long": _prompt(700, seed=3), "urgent": _prompt(20, seed=4)}
    reference = _engine(model, slo_preemption=False, max_num_batched_tokens=256)
    try:
        requests = [_request(k, p, None) for k, p in prompts.items()]
        for r in requests:
            reference.add_request(r)
        want = _finish(reference, requests)
    finally:
        reference.shutdown()
    assert len(want["long"]["prompt"]) == 699 and len(want["long"]["sampled"]) == 4

    engine = _engine(model, slo_preempt_mode=mode, max_num_batched_tokens=256)
    try:
        long = _request("long", prompts["long"], slo_ms=60_000)
        engine.add_request(long)
        engine.step()  # the first chunk completes: its prompt logprobs are committed
        assert len(long.prompt_logprobs) == 256
        arrived: list[Request] = []

        def arrive() -> None:
            arrived.append(_request("urgent", prompts["urgent"], slo_ms=200))
            engine.submit_request(arrived[0])

        _on_long_step(engine, layer=1, action=arrive, min_tokens=256)
        assert engine.step() == []  # the second chunk's step, unwound
        # Probe: recompute scores the prompt again from the start (its KV is gone and the
        # prefix cache is skipped); pause and suspend keep the first chunk's scores.
        assert len(long.prompt_logprobs) == (0 if mode == "recompute" else 256)
        got = _finish(engine, [long, *arrived])
        (event,) = engine.slo_preemption.events  # probe: the step really was unwound
        assert event.victim_id == "long" and event.waiter_id == "urgent"
        assert event.applied == mode
    finally:
        engine.shutdown()
    _assert_same(got, want)
