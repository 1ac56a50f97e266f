"""Mid-forward-pass preemption end to end, in process: a long prefill runs in one big step, an
urgent request arrives during it, the monitor targets the step, the vote unwinds it between two
layers, the engine rolls it back and admits the urgent request first; every greedy output equals
an unpreempted run. Layers are slowed down by the runner's test hook (time per token per layer),
so the long step lasts long enough to be observed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from bench.greedy_divergence import (NEAR_TIE_MARGIN, assert_no_clear_divergence,
                                     compare_greedy, fresh_engine_top_two)
from engine.config import build_engine_config
from engine.runtime.engine_core import EngineCore
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from monitor.predictor import LinearTTFT
from workers.cuda_graphs import FAKE_GRAPHS_ENV
from workers.model_runner import LAYER_DELAY_ENV, observe_attention_ops

NUM_LAYERS = 8
# 400 prompt tokens x 150 us = 60 ms per layer (480 ms for the long step); 44 tokens: 7 ms.
DELAY_US_PER_TOKEN = 150
LONG_PROMPT = 400
MAX_TOKENS = 6


# The engines' TTFT line, matching the slowed layers (1.2 ms per token), so that the monitor's
# estimate of the running step's remaining time is right: it preempts only for a waiter whose
# slack does not cover the rest of the step.
URGENT_SLO_MS = 300
_TTFT_FILE: dict[str, str] = {}


def _suspended(engine) -> dict[str, tuple[int, int]]:
    """The scheduler's suspended chunks as (start_pos, num_tokens) of their first segment."""
    return {req_id: segments[0][:2]
            for req_id, segments in engine.scheduler.slack.suspended.items()}


@pytest.fixture
def model(tiny_model, monkeypatch, tmp_path_factory) -> str:
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    if "path" not in _TTFT_FILE:
        path = tmp_path_factory.mktemp("ttft") / "ttft.json"
        LinearTTFT(seconds_per_token=NUM_LAYERS * DELAY_US_PER_TOKEN * 1e-6,
                   intercept_s=0.02).save(path)
        _TTFT_FILE["path"] = str(path)
    return tiny_model("llama", num_hidden_layers=NUM_LAYERS, max_position_embeddings=1024)


def _prompt(n: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(3, 250, (n - len(prefix or []),), generator=g).tolist()
    return (prefix or []) + tail


def _engine(model: str, **overrides) -> EngineCore:
    # The CPU unless a case names another device: left at "auto", a GPU machine would run these
    # CPU-timed scenarios (and their references) on CUDA, capturing graphs over Triton kernels
    # that a pytest process interpreting them cannot capture.
    args = dict(device="cpu", dtype="float32", num_kv_blocks=160, block_size=16,
                max_num_batched_tokens=1024, scheduling_policy="slo", preempt_min_tokens=32, enable_prefix_caching=True,
                ttft_model=_TTFT_FILE.get("path"))
    args.update(overrides)
    return EngineCore(build_engine_config(model, **args))


def _request(req_id: str, prompt: list[int], slo_ms: float | None) -> Request:
    return Request(request_id=req_id, prompt_token_ids=prompt, ttft_slo_ms=slo_ms,
                   sampling_params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  temperature=0.0))


def _run(engine: EngineCore, timeout_s: float = 120.0) -> list[tuple[float, float]]:
    """Steps until every request finished; returns each step's (start, end) time."""
    deadline = time.monotonic() + timeout_s
    steps = []
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        started = time.monotonic()
        engine.step()
        steps.append((started, time.monotonic()))
        engine.scheduler.check_invariants()
    return steps


def _duration_of_step_at(steps: list[tuple[float, float]], t: float) -> float:
    return next(end - start for start, end in steps if start <= t <= end)


def _on_long_step(engine: EngineCore, layer: int, action: Callable[[], None],
                  min_tokens: int = LONG_PROMPT) -> None:
    """Run `action` on another thread once the forward pass of a long step reaches `layer`
    (the arrival races the forward pass, as it would over HTTP)."""
    reached = threading.Event()

    def observer(layer_idx: int, num_tokens: int) -> None:
        if layer_idx == layer and num_tokens >= min_tokens:
            reached.set()

    # At the layer's attention op, which an eager pass and a step replayed as CUDA graph
    # pieces both run in Python (a hook inside a piece never runs in a real replay).
    observe_attention_ops(engine.executor.runner.model, observer)

    def fire() -> None:
        if reached.wait(timeout=30):
            action()

    threading.Thread(target=fire, daemon=True).start()


def _reference_outputs(model: str, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    engine = _engine(model, mid_forward_preemption=False, enforce_eager=True)
    try:
        requests = {k: _request(k, p, None) for k, p in prompts.items()}
        for r in requests.values():
            engine.add_request(r)
        _run(engine)
        return {k: r.output_token_ids for k, r in requests.items()}
    finally:
        engine.shutdown()


def _assert_equal_to_reference(model: str, prompts: dict[str, list[int]],
                               got: dict[str, list[int]], expected: dict[str, list[int]],
                               device: str) -> None:
    """Every output equals the CPU reference's. On a GPU (CUDA graphs, Triton kernels) an
    argmax may flip where the reference's top two nearly tie: reported and accepted
    (bench/greedy_divergence.py); on the CPU the runs are exact."""
    names = sorted(prompts)
    divergences = compare_greedy(
        [prompts[k] for k in names], [got[k] for k in names], [expected[k] for k in names],
        fresh_engine_top_two(model, device="cpu", dtype="float32", enforce_eager=True),
        tolerance=NEAR_TIE_MARGIN if device == "cuda" else 0.0)
    for tie in assert_no_clear_divergence(divergences):
        print(f"accepted {tie.describe()}")


def _count_tokens_per_layer(engine: EngineCore) -> list[int]:
    """Tokens that reached each layer's attention op, summed over the run (a step replayed as
    pieces counts its real rows; a decode step replayed as one graph is counted at every layer
    alike on the CPU stand-in, and at none on a GPU)."""
    model = engine.executor.runner.model
    counts = [0] * model.num_layers

    def counter(layer_idx: int, num_tokens: int) -> None:
        counts[layer_idx] += num_tokens

    observe_attention_ops(model, counter)
    return counts


@pytest.mark.parametrize("mode", ["recompute", "pause", "suspend"])
def test_urgent_arrival_unwinds_long_prefill(model: str, mode: str) -> None:
    check_urgent_arrival_unwinds_long_prefill(model, mode)


@pytest.mark.parametrize("mode", ["recompute", "suspend"])
def test_urgent_arrival_unwinds_a_step_replayed_as_pieces(model: str, mode: str,
                                                          monkeypatch) -> None:
    """CUDA graphs on (their CPU stand-in, workers.cuda_graphs.EagerReplayBackend): the long
    prefill runs as pieces between the attention ops, the vote between two pieces stops it,
    and every output equals an eager run's (the check probes that the pieces ran and
    unwound)."""
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    check_urgent_arrival_unwinds_long_prefill(model, mode)


def check_urgent_arrival_unwinds_long_prefill(model: str, mode: str, check_timing: bool = True,
                                              **engine_args) -> None:
    """The scenario, with the preempted engine built with ``engine_args`` (another device or
    kernel backend: the reference run is always the CPU's PyTorch path). ``check_timing=False``
    where the kernels run far slower than the engine's TTFT line says (Triton's interpreter):
    the scheduler then plans steps on wrong costs, and only the unwind itself is checked."""
    long_prompt = _prompt(LONG_PROMPT, seed=1)
    # The urgent prompt shares the long one's first 32 tokens: the unwound step must not have
    # committed their prefix-cache hashes, and a hit must still give the same tokens.
    prompts = {"long": long_prompt, "urgent": _prompt(44, seed=2, prefix=long_prompt[:32])}
    expected = _reference_outputs(model, prompts)

    engine = _engine(model, slo_preempt_mode=mode, **engine_args)
    try:
        long = _request("long", prompts["long"], slo_ms=60_000)
        engine.add_request(long)
        arrived: list[Request] = []

        def arrive() -> None:  # the urgent request's arrival time is now, mid-step
            arrived.append(_request("urgent", prompts["urgent"], slo_ms=URGENT_SLO_MS))
            engine.submit_request(arrived[0])

        _on_long_step(engine, layer=1, action=arrive)
        tokens_per_layer = _count_tokens_per_layer(engine)
        steps = _run(engine)
        (urgent,) = arrived

        assert engine.preemption is not None
        (event,) = engine.preemption.events  # probe: the step really was unwound, once
        assert 0 < event.layer < NUM_LAYERS
        # The unwound step had admitted the long prompt: unless its chunk was suspended, it is
        # back in the queue with no KV, which is a recompute whatever the mode.
        applied = "suspend" if mode == "suspend" else "recompute"
        assert (event.victim_id, event.waiter_id, event.applied) == ("long", "urgent", applied)
        if mode == "suspend":
            # The long prompt went through every layer exactly once: the resumed pass began
            # at the layer the unwound one stopped at.
            assert event.wasted_tokens == 0
            assert tokens_per_layer[0] == tokens_per_layer[-1]
            assert len(engine.executor.runner.suspended) == 0
        else:
            # Paired probe: the unwound pass's layers below the stop were run twice.
            assert event.wasted_tokens == LONG_PROMPT
            assert tokens_per_layer[0] == tokens_per_layer[-1] + LONG_PROMPT
        assert long.num_preemptions == 1 and long.num_slo_preemptions == 1
        assert urgent.num_preemptions == 0
        # The urgent request's first token came sooner after its arrival than the long step
        # takes as a whole (measured in this run: the step that finally prefilled it), so
        # before that step could have finished had it not been stopped.
        assert urgent.first_token_time is not None and long.first_token_time is not None
        if check_timing:
            long_step_s = _duration_of_step_at(steps, long.first_token_time)
            assert urgent.first_token_time - urgent.arrival_time < long_step_s
            assert urgent.first_token_time < long.first_token_time
        _assert_equal_to_reference(
            model, prompts, {"long": long.output_token_ids, "urgent": urgent.output_token_ids},
            expected, engine_args.get("device", "cpu"))
        assert engine.scheduler.kv_cache_manager.num_free_blocks == 160
        pieces = engine.executor.runner.piecewise
        if pieces is not None:
            # With graphs on, the long step (400 tokens) was replayed as pieces and the vote
            # between two of them stopped it; steps ran as pieces and decodes as whole graphs.
            assert pieces.unwinds == 1 and pieces.replays > 0
            assert engine.executor.runner.graphs.replays > 0
    finally:
        engine.shutdown()


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
        assert len(engine.preemption.events) == 1
        computed_after_unwind.append(long.num_computed_tokens)
        (urgent,) = arrived
        engine.step()  # the urgent request's prefill; the victim is held back
        assert urgent.first_token_time is not None
        assert long.num_computed_tokens == 256  # probe: paused, not scheduled, not recomputed
        held_suspended = len(engine.executor.runner.suspended)
        _run(engine)
        (event,) = engine.preemption.events
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
        (event,) = engine.preemption.events
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
    signal = engine.preemption.signal
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
        (event,) = engine.preemption.events
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
            (event,) = engine.preemption.events
            assert event.layer == NUM_LAYERS - 1 and long.num_computed_tokens == 0
        else:
            assert not engine.preemption.events
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

    engine = _engine(model, preempt_policy="aggressive", slo_preempt_mode="pause")
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

        events = engine.preemption.events
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

    engine = _engine(model, preempt_policy="aggressive", slo_preempt_mode="suspend")
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

        events = engine.preemption.events
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
