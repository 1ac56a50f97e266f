"""Busy neighbours: N processes that each keep one core busy while a benchmark runs beside them,
as a user's machine has them (another service's workers, a log shipper on the same cores).

    with busy_neighbours(2, limit_s=600) as load:
        ...  # start the server, replay the trace
    load.report  # BusyReport: the CPU seconds they consumed, the machine's load meanwhile

Each neighbour is its own Python process running a plain spin loop (no I/O, no threads, the
same scheduling priority as everything else). It ends by itself after `limit_s` and as soon as
its parent is gone (it polls its parent pid), so a crashed or killed benchmark leaves nothing
spinning for longer than one run's bound; on a normal exit the context kills and reaps every
one of them.

The report is the probe that the load really happened: the neighbours' own CPU seconds (from
the kernel's accounting of each reaped child, `wait4`), against the wall time they were meant
to run, and the whole machine's CPU use and load average over the same window. A neighbour
that ended before the context did (its time bound too short for the run) is counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import psutil

# The loop each neighbour runs: pure CPU, checking the clock and its parent once every 2**16
# turns (a few milliseconds), so the checks cost nothing against the spinning. `-S` skips site
# imports: a neighbour spins within ~20 ms of its start.
_SPIN = """
import os, time
limit, parent = float({limit_s!r}), {parent}
end = time.monotonic() + limit
x = 0
while True:
    for _ in range(65536):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    if time.monotonic() > end or os.getppid() != parent:
        break
"""


@dataclass
class BusyReport:
    """What N busy neighbours did over one window (JSON-ready with `as_dict`)."""

    processes: int
    wall_s: float  # from the context's entry (the neighbours' start) to its exit
    cpu_s: float  # user + system seconds the neighbours consumed, all of them together
    # cpu_s / (wall_s x processes): about 1 when each had a core to itself; less when they
    # shared cores with the benchmark (as they should on a busy machine) or ended early.
    cpu_share: float | None
    ended_early: int  # neighbours whose time bound ran out before the context exited
    machine_cpu_percent: float  # the whole machine's CPU use over the window (all cores, 0-100)
    load_avg_1m_start: float
    load_avg_1m_end: float
    cpu_count: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BusyLoad:
    """The running neighbours; `report` is set once the context has exited."""

    def __init__(self, processes: list[subprocess.Popen], started: float) -> None:
        self.processes = processes
        self.started = started
        self.report: BusyReport | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


def _reap(proc: subprocess.Popen) -> float:
    """Kill (if still running) and reap one neighbour; its user + system CPU seconds."""
    if proc.returncode is None:
        # os.kill, not Popen.send_signal: that polls first, and a poll would reap a neighbour
        # that has exited and lose its CPU time.
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except ChildProcessError:  # already reaped elsewhere: its usage is lost
            proc.returncode = -signal.SIGKILL
            return 0.0
        # Popen must not wait for a pid the kernel has already handed back.
        proc.returncode = os.waitstatus_to_exitcode(status)
        return usage.ru_utime + usage.ru_stime
    return 0.0


@contextmanager
def busy_neighbours(processes: int, limit_s: float) -> Iterator[BusyLoad]:
    """Starts `processes` spinning neighbours (each ends by itself after `limit_s` seconds or
    when this process is gone), yields them, and kills and reaps them on exit, filling
    `BusyLoad.report`. With `processes` 0 nothing is started, and the report is the quiet
    window's: the machine's own load over it (other work on a shared machine shows there)."""
    if processes < 0:
        raise ValueError(f"busy neighbours: processes must be >= 0, got {processes}")
    if not limit_s > 0:
        raise ValueError(f"busy neighbours: limit_s must be > 0, got {limit_s}")
    load_start = psutil.getloadavg()[0]
    times_start = psutil.cpu_times()
    code = _SPIN.format(limit_s=float(limit_s), parent=os.getpid())
    load = BusyLoad([], time.monotonic())
    try:
        for _ in range(processes):
            load.processes.append(subprocess.Popen([sys.executable, "-S", "-c", code],
                                                   stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        yield load
    finally:
        wall = time.monotonic() - load.started
        machine = _busy_percent(times_start, psutil.cpu_times())
        # Exited before the kill: their time bound ran out during the window.
        ended_early = sum(1 for p in load.processes if _exited_without_kill(p))
        cpu = sum((_reap(p) for p in load.processes), 0.0)
        load.report = BusyReport(
            processes=processes, wall_s=wall, cpu_s=cpu,
            cpu_share=cpu / (wall * processes) if wall > 0 and processes else None,
            ended_early=ended_early, machine_cpu_percent=machine,
            load_avg_1m_start=load_start, load_avg_1m_end=psutil.getloadavg()[0],
            cpu_count=psutil.cpu_count() or 1)


def _exited_without_kill(proc: subprocess.Popen) -> bool:
    """Whether a neighbour has already exited (a zombie waiting to be reaped), without reaping
    it: its CPU time is read when it is reaped."""
    try:
        status = psutil.Process(proc.pid).status()
    except psutil.NoSuchProcess:
        return True
    return status == psutil.STATUS_ZOMBIE


def _busy_percent(start: Any, end: Any) -> float:
    """The machine's CPU use between two `psutil.cpu_times()` readings, in % of all cores (its
    own difference, not `psutil.cpu_percent`, whose window any other caller would reset)."""
    def total(t: Any) -> float:
        # Guest time is already counted in user time on Linux.
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def idle(t: Any) -> float:
        return t.idle + getattr(t, "iowait", 0.0)

    elapsed = total(end) - total(start)
    if elapsed <= 0:
        return 0.0
    return max(0.0, min(100.0, 100.0 * (1.0 - (idle(end) - idle(start)) / elapsed)))
