"""A clean exit: `sloserve serve` stopped by a signal leaves no shared-memory segment behind and
prints no `resource_tracker: ... leaked shared_memory` warning, whichever processes the signal
reaches and whichever process dies first.

The server runs as a user runs it (`python -m engine serve`), in a session of its own, so that a
signal can go to its whole process group as torchrun (`os.killpg` on each rank), `timeout`, a
terminal's Ctrl-C and systemd's control-group kill send it. The segments are the ones the
server's own processes map (read from /proc/<pid>/maps), not a /dev/shm diff: other servers may
run beside this one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.benchmarks.server import wait_until_healthy
from engine.ports import free_port
from tests.utils.server_helpers import REPO, children, cmdline, descendants, wait_gone

SHM = Path("/dev/shm")
LEAK_WARNING = "leaked shared_memory"

# Alone (the README's serial run): a leaked segment is one in /dev/shm that no process on
# the machine maps, which a test running beside these could have just created.
pytestmark = [pytest.mark.skipif(not SHM.is_dir(), reason="POSIX shared memory lives in /dev/shm"),
              pytest.mark.serial]


def mapped_segments(pids: list[int]) -> set[str]:
    """Names of the /dev/shm segments that any of `pids` maps."""
    names: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone meanwhile
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                names.add(fields[5][len(f"{SHM}/"):].removesuffix(" (deleted)"))
    return names


def orphaned_segments(since: set[str]) -> set[str]:
    """Segments in /dev/shm that were not there in `since` and that no live process maps: what
    a process that created a segment and died without unlinking it leaves."""
    new = {p.name for p in SHM.iterdir()} - since
    if not new:
        return set()
    live = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return new - mapped_segments(live)


class Server:
    """`python -m engine serve` on the tiny model, in its own session, stdout and stderr kept
    apart."""

    def __init__(self, model: str, folder: Path, *extra: str, module: str = "engine") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr_path = folder / "stderr.txt"
        args = [sys.executable, "-m", module, "serve", "--model", model, "--dtype", "float32",
                "--port", str(self.port), "--log-level", "info", "--max-model-len", "64",
                "--num-kv-blocks", "16", "--startup-calibration", "off",
                "--served-model-name", "tiny", *extra]
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                       "PYTHONUNBUFFERED": "1"}
        environment.pop("SLOSERVE_API_KEY", None)
        with open(folder / "stdout.txt", "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(args, cwd=REPO, env=environment, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Healthy, and one completion answered: the engine has run a step."""
        try:
            wait_until_healthy(self.proc, self.url, timeout, self.stderr, poll_s=0.1)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from exc
        response = httpx.post(f"{self.url}/v1/completions", timeout=60.0,
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200, response.text

    def tree(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def signal_group(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)  # its session's group: the server and all it started

    def wait_exit(self, tree: list[int], timeout: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(tree)
            raise AssertionError(f"server did not exit within {timeout} s:\n{self.stderr()}")
        left = wait_gone(tree, 10.0)
        self.kill(left)
        assert not left, f"processes left behind: {left}\n{self.stderr()}"
        return code

    def kill(self, pids: list[int]) -> None:
        """SIGKILL for a failed test's leftovers, except the resource tracker: it exits by
        itself once they are gone, and unlinks what they leaked on its way out."""
        for pid in pids:
            if "resource_tracker" in cmdline(pid):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server_factory(tiny_model, tmp_path):
    started: list[Server] = []

    def start(*extra: str, model: str | None = None, module: str = "engine") -> Server:
        folder = tmp_path / f"server{len(started)}"
        folder.mkdir()
        server = Server(model or tiny_model("llama"), folder, *extra, module=module)
        started.append(server)
        return server

    yield start
    for server in started:  # a failed test must not leave a server behind
        if server.proc.poll() is None:
            server.kill(descendants(server.proc.pid))


def _running_segments(server: Server, starting: bool = False) -> tuple[list[int], set[str]]:
    """The server's processes and the segments they map; the probe that the preempt signal's
    segment exists while the server runs (so that its absence afterwards means something). Its
    name is in /dev/shm only while the engine starts: once EngineCore is ready every process
    that reads it has attached, and the owner removes the name (monitor/slo_preempt_signal.py)."""
    tree = server.tree()
    assert len(tree) >= 2, "the server should have an EngineCore child process"
    segments = mapped_segments(tree)
    assert segments, f"the server's processes map no /dev/shm segment (tree {tree})"
    named = {name for name in segments if (SHM / name).exists()}
    assert named == (segments if starting else set()), (segments, named)
    return tree, segments


def _assert_clean(server: Server, code: int, expected: int, segments: set[str],
                  before: set[str]) -> None:
    err = server.stderr()
    assert code == expected, f"exit status {code}, expected {expected}:\n{err[-4000:]}"
    assert LEAK_WARNING not in err, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert "Application shutdown complete." in err, err[-4000:]
    left = {name for name in segments if (SHM / name).exists()}
    assert not left, f"segments left in {SHM}: {left}"
    assert not orphaned_segments(before), "a segment nobody maps was left behind"


# A clean stop by SIGTERM: uvicorn shuts down gracefully, then re-raises the signal so that the
# parent sees how it ended. By Ctrl-C: 130, the shell's status for it, without a traceback.
STOPS = {
    "sigterm-server": (signal.SIGTERM, False, -signal.SIGTERM),
    "sigterm-group": (signal.SIGTERM, True, -signal.SIGTERM),
    "sigint-group": (signal.SIGINT, True, 130),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_stop_by_signal_unlinks_every_segment(server_factory, stop: str) -> None:
    sig, whole_group, expected = STOPS[stop]
    before = {p.name for p in SHM.iterdir()}
    server = server_factory()
    server.wait_serving()
    tree, segments = _running_segments(server)
    if whole_group:
        server.signal_group(sig)
    else:
        server.proc.send_signal(sig)
    code = server.wait_exit(tree)
    _assert_clean(server, code, expected, segments, before)


def test_engine_process_killed_then_stop_unlinks(server_factory) -> None:
    """EngineCore dies without a word (SIGKILL: the OOM killer, a crash in a kernel): the server
    stays up, reports the engine dead, and still removes the segment when it is stopped."""
    before = {p.name for p in SHM.iterdir()}
    server = server_factory()
    server.wait_serving()
    tree, segments = _running_segments(server)
    # The spawned EngineCore, not the resource tracker beside it (which must live on to
    # report a leak, if there is one).
    core = [pid for pid in children(server.proc.pid) if "spawn_main" in cmdline(pid)]
    assert len(core) == 1, [(pid, cmdline(pid)) for pid in children(server.proc.pid)]
    os.kill(core[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "the server did not notice its engine died"
        time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    code = server.wait_exit(tree)
    _assert_clean(server, code, -signal.SIGTERM, segments, before)


def test_engine_startup_failure_unlinks(server_factory, tiny_model, tmp_path) -> None:
    """The engine fails while it starts (weights that do not load): the server exits with
    uvicorn's startup-failure status and leaves no segment."""
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model("llama"), broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    before = {p.name for p in SHM.iterdir()}
    server = server_factory(model=str(broken))
    code = server.wait_exit(server.tree(), timeout=120)
    err = server.stderr()
    assert code == 3, f"exit status {code}:\n{err[-4000:]}"  # uvicorn's STARTUP_FAILURE
    assert LEAK_WARNING not in err, err[-4000:]
    assert not orphaned_segments(before), "a segment nobody maps was left behind"


@pytest.mark.parametrize("stop", ["sigint-group", "sigterm-group"])
def test_stop_while_the_engine_starts(server_factory, stop: str) -> None:
    """Ctrl-C or SIGTERM while EngineCore starts (loading weights, capturing graphs: minutes
    for a large model): the server stops the engine then, instead of waiting out the start only
    to undo it, and exits cleanly. The engine's start is held 10 minutes
    (tests/utils/slow_engine_start.py): only an early stop finishes in time."""
    from tests.utils.slow_engine_start import HOLD_MARKER

    sig, _, expected = STOPS[stop]
    before = {p.name for p in SHM.iterdir()}
    server = server_factory("--startup-calibration", "on", module="tests.utils.slow_engine_start")
    deadline = time.monotonic() + 120
    while HOLD_MARKER not in server.stderr():
        assert server.proc.poll() is None, server.stderr()[-4000:]
        assert time.monotonic() < deadline, f"the engine's start was not held:\n{server.stderr()}"
        time.sleep(0.1)
    tree, segments = _running_segments(server, starting=True)
    server.signal_group(sig)
    code = server.wait_exit(tree, timeout=60)
    _assert_clean(server, code, expected, segments, before)
    assert "SIGTERM while starting" in server.stderr(), server.stderr()[-4000:]


def test_generate_stopped_by_sigterm_unlinks(tiny_model, tmp_path) -> None:
    """`sloserve generate` runs the engine in its own process, which owns the segment: SIGTERM
    (torchrun stops every rank with it) unwinds through the engine's shutdown instead of killing
    it on the spot."""
    from tests.utils.slow_engine_start import HOLD_MARKER

    err_path = tmp_path / "stderr.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.utils.slow_engine_start", "generate", "hello", "--no-chat",
             "--model", tiny_model("llama"), "--dtype", "float32", "--max-model-len", "64",
             "--num-kv-blocks", "16", "--startup-calibration", "on"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while HOLD_MARKER not in err_path.read_text(errors="replace"):
            assert proc.poll() is None, err_path.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "the engine's start was not held"
            time.sleep(0.1)
        # The engine owns its signal here, and its workers attached before the hold (after
        # the weights loaded): mapped, its name already gone from /dev/shm.
        segments = mapped_segments([proc.pid])
        assert segments and not any((SHM / name).exists() for name in segments), segments
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err_path.read_text(errors="replace")
    assert code == 128 + signal.SIGTERM, f"exit status {code}:\n{text[-4000:]}"
    assert LEAK_WARNING not in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert not {name for name in segments if (SHM / name).exists()}


def test_a_second_sigterm_while_starting_does_not_cut_the_first_short() -> None:
    """A signal to the process group reaches a starting EngineCore twice: the signal itself,
    then the API server's terminate() of it. The first unwinds the start; the second, arriving
    while that unwinding runs (the constructor's clean-up, the `except _Terminated` handler),
    must not raise again: it used to, and the core died with a traceback mid clean-up (CI,
    test_stop_while_the_engine_starts[sigterm-group], 1 run in ~20). Once serving, each SIGTERM
    queues a stop for the loop."""
    import queue

    from engine.ipc.core_process import _TERMINATED, _StopOnSigterm, _Terminated

    handler = _StopOnSigterm()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        unwound = False
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs between two bytecodes: the sleep is cut short
            pytest.fail("the first SIGTERM did not unwind the start")
        except _Terminated:
            os.kill(os.getpid(), signal.SIGTERM)  # the second, during the unwinding
            time.sleep(0.05)
            unwound = True
        assert unwound and handler.raised

        handler.events = queue.SimpleQueue()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert handler.events.get_nowait() is _TERMINATED
    finally:
        signal.signal(signal.SIGTERM, previous)
