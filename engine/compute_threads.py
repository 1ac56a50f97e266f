"""How many torch (OpenMP) threads a rank computes with, and how they wait.

Every rank sets its threads as it starts (workers.worker.Worker.init_device): the lone rank in
EngineCore's process at TP=1, each spawned TP rank, each torchrun rank. The choice is
``decide_compute_threads``, a pure function of the device, the usable cores, the ranks sharing
this machine, the user's setting and whether an API server shares the machine:

- the user's setting wins: ``--cpu-threads N``, else an ``OMP_NUM_THREADS`` in the environment;
- on a GPU the host only launches kernels and copies: 1 thread per rank (as vLLM's GPU workers,
  "to avoid unnecessary CPU contention"), so that it never starves the API server;
- on a CPU, the usable cores (the affinity mask, capped by the cgroup's CPU quota) less one left
  to the API server, split between the local ranks.

Why a core for the API server: it tokenizes, detokenizes and answers HTTP while the engine
computes, and a forward pass is a chain of parallel regions, each ending in a barrier that waits
for its slowest thread, so one compute thread descheduled by the API server (or by any other
busy process) delays the whole step. How it was decided, on 2 cores, the default model, float32
(``python -m bench.diagnostics.omp_threads``: a 2048-token prefill and a decode step at batch 8
for 1 and 2 threads and each wait policy, each in a fresh process, side by side): one thread's
prefill took 5.0 s against two threads' 6.4 s (spinning) and 7.4 s (passive); two threads won
only the decode step, and only while spinning (51 against 76 ms; passive, 81 ms). Other work
shared the machine during that run, so these are indicative, not clean quiet figures. Beside two
busy processes, one thread met every urgent deadline of a loaded burst (6/6) where the default
two spinning threads met none (0/6).
So 2 cores give the engine one thread and leave the other to the API server, as vLLM's CPU
backend reserves cores (``VLLM_CPU_NUM_OF_RESERVED_CPU``). Larger machines leave one core too
(not measured: it costs them at most a third of their cores, and less the more they have).
Without an API server (the offline ``LLM``, ``sloserve generate``) nothing is left over.

How idle threads wait: libgomp's default spins at each barrier before sleeping, which against
another runnable process burns the very core the straggler needs. ``passive_wait_for_children``
puts ``OMP_WAIT_POLICY=PASSIVE`` into the environment of the processes sloserve spawns (EngineCore,
TP ranks), since libgomp reads it once, when ``import torch`` loads it; a process that imported
torch before sloserve ran (a torchrun rank, an offline ``LLM``'s caller) keeps what its launcher
set, and the startup log says so. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.
Passive cost two threads' quiet decode step in the run above (81 against 51 ms); it is kept
because spinning beside busy processes is the failure this module exists for, and the default
single thread on 2 cores has no barrier partner to wait for.

Nothing here imports torch: the API server uses it before it has loaded torch.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Set by the API server in the environment of the EngineCore process it spawns (and so of the TP
# ranks EngineCore spawns): an API server runs on this machine beside the ranks.
API_SERVER_ENV = "SLOSERVE_API_SERVER_SHARES_CORES"
# Cores left to the API server where one shares the machine (measured on 2 cores: module doc).
API_SERVER_CORES = 1
# What the ranks' threads do at a barrier unless the user says otherwise.
WAIT_POLICY_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
USER_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class UsableCores:
    """The cores this process may run on: its affinity mask, capped by the cgroup's CPU quota
    (``quota``: ceil(quota / period) cores; None where no quota is set)."""

    affinity: int
    quota: int | None = None

    @property
    def count(self) -> int:
        return self.affinity if self.quota is None else max(1, min(self.affinity, self.quota))

    def describe(self) -> str:
        quota = "none" if self.quota is None else str(self.quota)
        return f"{self.count} usable cores: affinity {self.affinity}, cgroup quota {quota}"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> int | None:
    """The cgroup's CPU quota in whole cores, rounded up (cgroup v2 ``cpu.max``, else v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None where there is none or none is readable."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _whole_cores(int(quota), int(period))
    except (OSError, ValueError):
        pass
    for folder in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota_us = int((folder / "cpu.cfs_quota_us").read_text())
            period_us = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us < 0 else _whole_cores(quota_us, period_us)
    return None


def _whole_cores(quota: int, period: int) -> int | None:
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def usable_cores(cgroup_root: Path = CGROUP_ROOT) -> UsableCores:
    return UsableCores(len(os.sched_getaffinity(0)), cgroup_cpu_quota(cgroup_root))


def omp_num_threads(environ: Mapping[str, str]) -> int | None:
    """The thread count ``OMP_NUM_THREADS`` asks for (its first level where it lists several);
    None where it is unset or not a positive integer (libgomp ignores those too)."""
    text = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def decide_compute_threads(device: str, cores: UsableCores, local_ranks: int,
                           cpu_threads: int | None, env_threads: int | None,
                           api_server: bool) -> ThreadChoice:
    """Each rank's torch threads. ``cpu_threads``: ``--cpu-threads``; ``env_threads``: the
    environment's ``OMP_NUM_THREADS``; ``api_server``: an API server shares this machine."""
    if cpu_threads is not None:
        return ThreadChoice(cpu_threads, "--cpu-threads")
    if env_threads is not None:
        return ThreadChoice(env_threads, "OMP_NUM_THREADS")
    if device == "cuda":
        return ThreadChoice(1, "a GPU rank's host thread only launches work")
    left = API_SERVER_CORES if api_server and cores.count > API_SERVER_CORES else 0
    threads = max(1, (cores.count - left) // local_ranks)
    parts = [cores.describe()]
    if left:
        parts.append(f"{left} left to the API server")
    if local_ranks > 1:
        parts.append(f"split between {local_ranks} local ranks")
    return ThreadChoice(threads, "; ".join(parts))


def wait_policy(environ: Mapping[str, str]) -> str:
    """The wait policy ``environ`` gives libgomp, for the log."""
    if "OMP_WAIT_POLICY" in environ:
        policy = environ["OMP_WAIT_POLICY"].strip().lower()
        return policy if policy in ("passive", "active") else f"OMP_WAIT_POLICY={policy}"
    if "GOMP_SPINCOUNT" in environ:
        return f"GOMP_SPINCOUNT={environ['GOMP_SPINCOUNT']}"
    # Only a process that loaded torch before sloserve ran gets here (a torchrun rank, an
    # offline LLM's caller): its launcher must set the policy.
    return "libgomp's default, spinning (set OMP_WAIT_POLICY=PASSIVE where it is launched)"


@contextlib.contextmanager
def passive_wait_for_children(environ: MutableMapping[str, str] = os.environ,
                              api_server: bool = False) -> Iterator[None]:
    """Within the block, processes spawned from here start with the passive wait policy (unless
    the user set one) and, with ``api_server``, know that an API server shares the machine;
    ``environ`` is restored afterwards, since this process's own libgomp read it long ago."""
    added = {} if any(name in environ for name in USER_WAIT_VARIABLES) else dict(WAIT_POLICY_ENV)
    if api_server:
        added[API_SERVER_ENV] = "1"
    saved = {name: environ.get(name) for name in added}
    environ.update(added)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value


def compute_threads_for_rank(device: str, local_ranks: int, cpu_threads: int | None,
                             environ: Mapping[str, str] = os.environ,
                             cgroup_root: Path = CGROUP_ROOT) -> ThreadChoice:
    """``decide_compute_threads`` for this process, from its environment and its machine."""
    return decide_compute_threads(device, usable_cores(cgroup_root), local_ranks, cpu_threads,
                                  omp_num_threads(environ), environ.get(API_SERVER_ENV) == "1")
