"""Feeding the engine's step-time predictor (monitor.predictor.StepTimePredictor, which EngineCore
owns) from the engine's steps (docs/design.md section 5): completed steps, a step that resumed
suspended passes counted by the layers its chunks really ran.

An unwound step is not observed. Its time is the layers it ran and then the unwind: on a GPU
the layers already queued when the vote stopped the host, then the host's rollback (some 15 ms
on an H100), neither of which any step the scheduler plans contains. As a point it read as a
step twice as slow as predicted: one such step made the simulated H100's predictor's error
margin 109% (from 5%), and the margin shrinks every deadline cap and widens every stop test."""

from __future__ import annotations

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from monitor.predictor import StepTimePredictor


def layers_run(output: SchedulerOutput, runner_output: ModelRunnerOutput,
               num_layers: int) -> dict[str, tuple[int, int]] | None:
    """req_id -> the layers [start, end) its chunk ran, for a completed step: a chunk resuming
    a suspended pass from the layer it joined at. Chunks that ran every layer are left out
    (SchedulerOutput.step_point's default): a step without resumed chunks, most steps, is {}.
    None when a resumed chunk's layer is unknown (an executor that does not report it): such a
    step says nothing reliable."""
    layers: dict[str, tuple[int, int]] = {}
    for request in output.requests:
        if not request.resume:
            continue
        joined = runner_output.resumed_layers.get(request.req_id)
        if joined is None:
            return None
        if joined != 0:
            layers[request.req_id] = (joined, num_layers)
    return layers


def observe_step(predictor: StepTimePredictor, output: SchedulerOutput,
                 runner_output: ModelRunnerOutput, num_layers: int) -> None:
    """One completed step, timed by the workers (execute_seconds); any other is not a point
    (see above)."""
    if runner_output.status is not StepStatus.OK:
        return
    layers = layers_run(output, runner_output, num_layers)
    if layers is None:
        return
    point = output.step_point(runner_output.execute_seconds, num_layers, layers)
    if point is not None:
        predictor.observe_point(point)
