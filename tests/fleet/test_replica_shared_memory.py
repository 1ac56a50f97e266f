"""A replica killed with SIGKILL leaves nothing in /dev/shm: the preempt signal's owner removes
the segment's name once every process that reads it has attached (monitor/slo_preempt_signal.py),
and the memory lives on in their mappings until the last one exits.

Killed here as a cluster manager kills a worker: the whole process group at once, the owner, the
process attached to it and multiprocessing's resource tracker (which would otherwise unlink a
dead owner's segment at its own exit). The same kill without the early unlink leaves the
segment behind: the probe that the test's kill is one that leaks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.serving.api_server import ServerSettings
from monitor.slo_preempt_signal import SLOPreemptSignal
from tests.utils import inprocess_server
from tests.utils.inprocess_server import FakeCore, app_client
from tests.utils.server_helpers import REPO

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="POSIX shared memory lives in /dev/shm")

# The owner creates the signal, a forked child attaches to it by name and reads what the owner
# writes before and after the owner removes the name ("unlink"; "keep": it does not), then both
# wait to be killed.
_OWNER = """
import multiprocessing, sys, time
from monitor.slo_preempt_signal import SLOPreemptSignal

def read(name, seen):
    signal = SLOPreemptSignal.attach(name)
    seen.put(signal.target_step_id)
    while signal.target_step_id != 42:
        time.sleep(0.001)
    seen.put(signal.target_step_id)
    time.sleep(600)

owner = SLOPreemptSignal.create()
owner.publish(41, "", "", 0.0)
context = multiprocessing.get_context("fork")
seen = context.Queue()
reader = context.Process(target=read, args=(owner.name, seen))
reader.start()
before = seen.get(timeout=60)
if sys.argv[1] == "unlink":
    owner.unlink()
owner.publish(42, "", "", 0.0)
print(owner.name, before, seen.get(timeout=60), reader.pid, flush=True)
time.sleep(600)
"""


def _mapped(pid: int, name: str) -> str | None:
    """How process `pid` maps /dev/shm/`name`: its maps line's path ('... (deleted)' once the
    name is gone), or None."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if f"{SHM}/{name}" in line:
            return line.split(maxsplit=5)[5]
    return None


def _kill_group_after_attach(mode: str) -> tuple[str, str | None]:
    """Run the owner in a session of its own; once its child has attached, SIGKILL the group.
    Returns the segment's name and how the child mapped it before the kill."""
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, mode], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name, before, after, reader = proc.stdout.readline().split()
        # Probes: the child attached and reads the owner's writes, after the unlink too.
        assert (before, after) == ("41", "42")
        mapping = _mapped(int(reader), name)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{reader}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # the child, reparented, is reaped by init
    return name, mapping


def test_an_owner_killed_after_every_process_attached_leaves_no_segment():
    name, mapping = _kill_group_after_attach("unlink")
    assert mapping == f"{SHM}/{name} (deleted)"  # attached, the name already gone
    assert not (SHM / name).exists()


def test_the_same_kill_without_the_unlink_leaks_the_segment():
    name, mapping = _kill_group_after_attach("keep")
    try:
        assert mapping == f"{SHM}/{name}"
        assert (SHM / name).exists(), "the kill did not leak: the test above proves nothing"
    finally:
        (SHM / name).unlink(missing_ok=True)


def test_the_api_server_removes_the_name_once_the_engine_is_ready(tiny_model, monkeypatch):
    """The owner of a server's signal is its API server process (a fleet replica's actor):
    EngineCore attaches while it starts, and from its ready on /dev/shm holds no name. Here a
    stand-in EngineCore (tests/utils/inprocess_server.py) attaches when told to start."""
    from transformers import AutoTokenizer

    attached: list[tuple[SLOPreemptSignal, bool]] = []
    real_decoder = inprocess_server.start_decoder

    class AttachingDecoder:
        def decode(self, frame: bytes):
            start = real_decoder.decode(frame)
            name = start.slo_preempt_signal_name
            attached.append((SLOPreemptSignal.attach(name), (SHM / name).exists()))
            return start

    monkeypatch.setattr(inprocess_server, "start_decoder", AttachingDecoder())
    model = tiny_model()

    async def run() -> tuple[str, bool, int]:
        fake = FakeCore(len(AutoTokenizer.from_pretrained(model)))
        async with app_client(model, ServerSettings(served_model_name="tiny"), fake=fake) as (
                _, client):
            owner = client._slo_preempt_signal
            owner.publish(7, "", "", 0.0)
            return owner.name, (SHM / owner.name).exists(), attached[0][0].target_step_id

    name, named_when_ready, read = asyncio.run(run())
    reader, named_when_attached = attached[0]
    try:
        # Probes: the name existed when the engine attached, and the attachment is the owner's
        # segment (it reads the owner's write made after the name was removed).
        assert named_when_attached and read == 7
        assert not named_when_ready and not (SHM / name).exists()
    finally:
        reader.close()
