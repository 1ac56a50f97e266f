"""A step the model runner launched, and reading it back (``ModelRunner.launch``).

On a GPU nothing between a step's launch and its ``LaunchedStep.result()`` waits for the device:
the sampled ids come back through pinned memory behind an event (workers.host_transfer), and
the step is timed by CUDA events, so the host can schedule and launch the next step meanwhile
(async scheduling). What a step leaves for the next is its sampled ids on the device
(``StepSamples``): a decode scheduled ahead of its last token takes it from there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.core.scheduler_output import ModelRunnerOutput, ScheduledRequest
from engine.outputs import error_line
from workers.sample.sampler import PendingSample, SamplerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepSamples:
    """The ids a step sampled, on the device: row ``row_of[req_id]`` of ``tokens``."""

    row_of: dict[str, int]
    tokens: torch.Tensor


def sample_rows(previous: StepSamples | None, requests: list[ScheduledRequest]) -> list[int]:
    """The row of ``previous.tokens`` that feeds each decode scheduled ahead. A decode whose
    token the previous step did not sample would read someone else's (or nothing): the
    scheduler's bug, which fails the step."""
    rows: list[int] = []
    for r in requests:
        row = previous.row_of.get(r.req_id) if previous is not None else None
        if row is None:
            raise ValueError(f"request {r.req_id} was scheduled ahead of its last token "
                             f"(last_token_pending), but the step before sampled no token "
                             f"for it")
        rows.append(row)
    return rows


class StepTimer:
    """A step's time for the TTFT predictor, with no wait for the device while it launches: on
    a GPU from an event recorded as the step is launched to one recorded after its last work
    (the device's time for it, including any wait for the host to queue it), elsewhere the
    launch's own wall time (a CPU computes the step as it launches it)."""

    def __init__(self, device: torch.device) -> None:
        self.started = time.perf_counter()
        self._stream = (torch.cuda.current_stream(device) if device.type == "cuda" else None)
        self._start: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None
        self._seconds = 0.0
        if self._stream is not None:
            self._start = _timing_event()
            self._start.record(self._stream)

    def launched(self) -> None:
        """The step's last work is queued."""
        if self._stream is not None:
            self._end = _timing_event()
            self._end.record(self._stream)
        else:
            self._seconds = time.perf_counter() - self.started

    def seconds(self) -> float:
        """Waits for the step's end on the device, then its time."""
        if self._start is None or self._end is None:
            return self._seconds
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0


def _timing_event() -> torch.cuda.Event:
    # Blocking: the waiting thread sleeps rather than spinning a core (workers.preemption.run_ahead).
    return torch.cuda.Event(enable_timing=True, blocking=True)


class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``); ``result()`` waits for it."""

    def __init__(self, output: ModelRunnerOutput, sampled: list[ScheduledRequest] | None = None,
                 sample: PendingSample | None = None, timer: StepTimer | None = None) -> None:
        # Complete but for the samples and the time where ``timer`` is set; else already done
        # (a step with nothing to compute, or one the vote unwound).
        self._output = output
        self._sampled = sampled or []
        self._sample = sample
        self._timer = timer

    def result(self) -> ModelRunnerOutput:
        """The step's output, once the device has finished it; called once."""
        output = self._output
        if self._sample is not None:
            _record_samples(self._sample.finish(), self._sampled, output)
            self._sample = None
        if self._timer is not None:
            output.execute_seconds = self._timer.seconds()
            self._timer = None
        return output


def _record_samples(result: SamplerOutput, requests: list[ScheduledRequest],
                    output: ModelRunnerOutput) -> None:
    """Tokens (and logprobs) for the requests that could be sampled, and an error for each that
    could not."""
    sampled: dict[str, int] = {}
    failed: dict[str, str] = {}
    output.sampled_token_ids, output.failed = sampled, failed
    output.logprobs = {requests[row].req_id: lp for row, lp in result.logprobs.items()}
    for row, (req, token) in enumerate(zip(requests, result.token_ids)):
        if token is not None:
            sampled[req.req_id] = token
            continue
        exc = result.errors[row]
        logger.error("request %s: sampling failed; the request is finished with an error",
                     req.req_id, exc_info=exc)
        # The client sees this line, never the traceback (which is in the log above).
        failed[req.req_id] = f"sampling failed: {error_line(exc)}"
