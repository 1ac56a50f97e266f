"""`sloserve bench run --simulate PROFILE --time-scale K`: a simulated run in slow motion.

The simulated GPUs cost no CPU, but everything around them does: the client, the HTTP server,
the tokenizer, and in a fleet Ray Serve's proxy, the ingress and every replica, all on this
machine's cores. A burst of requests carrying 8k-token prompts through four replicas on two
cores delays first tokens by 40-100 ms that a deployment (a host per GPU) never sees, against
objectives of 150-300 ms. Slowed down K times, every step of the profile takes K times as long
and the trace arrives K times slower with K times the objectives, so the engines see the same
run in their own time while the host's fixed costs weigh 1/K as much. Every figure is reported
back in the profile's time (divided by K): the client still times each request, and the
servers' own TTFTs are restored beside them.

The engines get a slowed copy of the profile (a profile file of their own, written into the
run's folder) and of the TTFT line that seeds their predictor; the trace and its SLOs are built
in the profile's time first, so a slowed run replays exactly the requests an unslowed one does.
A fleet's replicas report K times less often (engine/benchmarks/fleet/fleet_run.py): the router
sees the replicas as fresh as it would at full speed, not fresher.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import msgspec

from engine.benchmarks.attainment.results import RequestResult, RunResult
from engine.benchmarks.attainment.traces import Trace, TraceRequest
from engine.simulation.profile import StepTimeProfile
from monitor.step_time_model import StepTimeModel

# The durations of a profile: every one runs K times as long.
_PROFILE_SECONDS = ("seconds_per_token", "seconds_per_attention", "seconds_per_decode_context",
                    "intercept_s", "floor_s", "unwind_s", "seconds_per_expert")
# The coefficients of a TTFT line (seconds per unit of a feature, or seconds).
_LINE_SECONDS = ("seconds_per_token", "intercept_s", "seconds_per_token_sq",
                 "seconds_per_decode_context", "floor_s", "edge_seconds_per_token",
                 "edge_seconds_per_token_sq", "edge_seconds_per_decode_context")
# A request's times: seconds, and objectives and slack in milliseconds.
_REQUEST_SECONDS = ("arrival_s", "ttft_s", "e2e_s", "tpot_s", "server_ttft_s",
                    "max_stream_gap_s")
_REQUEST_MS = ("ttft_slo_ms", "tpot_slo_ms", "slack_at_admission_ms",
               "rejected_predicted_ttft_ms", "routed_predicted_ttft_ms")


def check_time_scale(scale: float) -> float:
    if not 1.0 <= scale < math.inf:  # NaN fails both
        raise ValueError(f"--time-scale must be a finite number >= 1, got {scale}")
    return scale


def slowed_profile(profile: StepTimeProfile, scale: float) -> StepTimeProfile:
    """The profile with every duration `scale` times as long."""
    return msgspec.structs.replace(
        profile, name=f"{profile.name} x{scale:g} slower",
        description=f"{profile.description} (every duration x{scale:g}: --time-scale)".strip(),
        **{name: getattr(profile, name) * scale for name in _PROFILE_SECONDS})


def slowed_line(line: StepTimeModel, scale: float) -> StepTimeModel:
    """The TTFT line of the slowed profile: each coefficient `scale` times as large (its
    relative error and calibrated ranges are the same)."""
    return dataclasses.replace(line, **{name: None if getattr(line, name) is None
                                        else getattr(line, name) * scale
                                        for name in _LINE_SECONDS})


def write_slowed(profile: StepTimeProfile, line: StepTimeModel, scale: float,
                 folder: Path) -> tuple[str, str]:
    """Writes the slowed profile and line into `folder`: the `simulate` and `ttft_model` the
    engines are started with."""
    folder.mkdir(parents=True, exist_ok=True)
    profile_path = folder / f"profile-x{scale:g}.json"
    profile_path.write_bytes(msgspec.json.encode(slowed_profile(profile, scale)))
    line_path = folder / f"ttft_model-x{scale:g}.json"
    slowed_line(line, scale).save(line_path)
    return str(profile_path), str(line_path)


def slowed_trace(trace: Trace, scale: float) -> Trace:
    """The trace arriving `scale` times slower, with `scale` times its objectives; its meta
    (rate included) stays in the profile's time, as the results are reported."""
    if scale == 1.0:
        return trace
    requests = [dataclasses.replace(
        r, arrival_s=r.arrival_s * scale,
        ttft_slo_ms=None if r.ttft_slo_ms is None else r.ttft_slo_ms * scale,
        tpot_slo_ms=None if r.tpot_slo_ms is None else r.tpot_slo_ms * scale)
        for r in trace.requests]
    return Trace(requests, meta=copy.deepcopy(trace.meta))


def restored_run(run: RunResult, trace: Trace, scale: float) -> RunResult:
    """A run of `slowed_trace(trace, scale)` in the profile's time: every duration divided by
    `scale`, and each request's arrival and objectives exactly the unslowed trace's."""
    if scale == 1.0:
        return run
    originals = {r.request_id: r for r in trace.requests}
    requests = [_restored_request(r, originals.get(r.request_id), scale) for r in run.requests]
    return dataclasses.replace(run, duration_s=run.duration_s / scale, requests=requests,
                               meta={**run.meta, "time_scale": scale})


def _restored_request(result: RequestResult, original: TraceRequest | None,
                      scale: float) -> RequestResult:
    changes = {name: getattr(result, name) / scale
               for name in (*_REQUEST_SECONDS, *_REQUEST_MS) if getattr(result, name) is not None}
    if original is not None:
        changes.update(arrival_s=original.arrival_s, ttft_slo_ms=original.ttft_slo_ms,
                       tpot_slo_ms=original.tpot_slo_ms)
    return dataclasses.replace(result, **changes)
