"""torch.profiler over a few steady-state engine steps, summarized per step kind
(benchmark.py `--profile`).

A window of steps is profiled, never a whole `generate`: the profiler starts once the engine has
run one step of the wanted kind (a whole-budget prefill, or a decode step of the full batch),
then records one warm-up step (the profiler's own first-step costs), the measured steps, and
the start of one more step (the last measured step's end: a step runs from its start to the next
one's, as the table's TPOT does). Every engine step is wrapped in a `record_function` marker
named after its index in the step log, which places it on the profiler's clock.

Per step kind (the figures are per step, over the measured steps):
- ops per step: CUDA kernel events on a GPU (memcpy and memset counted apart, and the host's
  launch calls beside them: a CUDA graph is one launch for many kernels); on the CPU there is no
  kernel event, so the torch ops dispatched (aten::, mkldnn:: ..., nested ones included) are
  counted instead;
- GPU busy: the union of the device's kernel, memcpy and memset intervals within the step,
  against the step's profiled wall time and against the timed (unprofiled) step of the table;
  unavailable on the CPU (no device timeline);
- the top kernels by device time (on the CPU: torch ops by self CPU time), with their share;
- the top host functions by self CPU time (cudaLaunchKernel, cudaEventSynchronize, ... and torch
  ops' own dispatch), with their share of the wall time; "python outside ops" is the engine
  step's time in no recorded op (scheduling, input preparation, bookkeeping; the LLM's output
  processing between steps is in the wall time, not in that figure).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

MARK = "sloserve.step#"
MARK_END = "sloserve.window_end"
PYTHON_OUTSIDE_OPS = "python outside ops (engine.step)"
# Host calls that launch device work: a graph replay is one call for all of its kernels.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                          "cuLaunchKernelEx", "cudaGraphLaunch", "cuGraphLaunch",
                          "hipLaunchKernel", "hipGraphLaunch"})
TOP = 10


@dataclass(frozen=True)
class Event:
    """One profiler event on the profiler's clock (microseconds). kind: "marker" (a step's
    record_function), "cpu" (an op or runtime call on the host) or "device" (a kernel, memcpy
    or memset on the device timeline)."""

    name: str
    kind: str
    start_us: float
    end_us: float
    self_us: float = 0.0


def events_from_profiler(function_events: Iterable[Any]) -> list[Event]:
    """torch.profiler's FunctionEvents as Events. Device-side copies of record_function ranges
    (kineto's GPU user annotations) are not device work and are dropped."""
    from torch.autograd import DeviceType

    out = []
    for fe in function_events:
        name, start, end = fe.name, fe.time_range.start, fe.time_range.end
        if fe.device_type == DeviceType.CPU:
            if name.startswith(MARK) or name == MARK_END:
                out.append(Event(name, "marker", start, end, fe.self_cpu_time_total))
            elif not fe.is_async:
                out.append(Event(name, "cpu", start, end, fe.self_cpu_time_total))
        elif not (getattr(fe, "is_user_annotation", False) or name.startswith(MARK)
                  or name == MARK_END):
            out.append(Event(name, "device", start, end))
    return out


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def summarize_steps(events: list[Event], step_indices: list[int], on_gpu: bool,
                    timed_step_ms: float | None = None) -> dict[str, Any]:
    """Per-step figures over the steps with these indices in the step log. Each step runs from
    its marker's start to the next marker's start (or the window's end marker); the device and
    host events starting in that interval are the step's."""
    starts = sorted((e.start_us, e.name) for e in events if e.kind == "marker")
    bounds: dict[int, tuple[float, float]] = {}
    for (start, name), (next_start, _) in zip(starts, starts[1:]):
        if name.startswith(MARK):
            bounds[int(name[len(MARK):])] = (start, next_start)
    missing = [i for i in step_indices if i not in bounds]
    if missing or not step_indices:
        raise ValueError(f"steps {missing or step_indices} have no complete marked interval in "
                         f"the profile (markers seen: {[n for _, n in starts]})")
    device = sorted((e for e in events if e.kind == "device"), key=lambda e: e.start_us)
    host = [e for e in events if e.kind != "device"]

    per_step: list[dict[str, Any]] = []
    by_op: dict[str, list[float]] = {}  # name -> [total us, calls]
    by_host: dict[str, list[float]] = {}
    for index in step_indices:
        lo, hi = bounds[index]
        mine_device = [e for e in device if lo <= e.start_us < hi]
        mine_host = [e for e in host if lo <= e.start_us < hi]
        kernels = [e for e in mine_device if not _is_copy(e.name)]
        record: dict[str, Any] = {"index": index, "wall_us": hi - lo}
        if on_gpu:
            record["ops"] = len(kernels)
            record["copies"] = len(mine_device) - len(kernels)
            record["launch_calls"] = sum(e.name in LAUNCH_CALLS for e in mine_host)
            # Clipped to the step: a kernel still running at the next step's start is busy
            # time of both, counted once in each.
            record["busy_us"] = _union_us([(max(e.start_us, lo), min(e.end_us, hi))
                                           for e in mine_device])
            for e in mine_device:
                entry = by_op.setdefault(e.name, [0.0, 0])
                entry[0] += e.end_us - e.start_us
                entry[1] += 1
        else:
            # Ops are namespaced (aten::mm, mkldnn::_linear_pointwise); runtime calls are not.
            ops = [e for e in mine_host if e.kind == "cpu" and "::" in e.name]
            record["ops"] = len(ops)
            for e in ops:
                entry = by_op.setdefault(e.name, [0.0, 0])
                entry[0] += e.self_us
                entry[1] += 1
        for e in mine_host:
            if e.kind == "marker" and not e.name.startswith(MARK):
                continue
            name = PYTHON_OUTSIDE_OPS if e.kind == "marker" else e.name
            entry = by_host.setdefault(name, [0.0, 0])
            entry[0] += e.self_us
            entry[1] += 1
        per_step.append(record)

    n = len(per_step)
    wall_us = sum(r["wall_us"] for r in per_step)
    op_total = sum(total for total, _ in by_op.values()) or 1.0
    summary: dict[str, Any] = {
        "steps": n, "step_indices": list(step_indices),
        "ops_counted": ("CUDA kernel events" if on_gpu else
                        "torch ops dispatched (aten::, mkldnn:: ...), nested ones included "
                        "(CPU: no kernel events)"),
        "ops_per_step": round(statistics.median(r["ops"] for r in per_step)),
        "ops_each_step": [r["ops"] for r in per_step],
        "wall_ms_per_step": wall_us / n / 1000,
        "timed_step_ms": timed_step_ms,
        "top_ops_by": ("device time (kernels, memcpy, memset)" if on_gpu
                       else "self CPU time of torch ops"),
        "top_ops": [{"name": name, "ms_per_step": total / n / 1000, "calls_per_step": calls / n,
                     "share_pct": 100 * total / op_total}
                    for name, (total, calls) in sorted(by_op.items(), key=lambda kv: -kv[1][0])
                    [:TOP]],
        "top_host": [{"name": name, "self_ms_per_step": total / n / 1000,
                      "calls_per_step": calls / n, "pct_of_wall": 100 * total / wall_us}
                     for name, (total, calls) in sorted(by_host.items(),
                                                         key=lambda kv: -kv[1][0])[:TOP]]}
    if on_gpu:
        busy_us = sum(r["busy_us"] for r in per_step)
        summary.update({
            "copies_per_step": round(statistics.median(r["copies"] for r in per_step)),
            "launch_calls_per_step": round(statistics.median(r["launch_calls"]
                                                             for r in per_step)),
            "busy_ms_per_step": busy_us / n / 1000,
            "busy_pct": 100 * busy_us / wall_us if wall_us > 0 else None,
            "busy_pct_of_timed_step": (100 * busy_us / n / 1000 / timed_step_ms
                                       if timed_step_ms else None)})
    else:
        summary.update({"copies_per_step": None, "launch_calls_per_step": None,
                        "busy_ms_per_step": None, "busy_pct": None,
                        "busy_pct_of_timed_step": None,
                        "busy_unavailable": "the CPU has no device timeline"})
    return summary


# ---------------------------------------------------------------------------------------------
# Driving the engine


class StepWindow:
    """Wraps `llm.engine.step` in a profiler marker (a step observer runs after the step, too
    late to open one) and profiles one window of steps per `run`; the step log
    (engine.benchmarks.measure.step_log.record_steps) says what each step ran."""

    def __init__(self, llm: Any, steps_log: list[dict], device: torch.device) -> None:
        self.engine, self.steps_log, self.device = llm.engine, steps_log, device
        self._inner = self.engine.step
        self.engine.step = self._step
        self._prof: Any = None
        self._wanted: Callable[[dict], bool] = lambda _: False
        self._waiting = False
        self._left = 0
        self.recorded: list[int] = []  # step-log indices of the steps in the window

    def restore(self) -> None:
        self.engine.step = self._inner

    def _activities(self) -> list[Any]:
        from torch.profiler import ProfilerActivity

        acts = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        return acts

    def _step(self) -> Any:
        from torch.profiler import record_function

        if self._prof is not None and self._left == 0:
            # The window's end: the last recorded step ends where this one starts.
            with record_function(MARK_END):
                pass
            self._stop()
        index = len(self.steps_log)
        with record_function(f"{MARK}{index}"):
            out = self._inner()
        if self._prof is not None:
            self.recorded.append(index)
            self._left -= 1
        elif self._waiting and self.steps_log and self._wanted(self.steps_log[-1]):
            # One step of the kind has run unprofiled: the next ones are the steady state.
            self._waiting = False
            self._prof = torch.profiler.profile(activities=self._activities())
            self._prof.start()
        return out

    def _stop(self) -> None:
        if self._prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._prof.stop()
            self._finished, self._prof = self._prof, None

    def run(self, generate: Callable[[], Any], wanted: Callable[[dict], bool], steps: int,
            timed_step_ms: float | None) -> dict[str, Any]:
        """Profile one warm-up step and `steps` steps of the kind `wanted` picks, once one of
        them has run; `generate` must run at least steps + 3 of them."""
        self._wanted, self._waiting, self._left = wanted, True, 1 + steps
        self.recorded, self._finished = [], None
        try:
            generate()
        finally:
            self._waiting = False
            cut_short = self._prof is not None
            self._stop()  # a generate that ended inside the window
        if self._finished is None:
            raise RuntimeError("the profile window never opened: no step of the wanted kind")
        events = events_from_profiler(self._finished.events())
        # Cut short, the last recorded step has no end (no next step started in the window).
        complete = self.recorded[:-1] if cut_short else self.recorded
        measured = [i for i in complete[1:] if wanted(self.steps_log[i])]
        if not measured:
            raise RuntimeError(f"no step of the wanted kind after the warm-up step among the "
                               f"{len(self.recorded)} profiled")
        summary = summarize_steps(events, measured, self.device.type == "cuda", timed_step_ms)
        # What each measured step ran, from the step log: the probe that the kind is right.
        summary["scheduled"] = [{"requests": len(self.steps_log[i]["requests"]),
                                 "tokens": sum(n for _, n in self.steps_log[i]["requests"])}
                                for i in measured]
        return summary


# ---------------------------------------------------------------------------------------------
# Markdown


def _name(text: str, width: int = 60) -> str:
    text = text.removeprefix("void ").replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(profile: dict[str, Any]) -> list[str]:
    """The profile section (lines), after the throughput table."""
    kinds = profile["kinds"]
    on_gpu = profile["device"] == "cuda"
    ops = "kernels" if on_gpu else "torch ops"
    lines = ["", "#### Engine profile (torch.profiler)", "",
             f"{profile['steps']} steady-state steps of each kind, profiled after the timed runs "
             f"(profiling slows the host: the table's step times are the measurement, the "
             f"profiled wall time is the base of the busy and host shares). " + (
                 "Kernels: CUDA kernel events per step; launch calls: the host's "
                 "kernel and graph launches. GPU busy: the union of kernel, memcpy and memset "
                 "intervals on the device timeline, against the profiled step and against the "
                 "timed step (prefill: median step; decode: TPOT)." if on_gpu else
                 "On the CPU there are no kernel events: the count is of torch ops dispatched "
                 "(aten::, mkldnn:: ..., nested ones included); GPU busy is unavailable (no "
                 "device timeline)."), "",
             f"| step | steps | {ops}/step | launch calls/step | wall ms/step (profiled) "
             f"| GPU busy ms/step | busy % of wall | busy % of timed step |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for label, k in kinds.items():
        if "error" in k:
            lines.append(f"| {label} | not profiled: {k['error']} | | | | | | |")
            continue
        lines.append(f"| {label} | {k['steps']} | {k['ops_per_step']:,} "
                     f"| {_num(k['launch_calls_per_step'], 0)} | {_num(k['wall_ms_per_step'], 2)} "
                     f"| {_num(k['busy_ms_per_step'], 2)} | {_num(k['busy_pct'])} "
                     f"| {_num(k['busy_pct_of_timed_step'])} |")
    if profile.get("skipped"):
        lines += ["", f"Not profiled: {profile['skipped']}"]
    for label, k in kinds.items():
        if "error" in k:
            continue
        top_ops, top_host = k["top_ops"], k["top_host"]
        lines += ["", f"**{label}**: top {ops} by {k['top_ops_by']}; top host functions by "
                      f"self CPU time.", "",
                  f"| # | {ops[:-1]} | ms/step | calls/step | share % | host function "
                  f"| self ms/step | % of wall |", "|--:|---|--:|--:|--:|---|--:|--:|"]
        for i in range(max(len(top_ops), len(top_host))):
            a = top_ops[i] if i < len(top_ops) else None
            b = top_host[i] if i < len(top_host) else None
            lines.append(
                f"| {i + 1} | {_name(a['name']) if a else ''} "
                f"| {_num(a and a['ms_per_step'], 3)} | {_num(a and a['calls_per_step'])} "
                f"| {_num(a and a['share_pct'])} | {_name(b['name']) if b else ''} "
                f"| {_num(b and b['self_ms_per_step'], 3)} | {_num(b and b['pct_of_wall'])} |")
    return lines
