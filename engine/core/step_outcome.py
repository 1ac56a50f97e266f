"""Reading a completed step's output (`Scheduler.update_from_output` commits it): which of the
step's requests it still concerns, and whether a request that got a token is done."""

from __future__ import annotations

from collections.abc import Callable

from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                          StepStatus)


def live_requests(scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                  is_running: Callable[[str], bool]) -> list[ScheduledRequest]:
    """The step's scheduled requests still running (aborted or preempted ones since
    ``schedule()`` are skipped), in scheduling order. Raises ValueError, changing nothing, if
    the output is not a completed run of this step or lacks a token one of them must get."""
    if runner_output.step_id != scheduler_output.step_id:
        raise ValueError(
            f"runner output is for step {runner_output.step_id}, scheduler output for step "
            f"{scheduler_output.step_id}"
        )
    if runner_output.status is not StepStatus.OK:
        raise ValueError(
            f"step {runner_output.step_id} did not complete ({runner_output.status.value}: "
            f"{runner_output.error}); roll it back instead of committing it"
        )
    live = [sr for sr in scheduler_output.requests if is_running(sr.req_id)]
    failed = runner_output.failed
    missing = [sr.req_id for sr in live if sr.sample
               and sr.req_id not in runner_output.sampled_token_ids and sr.req_id not in failed]
    if missing:
        raise ValueError(f"step {runner_output.step_id}: no sampled token for requests {missing}")
    return live


def stop_status(request: Request, max_model_len: int) -> RequestStatus | None:
    """How a request that just got a token finishes (a stop token is kept as its
    ``stop_reason``), or None if it goes on."""
    token = request.output_token_ids[-1]
    params = request.sampling_params
    if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= (request.max_model_len or max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None
