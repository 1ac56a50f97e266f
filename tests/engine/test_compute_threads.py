"""Each rank's torch threads and OpenMP wait policy (engine/compute_threads.py): the decision as a
pure function, the cgroup quota read from faked cgroup files, the environment the API server and
the executors hand the processes they spawn, and a real server's EngineCore read back through its
startup log and the environment it started with (/proc/PID/environ)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from engine.compute_threads import (API_SERVER_ENV, UsableCores, cgroup_cpu_quota,
                                    compute_threads_for_rank, decide_compute_threads,
                                    omp_num_threads, bounded_spin_for_children, wait_policy)
from engine.config import EngineConfig, ModelConfig
from engine.entrypoints.cli import main
from tests.utils.server_helpers import ServerProcess, cmdline, descendants

OMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", API_SERVER_ENV)
# The line every rank logs once it has set its threads (workers.worker.Worker.set_compute_threads),
# here from the EngineCore process (its multiprocessing name).
ENGINE_CORE_LINE = re.compile(r"sloserve-engine-core workers\.worker: compute threads: (\d+) "
                              r"\((.*)\); OpenMP wait policy: (\S+)")


def cpu(cores: UsableCores, *, ranks: int = 1, flag: int | None = None, env: int | None = None,
        api_server: bool = True):
    return decide_compute_threads("cpu", cores, ranks, flag, env, api_server)


# ---- the decision -------------------------------------------------------------------------------

def test_a_server_on_two_cores_computes_on_both() -> None:
    """Leaving one to the API server halved the prefill (engine/compute_threads.py)."""
    choice = cpu(UsableCores(2))
    assert choice.threads == 2
    assert choice.why == "2 usable cores: affinity 2, cgroup quota none"


def test_a_server_on_eight_cores_or_more_leaves_one_to_the_api_server() -> None:
    assert cpu(UsableCores(7)).threads == 7
    choice = cpu(UsableCores(8))
    assert choice.threads == 7 and choice.why.endswith("; 1 left to the API server")
    assert cpu(UsableCores(64)).threads == 63


def test_without_an_api_server_every_usable_core_computes() -> None:
    assert cpu(UsableCores(2), api_server=False).threads == 2
    assert cpu(UsableCores(8), api_server=False).threads == 8


def test_a_single_core_is_never_left_idle() -> None:
    choice = cpu(UsableCores(1))
    assert choice.threads == 1 and "left" not in choice.why


def test_the_cores_are_split_between_the_local_ranks() -> None:
    assert cpu(UsableCores(8), ranks=2).threads == 3  # (8 - 1) // 2
    assert cpu(UsableCores(4), ranks=2).threads == 2
    assert cpu(UsableCores(8), ranks=2, api_server=False).threads == 4
    assert cpu(UsableCores(2), ranks=4).threads == 1  # never below one
    assert "split between 2 local ranks" in cpu(UsableCores(8), ranks=2).why


def test_a_cgroup_quota_below_the_affinity_caps_the_cores() -> None:
    cores = UsableCores(affinity=16, quota=3)
    assert cores.count == 3
    choice = cpu(cores)
    assert choice.threads == 3  # fewer than 8: none left over
    assert choice.why.startswith("3 usable cores: affinity 16, cgroup quota 3")
    assert UsableCores(affinity=2, quota=8).count == 2  # a quota above the affinity: no cap


def test_the_users_flag_wins_over_everything() -> None:
    assert cpu(UsableCores(2), flag=4, env=1).threads == 4
    assert decide_compute_threads("cuda", UsableCores(64), 8, 6, None, True).threads == 6
    assert cpu(UsableCores(2), flag=4).why == "--cpu-threads"


def test_omp_num_threads_counts_as_the_users_choice() -> None:
    choice = cpu(UsableCores(8), env=1)
    assert (choice.threads, choice.why) == (1, "OMP_NUM_THREADS")
    assert decide_compute_threads("cuda", UsableCores(8), 1, None, 3, True).threads == 3
    assert omp_num_threads({"OMP_NUM_THREADS": "1"}) == 1
    assert omp_num_threads({"OMP_NUM_THREADS": "4,2"}) == 4  # nested levels: the first
    for ignored in ("", "0", "-2", "two", "1.5"):  # libgomp ignores these too
        assert omp_num_threads({"OMP_NUM_THREADS": ignored}) is None
    assert omp_num_threads({}) is None


def test_a_gpu_rank_takes_one_host_thread() -> None:
    for ranks in (1, 8):
        choice = decide_compute_threads("cuda", UsableCores(64), ranks, None, None, True)
        assert choice.threads == 1 and "GPU" in choice.why


# ---- the cgroup quota ---------------------------------------------------------------------------

def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2  # 1.5 cores, rounded up
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


@pytest.mark.parametrize("folder", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path: Path, folder: str) -> None:
    root = tmp_path / folder
    root.mkdir()
    (root / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_quota(tmp_path) == 3
    (root / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_no_cgroup_files_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None


def test_this_process_decides_from_its_affinity_quota_and_environment(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # one core's quota
    choice = compute_threads_for_rank("cpu", 1, None, {API_SERVER_ENV: "1"}, tmp_path)
    assert choice.threads == 1
    assert choice.why.startswith(f"1 usable cores: affinity {len(os.sched_getaffinity(0))}, "
                                 f"cgroup quota 1")
    assert compute_threads_for_rank("cpu", 1, None, {"OMP_NUM_THREADS": "3"}, tmp_path).threads \
        == 3


# ---- the wait policy ----------------------------------------------------------------------------

def test_spawned_processes_start_with_a_bounded_spin_and_the_parent_keeps_its_own() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    with bounded_spin_for_children(environ, api_server=True):
        assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000", API_SERVER_ENV: "1"}
    assert environ == {"PATH": "/bin"}
    with bounded_spin_for_children(environ):
        assert API_SERVER_ENV not in environ and environ["GOMP_SPINCOUNT"] == "10000"
    assert environ == {"PATH": "/bin"}


@pytest.mark.parametrize("users", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}])
def test_the_users_wait_policy_wins(users: dict[str, str]) -> None:
    environ = dict(users)
    with bounded_spin_for_children(environ):
        assert environ == users
    assert environ == users


def test_the_wait_policy_as_logged() -> None:
    assert wait_policy({"OMP_WAIT_POLICY": "PASSIVE"}) == "passive"
    assert wait_policy({"OMP_WAIT_POLICY": "active"}) == "active"
    assert wait_policy({"GOMP_SPINCOUNT": "1000"}) == "GOMP_SPINCOUNT=1000"
    assert "GOMP_SPINCOUNT=10000" in wait_policy({})  # what the launcher should set


# ---- the flag -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two"])
def test_an_invalid_cpu_threads_is_a_usage_error_naming_the_flag(value: str, capsys) -> None:
    assert main(["serve", "--cpu-threads", value]) == 2
    assert "--cpu-threads" in capsys.readouterr().err


def test_an_invalid_cpu_threads_in_the_configuration_is_refused() -> None:
    for value in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            EngineConfig(model=ModelConfig(model="unused", device="cpu"), cpu_threads=value)


# ---- a real server's EngineCore -----------------------------------------------------------------

def _engine_core(server: ServerProcess) -> tuple[int, int, str, str]:
    """EngineCore's (pid, torch threads, why, wait policy) from its startup log line."""
    found = ENGINE_CORE_LINE.findall(server.log(tail=200_000))
    assert len(found) == 1, f"one compute-threads line from EngineCore expected:\n{server.log()}"
    threads, why, policy = found[0]
    pids = [pid for pid in descendants(server.pid)
            if "spawn_main" in cmdline(pid) and "resource_tracker" not in cmdline(pid)]
    assert len(pids) == 1, [cmdline(pid) for pid in descendants(server.pid)]
    return pids[0], int(threads), why, policy


def _started_with(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (what libgomp read when it loaded)."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def test_a_default_server_on_two_cores_computes_on_both_with_a_bounded_spin(tiny_model,
                                                                             tmp_path) -> None:
    """The spinning defect: EngineCore ran torch's default, one thread per core spinning
    300,000 times at every barrier, against the API server and any other busy process."""
    two = sorted(os.sched_getaffinity(0))[:2]
    if len(two) < 2 or UsableCores(2, cgroup_cpu_quota()).count < 2:
        pytest.skip("needs two usable cores")
    server = ServerProcess(tiny_model("llama"), tmp_path / "server.log", unset=OMP_VARIABLES,
                           affinity=set(two))
    try:
        pid, threads, why, policy = _engine_core(server)
        assert threads == 2
        assert "affinity 2" in why and "left to the API server" not in why
        assert policy == "GOMP_SPINCOUNT=10000"
        assert _started_with(pid).get("GOMP_SPINCOUNT") == "10000"
    finally:
        server.assert_clean_stop()


def test_the_users_threads_and_wait_policy_win(tiny_model, tmp_path) -> None:
    core = min(os.sched_getaffinity(0))
    server = ServerProcess(tiny_model("llama"), tmp_path / "server.log", "--cpu-threads", "2",
                           unset=("OMP_NUM_THREADS", "GOMP_SPINCOUNT"),
                           env={"OMP_WAIT_POLICY": "active"},
                           affinity={core})
    try:
        pid, threads, why, policy = _engine_core(server)
        assert (threads, why, policy) == (2, "--cpu-threads", "active")
        assert _started_with(pid).get("OMP_WAIT_POLICY") == "active"
    finally:
        server.assert_clean_stop()
