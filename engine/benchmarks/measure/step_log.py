"""A log of the engine's steps, kept through `EngineCore.step_observers`
(engine/runtime/step_timing.py): what the throughput benchmarks time their figures from.

Each entry is a dict, `{"start", "end", "requests"}` (perf_counter seconds; each scheduled
request's `(start_pos, new tokens)`), so that the step kinds can be picked out afterwards: a
decode-only step is one whose every request runs one token. The observer holds the log alone,
never the engine, so dropping the last reference to the LLM still frees it at once.
"""

from __future__ import annotations

import statistics
from typing import Any

from engine.runtime.step_timing import StepTiming


def record_steps(llm: Any) -> list[dict]:
    """Every engine step of `llm` from now on, appended to the returned list as it returns
    (clear the list to start a new measurement)."""
    steps: list[dict] = []

    def observe(timing: StepTiming) -> None:
        steps.append({"start": timing.started, "end": timing.ended,
                      "requests": list(timing.requests)})

    llm.engine.step_observers.append(observe)
    return steps


def record_step_times(llm: Any) -> list[tuple[float, float]]:
    """(wall time of the step's forward pass, `executor.execute_model`; rank 0's transport time)
    for every step of `llm` from now on that ran one."""
    times: list[tuple[float, float]] = []

    def observe(timing: StepTiming) -> None:
        if timing.scheduled is not None:
            times.append((timing.execute_seconds, timing.transport_seconds))

    llm.engine.step_observers.append(observe)
    return times


def step_gaps(steps: list[dict], indices: list[int]) -> list[float]:
    """Seconds from each listed step's start to the next step's (its own end when last), so the
    output processing between steps counts."""
    return [(steps[i + 1]["start"] if i + 1 < len(steps) else steps[i]["end"])
            - steps[i]["start"] for i in indices]


def decode_seconds_per_step(steps: list[dict], batch: int) -> tuple[float, list[int], int]:
    """Median engine time per full-batch decode step, start to next start (so the output
    processing between steps counts), the contexts of those steps, and how many there were."""
    decode = [i for i, s in enumerate(steps)
              if len(s["requests"]) == batch and all(n == 1 for _, n in s["requests"])]
    gaps = step_gaps(steps, decode)
    contexts = [p + 1 for i in decode for p, _ in steps[i]["requests"]]
    mean_ctx = round(sum(contexts) / len(contexts)) if contexts else 0
    return (statistics.median(gaps) if gaps else float("nan")), [mean_ctx] * batch, len(decode)
