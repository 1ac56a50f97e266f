"""A step, one line at DEBUG (`SLOSERVE_LOG_LEVEL=DEBUG` or `serve --log-level debug`): what it
ran, how long the workers took, and how it ended. With the monitor's decisions (monitor.monitor,
at DEBUG too) it is how a missed deadline is read back from a server's log: which steps the
request waited behind, and whether a stop was decided for it."""

from __future__ import annotations

import logging

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus

logger = logging.getLogger(__name__)


def describe_step(output: SchedulerOutput, runner_output: ModelRunnerOutput) -> str:
    """`step 12 (preemptible) 41.3 ms ok: req-a 2048@0, req-b 1@131 resumed` — each chunk as
    tokens@first position; an unwound step with the layer it stopped before."""
    chunks = ", ".join(f"{r.req_id} {len(r.token_ids)}@{r.start_pos}"
                       + (" resumed" if r.resume else "") for r in output.requests)
    if runner_output.status is StepStatus.SLO_PREEMPTED:
        outcome = f"stopped before layer {runner_output.slo_preempted_layer}"
    else:
        outcome = runner_output.status.name.lower()
    kind = " (preemptible)" if output.preemptible else ""
    return (f"step {output.step_id}{kind} {1000 * runner_output.execute_seconds:.1f} ms "
            f"{outcome}: {chunks}")


def log_step(output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(describe_step(output, runner_output))


def log_admitted(request_id: str, prompt_tokens: int, ttft_slo_ms: float | None,
                 waited_s: float) -> None:
    """A request the engine took in (the hand-over from the API server `waited_s` after its
    arrival was stamped)."""
    if logger.isEnabledFor(logging.DEBUG):
        objective = "none" if ttft_slo_ms is None else f"{ttft_slo_ms:.0f} ms"
        logger.debug("request %s: %d prompt tokens, TTFT objective %s, handed over %.1f ms "
                     "after its arrival", request_id, prompt_tokens, objective,
                     1000 * waited_s)
