"""The DEBUG step log (engine/runtime/step_log.py): one line per step, what ran and how it
ended, and nothing at all at INFO."""

from __future__ import annotations

import logging

from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                          StepStatus)
from engine.runtime.step_log import describe_step, log_admitted, log_step
from engine.sampling_params import SamplingParams


def _chunk(req_id: str, tokens: int, start: int, resume: bool = False) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[7] * tokens, start_pos=start,
                            block_ids=[0], sample=False, sampling_params=SamplingParams(),
                            resume=resume)


def _step() -> SchedulerOutput:
    return SchedulerOutput(step_id=12, preemptible=True,
                           requests=[_chunk("doc", 2048, 4096, resume=True),
                                     _chunk("turn", 117, 0)])


def test_a_completed_step_names_its_chunks_and_time():
    line = describe_step(_step(), ModelRunnerOutput(step_id=12, execute_seconds=0.0413))
    assert line == "step 12 (preemptible) 41.3 ms ok: doc 2048@4096 resumed, turn 117@0"


def test_an_unwound_step_names_the_layer_it_stopped_before():
    out = ModelRunnerOutput(step_id=12, status=StepStatus.SLO_PREEMPTED,
                            slo_preempted_layer=9, execute_seconds=0.2)
    assert describe_step(_step(), out).startswith(
        "step 12 (preemptible) 200.0 ms stopped before layer 9: doc 2048@4096")


def test_logged_at_debug_only(caplog):
    out = ModelRunnerOutput(step_id=12, execute_seconds=0.01)
    with caplog.at_level(logging.INFO, logger="engine.runtime.step_log"):
        log_step(_step(), out)
        log_admitted("turn", 117, 549.0, 0.002)
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="engine.runtime.step_log"):
        log_step(_step(), out)
        log_admitted("turn", 117, 549.0, 0.002)
        log_admitted("batch", 4000, None, 0.0)
    assert [r.getMessage() for r in caplog.records] == [
        "step 12 (preemptible) 10.0 ms ok: doc 2048@4096 resumed, turn 117@0",
        "request turn: 117 prompt tokens, TTFT objective 549 ms, handed over 2.0 ms after its "
        "arrival",
        "request batch: 4000 prompt tokens, TTFT objective none, handed over 0.0 ms after its "
        "arrival"]
