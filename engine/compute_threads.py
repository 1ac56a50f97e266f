"""How many torch (OpenMP) threads a rank computes with, and how they wait.

Every rank sets its threads as it starts (workers.worker.Worker.init_device): the lone rank in
EngineCore's process at TP=1, each spawned TP rank, each torchrun rank. The choice is
``decide_compute_threads``, a pure function of the device, the usable cores, the ranks sharing
this machine, the user's setting and whether an API server shares the machine:

- the user's setting wins: ``--cpu-threads N``, else an ``OMP_NUM_THREADS`` in the environment;
- on a GPU the host only launches kernels and copies: 1 thread per rank (as vLLM's GPU workers,
  "to avoid unnecessary CPU contention"), so that it never starves the API server;
- on a CPU, the usable cores (the affinity mask, capped by the cgroup's CPU quota), less one
  left to the API server on machines of RESERVE_FROM_CORES cores or more, split between the
  local ranks.

How it was decided, on 2 cores (Intel Xeon, AVX-512 without AMX), the default model, float32:
``python -m bench.diagnostics.omp_threads --threads 1 2 --policies active passive spin10000
--busy 0 2 --repeats 2`` (a 2048-token prefill and a decode step at batch 8, each configuration
in a fresh process, side by side, nothing else running: bench/results/omp_threads_2026-11-29.md),
milliseconds:

    |                   | quiet prefill | quiet decode | 2 busy prefill | 2 busy decode |
    | 1 thread          |          4888 |         82.5 |      6882-7727 |       124-136 |
    | 2, libgomp spins  |          2621 |         52.8 |          10052 |          2212 |
    | 2, passive        |          2760 |         72.2 |           5030 |          88.1 |
    | 2, spin 10000     |          2590 |         54.1 |           5851 |         143.8 |

- Every core computes, on a machine of up to RESERVE_FROM_CORES - 1 cores: one thread per core
  beats one thread fewer everywhere measured, quiet (1.9x the prefill) and beside two busy
  processes, with the API server's work in between. vLLM's CPU backend leaves a core to its API
  server (``VLLM_CPU_NUM_OF_RESERVED_CPU``); here that halves a 2-core machine's prefill for
  work that takes the API server a few milliseconds a request. From RESERVE_FROM_CORES cores on
  one core is left to the API server (not measured: at most an eighth of the cores, and the
  front end of a many-core server has many clients).
- libgomp's default wait is the failure: each barrier spins 300,000 iterations before sleeping,
  and beside two busy processes a spinning thread burns the very core its straggling partner
  needs (decode 16.8x the one thread's). A bounded spin (``GOMP_SPINCOUNT=10000``: a few
  microseconds, then it sleeps) keeps the quiet machine's speed (decode 54 ms against the
  default's 53; passive's 72 ms would cost a quiet server a third of its decode throughput)
  and stops the collapse beside busy processes (5.9 s and 144 ms against 10.1 s and 2212 ms).
  Passive did better still beside busy processes (5.0 s, 88 ms): it is what to set
  (``OMP_WAIT_POLICY=PASSIVE``) on a machine that is always shared.

``bounded_spin_for_children`` puts ``GOMP_SPINCOUNT=10000`` into the environment of the
processes sloserve spawns (EngineCore, TP ranks), since libgomp reads it once, when ``import
torch`` loads it; a process that imported torch before sloserve ran (a torchrun rank, an
offline ``LLM``'s caller) keeps what its launcher set, and the startup log says so. A user's own
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.

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
# Cores left to the API server where one shares a machine of at least RESERVE_FROM_CORES usable
# cores (on 2 cores, leaving one halved the prefill: module doc).
API_SERVER_CORES = 1
RESERVE_FROM_CORES = 8
# What the ranks' threads do at a barrier unless the user says otherwise: spin briefly, then
# sleep (module doc).
WAIT_POLICY_ENV = {"GOMP_SPINCOUNT": "10000"}
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
    left = API_SERVER_CORES if api_server and cores.count >= RESERVE_FROM_CORES else 0
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
    return ("libgomp's default, spinning 300000 times at each barrier (set GOMP_SPINCOUNT=10000 "
            "or OMP_WAIT_POLICY=PASSIVE where it is launched)")


@contextlib.contextmanager
def bounded_spin_for_children(environ: MutableMapping[str, str] = os.environ,
                              api_server: bool = False) -> Iterator[None]:
    """Within the block, processes spawned from here start with a bounded spin at OpenMP's
    barriers (WAIT_POLICY_ENV, unless the user set a wait policy) and, with ``api_server``, know
    that an API server shares the machine;
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
