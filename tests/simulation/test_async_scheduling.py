"""Async scheduling in the GPU-timed simulation: EngineCore queues a decode step on the
simulated device's stream while the one before it runs (engine/runtime/engine_core.py), and the
outputs are the serial loop's under every preemption mode, with stops seen a step late."""

from __future__ import annotations

import random

import msgspec
import pytest

from engine.config import build_engine_config
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import ScheduledRequest
from engine.runtime.engine_core import EngineCore
from engine.runtime.step_timing import StepTiming
from engine.sampling_params import SamplingParams
from tests.utils.gpu_timed import PROFILE, _burst, _engine, _replay


class AheadCounter:
    """A step observer: the decodes scheduled ahead of their input token, per request."""

    def __init__(self) -> None:
        self.ahead: dict[str, int] = {}

    def __call__(self, timing: StepTiming) -> None:
        if timing.scheduled is not None:
            for r in timing.scheduled.requests:
                if r.last_token_pending:
                    self.ahead[r.req_id] = self.ahead.get(r.req_id, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.ahead.values())


def _fast_engine(sim_model: str, async_scheduling: bool, **kwargs) -> EngineCore:
    """The simulated H100 without its eager-launch floor (decode steps of a few ms)."""
    engine = EngineCore(build_engine_config(sim_model, simulate=PROFILE, max_model_len=4096,
                                            startup_calibration=False,
                                            async_scheduling=async_scheduling, **kwargs))
    executor = engine.executor
    executor.profile = msgspec.structs.replace(executor.profile, floor_s=0.0)
    return engine


def _run(engine: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return {r.request_id: list(r.output_token_ids) for r in requests}


def _requests(stop_token_ids: dict[str, list[int]] | None = None) -> list[Request]:
    rng = random.Random(7)
    stops = stop_token_ids or {}
    return [Request(request_id=f"r{i}",
                    prompt_token_ids=[rng.randrange(5, 300) for _ in range(20 + 37 * i)],
                    sampling_params=SamplingParams(temperature=0, max_tokens=6 + 3 * i,
                                                   ignore_eos=True,
                                                   stop_token_ids=stops.get(f"r{i}", [])))
            for i in range(5)]


def test_async_outputs_equal_the_serial_loops_and_stops_land_a_step_late(sim_model):
    serial_engine = _fast_engine(sim_model, False)
    try:
        serial = _run(serial_engine, _requests())
    finally:
        serial_engine.shutdown()
    # r3 stops at its fourth token; the others run to max_tokens.
    stop = serial["r3"][3]
    assert stop not in serial["r3"][:3]
    expected = dict(serial, r3=serial["r3"][:4])
    outputs = {}
    for async_scheduling in (False, True):
        engine = _fast_engine(sim_model, async_scheduling)
        counter = AheadCounter()
        engine.step_observers.append(counter)
        try:
            requests = _requests({"r3": [stop]})
            outputs[async_scheduling] = _run(engine, requests)
            r3 = next(r for r in requests if r.request_id == "r3")
            assert r3.status is RequestStatus.FINISHED_STOPPED and r3.stop_reason == stop
            assert engine.scheduler.num_free_blocks == engine.model.num_blocks
        finally:
            engine.shutdown()
        # Probe: the async loop scheduled decodes ahead, r3's past its stop token (dropped);
        # the serial one none.
        if async_scheduling:
            assert counter.total > 0 and counter.ahead.get("r3", 0) >= 3
        else:
            assert counter.total == 0
    assert outputs[False] == outputs[True] == expected


def test_an_abort_while_a_step_is_in_flight_frees_everything(sim_model):
    engine = _fast_engine(sim_model, True)
    try:
        requests = _requests()
        for request in requests:
            engine.add_request(request)
        counter = AheadCounter()
        engine.step_observers.append(counter)
        for _ in range(100):
            engine.step()
            if counter.total:
                break
        # Probe: the step just submitted holds decodes scheduled ahead, and is in flight.
        assert counter.total > 0 and engine.schedules_ahead
        assert any(r.num_output_placeholders for r in requests)
        engine.abort_requests([r.request_id for r in requests])
        assert not engine.scheduler.has_unfinished_requests()
        assert engine.has_unfinished_requests()  # the step in flight is still to read back
        outputs = engine.step()
        assert outputs == [] and not engine.has_unfinished_requests()
        assert all(r.status is RequestStatus.FINISHED_ABORTED for r in requests)
        assert engine.scheduler.num_free_blocks == engine.model.num_blocks
        # The engine serves on after it, with the serial loop's outputs.
        after = _run(engine, _requests())
    finally:
        engine.shutdown()
    serial = _fast_engine(sim_model, False)
    try:
        assert after == _run(serial, _requests())
    finally:
        serial.shutdown()


class _OneStepAtATime:
    """An executor that cannot queue steps (as the TP workers' multiprocess executor)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_kv_blocks = inner.num_kv_blocks

    def execute_model(self, scheduler_output):
        return self.inner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_async_scheduling_falls_back_to_the_serial_loop_where_steps_cannot_be_queued(
        sim_model, caplog):
    donor = _fast_engine(sim_model, False)
    executor = _OneStepAtATime(donor.executor)
    config = build_engine_config(sim_model, simulate=PROFILE, max_model_len=4096,
                                 startup_calibration=False, async_scheduling=True)
    engine = EngineCore(config, executor=executor)
    counter = AheadCounter()
    engine.step_observers.append(counter)
    try:
        outputs = _run(engine, _requests())
    finally:
        engine.shutdown()
        donor.shutdown()
    assert "async scheduling is off" in caplog.text
    assert counter.total == 0 and all(len(tokens) > 0 for tokens in outputs.values())


def _simulated_greedy(engine: EngineCore, request: Request) -> list[int]:
    """What the simulated device samples for `request` alone, token by token."""
    tokens = list(request.prompt_token_ids)
    for _ in range(request.sampling_params.max_tokens):
        decode = ScheduledRequest(req_id=request.request_id, token_ids=[tokens[-1]],
                                  start_pos=len(tokens) - 1, block_ids=[], sample=True,
                                  sampling_params=request.sampling_params)
        tokens.append(engine.executor._next_token(decode))
    return tokens[len(request.prompt_token_ids):]


@pytest.mark.serial
@pytest.mark.parametrize("mode", ["suspend", "recompute"])
def test_async_outputs_are_the_same_whatever_the_preemptions(sim_model, mode):
    """Urgent turns during long prefills (tests/simulation/test_gpu_timed.py's burst), with
    async scheduling: the outputs the simulated device gives each request alone. Probes: steps
    were unwound, and decodes were scheduled ahead."""
    engine = _engine(sim_model, 40_000, slo_preempt_mode=mode, async_scheduling=True)
    counter = AheadCounter()
    engine.step_observers.append(counter)
    try:
        arrivals = _burst()
        _replay(engine, arrivals)
        assert engine.slo_preemption.events, "no step was unwound"
        assert counter.total > 0
        for _, request in arrivals:
            assert request.output_token_ids == _simulated_greedy(engine, request), \
                request.request_id
    finally:
        engine.shutdown()
