"""Feeding the engine's step-time predictor (monitor.predictor.StepTimePredictor, which EngineCore
owns) from the engine's steps (docs/design.md section 5): completed steps, steps that resumed
suspended passes, and unwound steps, each counted by the layers its chunks really ran."""

from __future__ import annotations

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from monitor.predictor import StepTimePredictor


def layers_run(output: SchedulerOutput, runner_output: ModelRunnerOutput,
               num_layers: int) -> dict[str, tuple[int, int]] | None:
    """req_id -> the layers [start, end) its chunk ran: a chunk resuming a suspended pass from
    the layer it joined at, and every chunk of an unwound step up to the layer it stopped before
    (a resuming chunk the stop came before ran none). Chunks that ran every layer are left out
    (SchedulerOutput.step_point's default): a completed step without resumed chunks, most
    steps, is {}. None when a resumed chunk's layer is unknown (an executor that does not
    report it): such a step says nothing reliable."""
    end = num_layers
    if runner_output.status is StepStatus.SLO_PREEMPTED:
        end = runner_output.slo_preempted_layer or 0
    layers: dict[str, tuple[int, int]] = {}
    if end == num_layers and not any(request.resume for request in output.requests):
        return layers
    for request in output.requests:
        start = 0
        if request.resume:
            joined = runner_output.resumed_layers.get(request.req_id)
            if joined is None:
                return None
            start = joined
        if (start, end) != (0, num_layers):
            layers[request.req_id] = (start, max(start, end))
    return layers


def observe_step(predictor: StepTimePredictor, output: SchedulerOutput,
                 runner_output: ModelRunnerOutput, num_layers: int) -> None:
    """One step that completed or was unwound, timed by the workers (execute_seconds)."""
    layers = layers_run(output, runner_output, num_layers)
    if layers is None:
        return
    point = output.step_point(runner_output.execute_seconds, num_layers, layers)
    if point is not None:
        predictor.observe_point(point)
