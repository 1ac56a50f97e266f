"""A misprediction costs a little lateness, never the aging bound (docs/design.md
section 9), in the GPU-timed simulation (engine/simulation, the h100-llama-3.1-8b profile): the
real EngineCore, scheduler, monitor thread, signal and vote.

A relaxed 24k-token document prefills in 2048-token chunks (70-140 ms steps); a turn the
predictor judges doomed arrives during it. Before, a doomed turn was never preempted for and was
ranked behind the document's chunks (priority -1/|time to deadline|), so it waited for the whole
document (about a second, 20x a 50 ms objective) or the aging bound. Now it is ranked ahead of
the document, whose minute of slack covers its predicted prefill, and served at the next step
boundary at the latest (the monitor may stop the step for it sooner): its TTFT is within
max(its objective, its prefill) plus one step."""

from __future__ import annotations

import time

import pytest

from monitor.policy import RequestView, urgency
from monitor.step_time_model import StepTimeModel, optimistic_prefill
from tests.utils.gpu_timed import StepLog, _engine, _replay, _request

# Alone (the README's serial run): the simulated steps are real sleeps, checked against
# deadlines.
pytestmark = pytest.mark.serial


def _seed(profile, factor: float) -> StepTimeModel:
    """The profile's own step model, every term `factor` x."""
    return StepTimeModel(seconds_per_token=factor * profile.seconds_per_token,
                         seconds_per_token_sq=factor * profile.seconds_per_attention,
                         seconds_per_decode_context=factor * profile.seconds_per_decode_context,
                         intercept_s=factor * profile.intercept_s,
                         floor_s=factor * profile.floor_s)


@pytest.mark.parametrize("tokens,slo_ms,factor", [
    # Served in 30 ms, predicted at 60 ms (the predictor kept 2x pessimistic): doomed by a
    # misprediction; its TTFT is within its objective plus one step.
    (600, 50.0, 2.0),
    # The case that showed it: a 6000-token turn with a 150 ms objective needs 214 ms, doomed for
    # real (the predictor exact, learning as usual); it got 6.7 s (the aging bound), and is
    # served at the next step boundary at the latest now.
    (6000, 150.0, 1.0),
], ids=["mispredicted", "genuinely-doomed"])
def test_a_turn_judged_doomed_is_served_within_a_step_of_when_it_could_be(
        sim_model, tmp_path, tokens, slo_ms, factor):
    from engine.simulation.profile import load_profile

    profile = load_profile("h100-llama-3.1-8b")
    seed = _seed(profile, factor)
    seed_path = tmp_path / "ttft.json"
    seed.save(seed_path)
    engine = _engine(sim_model, 2048, ttft_model=str(seed_path))
    if factor != 1.0:
        # Kept pessimistic: the online refit and its margins would otherwise learn the truth
        # from the document's steps within a few of them.
        engine.step_time_predictor.observe_point = (  # type: ignore[method-assign]
            lambda point: None)
    log = StepLog()
    log.wrap(engine)
    try:
        doc = _request("doc", 24_000, 60_000.0, 1)
        turn = _request("turn", tokens, slo_ms, 2)
        # The turn arrives 0.2 s after the document's first chunk (of about a second of them),
        # not 0.3 s after the document: a first step the machine delayed (once by 0.31 s, in
        # the suite's serial step) let the turn arrive before the document began.
        doc.arrival_time = time.monotonic()
        engine.submit_request(doc)
        while not log.steps:
            engine.step()
        _replay(engine, [(0.2, turn)])
        # Probe: judged doomed at arrival (even by the optimistic estimate; nothing decoded
        # then).
        at_arrival = RequestView("turn", turn.deadline, tokens, slo_s=slo_ms / 1000)
        judged = urgency(at_arrival, turn.arrival_time, seed.predict,
                         optimistic=lambda n: optimistic_prefill(seed, n))
        assert judged.doomed, judged
        prefill = profile.step_seconds(tokens, tokens ** 2, 0)
        assert (prefill < slo_ms / 1000) == (factor != 1.0)
        # Probe: the document was prefilling when the turn arrived, and went on after it.
        doc_steps = [s for s in log.steps if any(r.req_id == "doc" and len(r.token_ids) > 1
                                                 for r in s[0].requests)]
        assert doc_steps[0][2] < turn.arrival_time < doc_steps[-1][2]
        assert turn.first_token_time is not None
        ttft = turn.first_token_time - turn.arrival_time
        # A step of the engine loop: from one step's start to the next one's (the host work
        # around the forward pass included).
        starts = [start for _, _, start, _ in log.steps]
        longest_step = max(b - a for a, b in zip(starts, starts[1:]))
        # Before: about a second (the rest of the document), or the aging bound.
        assert ttft <= max(slo_ms / 1000, prefill) + longest_step, (ttft, longest_step)
        # The relaxed document still completed.
        assert doc.first_token_time is not None and len(doc.output_token_ids) == 8
    finally:
        engine.shutdown()
