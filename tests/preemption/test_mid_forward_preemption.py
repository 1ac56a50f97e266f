"""Mid-forward-pass preemption end to end, in process: a long prefill runs in one big step, an
urgent request arrives during it, the monitor targets the step, the vote unwinds it between two
layers, the engine rolls it back and admits the urgent request first; every greedy output equals
an unpreempted run. Layers are slowed down by the runner's test hook (time per token per layer),
so the long step lasts long enough to be observed."""

from __future__ import annotations

import threading
import time

import pytest

from engine.runtime.engine_core import EngineCore
from engine.core.request import Request
from tests.utils.mid_forward import (NUM_LAYERS, LONG_PROMPT, MAX_TOKENS, URGENT_SLO_MS, _prompt,
                                     _engine, _request, _run, _on_long_step, _reference_outputs,
                                     _count_tokens_per_layer,
                                     check_urgent_arrival_unwinds_long_prefill)
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV
from workers.preemption.layer_delay import observe_attention_ops


def _suspended(engine) -> dict[str, tuple[int, int]]:
    """The scheduler's suspended chunks as (start_pos, num_tokens) of their first segment."""
    return {req_id: segments[0][:2]
            for req_id, segments in engine.scheduler.slack.suspensions.suspended.items()}


@pytest.mark.parametrize("mode", ["recompute", "pause", "suspend"])
def test_urgent_arrival_unwinds_long_prefill(model: str, mode: str) -> None:
    check_urgent_arrival_unwinds_long_prefill(model, mode)


@pytest.mark.parametrize("mode", ["recompute", "suspend"])
def test_urgent_arrival_unwinds_a_step_replayed_as_pieces(model: str, mode: str,
                                                          monkeypatch) -> None:
    """CUDA graphs on (their CPU stand-in, workers.graphs.cuda_graphs.EagerReplayBackend): the long
    prefill runs as pieces between the attention ops, the vote between two pieces stops it,
    and every output equals an eager run's (the check probes that the pieces ran and
    unwound)."""
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    check_urgent_arrival_unwinds_long_prefill(model, mode)


@pytest.mark.parametrize("mode", ["pause", "suspend"])
def test_pause_keeps_earlier_chunks(model: str, mode: str) -> None:
    """Chunked long prefill (budget 256): preempted during its second chunk, a paused victim
    keeps the KV of the first chunk and resumes from it instead of recomputing; a suspended
    one also keeps the second chunk's stopped pass and resumes it over the cached prefix."""
    prompts = {"long": _prompt(700, seed=3), "urgent": _prompt(20, seed=4)}
    expected = _reference_outputs(model, prompts)
    engine = _engine(model, slo_preempt_mode=mode, max_num_batched_tokens=256)
    try:
        long = _request("long", prompts["long"], slo_ms=60_000)
        engine.add_request(long)
        engine.step()  # first chunk: 256 tokens, completes
        assert long.num_computed_tokens == 256
        computed_after_unwind: list[int] = []
        arrived: list[Request] = []

        def arrive() -> None:  # the urgent request's arrival time is now, mid-step
            # Tighter than usual: the 256-token chunk's step is shorter than the one-step prefill.
            arrived.append(_request("urgent", prompts["urgent"], slo_ms=200))
            engine.submit_request(arrived[0])

        _on_long_step(engine, layer=1, action=arrive, min_tokens=256)
        assert engine.step() == []  # the second chunk's step, unwound
        assert len(engine.slo_preemption.events) == 1
        computed_after_unwind.append(long.num_computed_tokens)
        (urgent,) = arrived
        engine.step()  # the urgent request's prefill; the victim is held back
        assert urgent.first_token_time is not None
        assert long.num_computed_tokens == 256  # probe: paused, not scheduled, not recomputed
        held_suspended = len(engine.executor.runner.suspended)
        _run(engine)
        (event,) = engine.slo_preemption.events
        assert event.applied == mode
        assert event.wasted_tokens == (0 if mode == "suspend" else 256)
        assert held_suspended == (1 if mode == "suspend" else 0)
        assert computed_after_unwind == [256]
        assert {"long": long.output_token_ids, "urgent": urgent.output_token_ids} == expected
    finally:
        engine.shutdown()


def test_suspend_keeps_every_chunk_of_the_unwound_step(model: str) -> None:
    """Two prefills share the step the urgent arrival unwinds: the victim's chunk and the other
    one are both kept; the other resumes beside the urgent request, the victim after it."""
    prompts = {"long": _prompt(LONG_PROMPT, seed=7), "mid": _prompt(200, seed=8),
               "urgent": _prompt(20, seed=9)}
    expected = _reference_outputs(model, prompts)
    engine = _engine(model, slo_preempt_mode="suspend")
    try:
        requests = {k: _request(k, prompts[k], slo_ms=60_000) for k in ("long", "mid")}
        for r in requests.values():
            engine.add_request(r)

        def arrive() -> None:
            requests["urgent"] = _request("urgent", prompts["urgent"], slo_ms=URGENT_SLO_MS)
            engine.submit_request(requests["urgent"])

        _on_long_step(engine, layer=1, action=arrive, min_tokens=LONG_PROMPT + 200)
        tokens_per_layer = _count_tokens_per_layer(engine)
        engine.step()
        assert _suspended(engine) == {"long": (0, LONG_PROMPT), "mid": (0, 200)}
        _run(engine)
        (event,) = engine.slo_preemption.events
        assert event.applied == "suspend" and event.wasted_tokens == 0
        assert tokens_per_layer[0] == tokens_per_layer[-1]  # nothing ran through a layer twice
        assert {k: r.output_token_ids for k, r in requests.items()} == expected
        assert len(engine.executor.runner.suspended) == 0
        assert engine.scheduler.kv_cache_manager.num_free_blocks == 160
    finally:
        engine.shutdown()


def test_aborting_a_suspended_victim_frees_its_activations(model: str) -> None:
    prompts = {"long": _prompt(LONG_PROMPT, seed=5), "urgent": _prompt(20, seed=6)}
    engine = _engine(model, slo_preempt_mode="suspend")
    try:
        engine.add_request(_request("long", prompts["long"], slo_ms=60_000))
        _on_long_step(engine, layer=1, action=lambda: engine.submit_request(
            _request("urgent", prompts["urgent"], slo_ms=URGENT_SLO_MS)))
        assert engine.step() == []  # unwound
        runner = engine.executor.runner
        assert _suspended(engine) == {"long": (0, LONG_PROMPT)}  # probe: suspended
        assert len(runner.suspended) == 1
        engine.abort_requests(["long"])
        _run(engine)
        assert len(runner.suspended) == 0 and _suspended(engine) == {}
        assert engine.scheduler.kv_cache_manager.num_free_blocks == 160
    finally:
        engine.shutdown()


def _target_last_layer(engine: EngineCore):
    """Publish a target for the running step from the forward pass itself, just before the
    last layer (synchronous: the vote of that very layer sees it). Returns the signal."""
    signal = engine.slo_preemption.signal
    published: list[bool] = []

    def target_running_step(layer_idx: int, _num_tokens: int) -> None:
        if layer_idx == NUM_LAYERS - 1 and not published:
            published.append(True)
            signal.publish(engine.scheduler.step_id, "long", "", time.monotonic())

    observe_attention_ops(engine.executor.runner.model, target_running_step)
    return signal


def test_rule2_in_suspend_mode_applies_only_to_work_thrown_away(model: str) -> None:
    """Suspend mode, the same late target as below with a stubborn fraction of 0.8: a
    suspended chunk loses nothing, so the step still unwinds at the last layer, with a decode
    beside the long prefill (its one token is all that is thrown away); the chunk resumes at
    that layer and every output equals the unpreempted run's."""
    prompts = {"long": _prompt(LONG_PROMPT, seed=5), "short": _prompt(20, seed=7)}
    expected = _reference_outputs(model, prompts)
    engine = _engine(model, stubborn_fraction=0.8, slo_preempt_mode="suspend")
    try:
        short = _request("short", prompts["short"], slo_ms=None)
        engine.add_request(short)
        engine.step()  # its prefill: it decodes in the long request's step
        long = _request("long", prompts["long"], slo_ms=None)
        engine.add_request(long)
        signal = _target_last_layer(engine)
        assert engine.step() == []  # unwound
        assert signal.target_step_id == 2  # probe: the target named the running step
        (event,) = engine.slo_preemption.events
        assert event.layer == NUM_LAYERS - 1
        assert _suspended(engine) == {"long": (0, LONG_PROMPT)}
        _run(engine)
        assert {r.request_id: r.output_token_ids for r in (long, short)} == expected
    finally:
        engine.shutdown()


@pytest.mark.parametrize("stubborn_fraction,unwinds", [(0.8, False), (0.9, True)])
def test_rule2_past_stubborn_fraction_the_step_completes(model: str, stubborn_fraction: float,
                                                         unwinds: bool) -> None:
    """The target is written just before the last layer (index 7 of 8: 0.875 of the way).
    Past the stubborn fraction (0.8) the step completes; the paired probe (0.9) shows the same
    target does stop the step when the layer is still within it. Pause mode: an unwind would
    throw the whole chunk's work away."""
    engine = _engine(model, stubborn_fraction=stubborn_fraction, slo_preempt_mode="pause")
    try:
        long = _request("long", _prompt(LONG_PROMPT, seed=5), slo_ms=None)
        engine.add_request(long)
        signal = _target_last_layer(engine)
        engine.step()
        assert signal.target_step_id == 1  # probe: the target named the running step
        if unwinds:
            (event,) = engine.slo_preemption.events
            assert event.layer == NUM_LAYERS - 1 and long.num_computed_tokens == 0
        else:
            assert not engine.slo_preemption.events
            assert long.num_computed_tokens == LONG_PROMPT and long.num_output_tokens == 1
        _run(engine)
        assert long.num_output_tokens == MAX_TOKENS
    finally:
        engine.shutdown()


def test_rule1_adversarial_urgent_stream_cannot_preempt_anyone_twice(model: str) -> None:
    """Every long step that starts brings a new urgent request (up to 8) and the aggressive
    gate fires whenever it can: each request is a victim at most once, the number of unwound
    steps stays bounded by the number of requests, and everything finishes with unchanged
    greedy outputs."""
    longs = {f"long{i}": _prompt(300, seed=20 + i) for i in range(3)}
    urgents = {f"urgent{i}": _prompt(30, seed=40 + i) for i in range(8)}
    expected = _reference_outputs(model, {**longs, **urgents})

    engine = _engine(model, slo_preempt_policy="aggressive", slo_preempt_mode="pause")
    try:
        requests = {k: _request(k, p, slo_ms=50_000 + 10_000 * i)
                    for i, (k, p) in enumerate(longs.items())}
        for r in requests.values():
            engine.add_request(r)
        pending = list(urgents.items())

        def arrive_on_every_long_step(layer_idx: int, num_tokens: int) -> None:
            if layer_idx == 1 and num_tokens >= 200 and pending:
                req_id, prompt = pending.pop(0)
                requests[req_id] = _request(req_id, prompt, slo_ms=URGENT_SLO_MS)
                # From another thread, as the HTTP reader would hand it over.
                threading.Thread(target=engine.submit_request, args=(requests[req_id],)).start()

        observe_attention_ops(engine.executor.runner.model, arrive_on_every_long_step)
        _run(engine)

        events = engine.slo_preemption.events
        num_arrivals = len(urgents) - len(pending)
        # Probes: the stream really did preempt, more than once; and some arrivals did not.
        assert len(events) >= 2
        assert num_arrivals > len(events)
        assert len({e.victim_id for e in events}) == len(events)  # never the same victim twice
        assert all(r.num_slo_preemptions <= 1 for r in requests.values())
        assert sum(r.num_slo_preemptions for r in requests.values()) == sum(
            e.applied is not None for e in events)
        assert len(events) <= len(requests)
        assert {k: r.output_token_ids for k, r in requests.items()} == {
            k: expected[k] for k in requests}
        assert all(r.is_finished for r in requests.values())
    finally:
        engine.shutdown()


def test_suspend_lifts_rule1_and_the_same_stream_wastes_no_prefill_work(model: str) -> None:
    """An adversarial stream in suspend mode: every long step brings a new urgent request and
    the only long request is the only possible victim. It is preempted again and again (Rule 1
    is lifted: its chunk resumes where it stopped), yet no prompt token goes through a layer
    twice, every unwind answers an arrival, and everything finishes with unchanged outputs."""
    prompts = {"long": _prompt(LONG_PROMPT, seed=20)}
    urgents = {f"urgent{i}": _prompt(30, seed=40 + i) for i in range(4)}
    expected = _reference_outputs(model, {**prompts, **urgents})

    engine = _engine(model, slo_preempt_policy="aggressive", slo_preempt_mode="suspend")
    try:
        requests = {"long": _request("long", prompts["long"], slo_ms=60_000)}
        engine.add_request(requests["long"])
        pending = list(urgents.items())
        runner = engine.executor.runner
        fired: set[int] = set()

        def arrive_once_per_long_step(layer_idx: int, num_tokens: int) -> None:
            # The first layer of a step where the long chunk is in the batch (a resumed chunk
            # joins at the layer its pass stopped at).
            step = runner.vote.step_id if runner.vote is not None else -1
            if 1 <= layer_idx < 5 and num_tokens >= 200 and pending and step not in fired:
                fired.add(step)
                req_id, prompt = pending.pop(0)
                requests[req_id] = _request(req_id, prompt, slo_ms=URGENT_SLO_MS)
                threading.Thread(target=engine.submit_request, args=(requests[req_id],)).start()

        observe_attention_ops(runner.model, arrive_once_per_long_step)
        tokens_per_layer = _count_tokens_per_layer(engine)
        _run(engine)

        events = engine.slo_preemption.events
        num_arrivals = len(urgents) - len(pending)
        assert 2 <= len(events) <= num_arrivals
        # Probe: Rule 1 is lifted, the long request was the victim more than once.
        assert requests["long"].num_slo_preemptions >= 2
        assert all(e.applied == "suspend" for e in events)
        # Rows that went through layer 0 more often than through the last layer are exactly
        # the work the unwinds threw away: only decodes (one row each), no prompt tokens.
        rerun = tokens_per_layer[0] - tokens_per_layer[-1]
        assert rerun == sum(e.wasted_tokens for e in events)
        assert rerun <= len(events) * len(requests)
        assert {k: r.output_token_ids for k, r in requests.items()} == {
            k: expected[k] for k in requests}
        assert all(r.is_finished for r in requests.values())
        assert len(runner.suspended) == 0
    finally:
        engine.shutdown()
