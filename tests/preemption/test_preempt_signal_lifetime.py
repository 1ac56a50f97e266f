"""The shared-memory preempt signal's mapping ends cleanly however its holder lets go of it:
close() (once or twice), dropping the object, or the interpreter's exit. A SharedMemory closed
while views over it remain prints `BufferError: cannot close exported pointers exist` as an
'Exception ignored' traceback at exit (every torchrun run once printed one)."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing import shared_memory

import pytest

from monitor.slo_preempt_signal import SLOPreemptSignal

# Run in a fresh interpreter: exit-time finalisation is the path under test, and stderr must be
# its alone. Neither signal is closed; the reader is dropped mid-run, the owner left to the exit.
_SCRIPT = """
import gc
from monitor.slo_preempt_signal import SLOPreemptSignal

owner = SLOPreemptSignal.create()
owner.publish(41, "victim", "waiter", 1.5)
reader = SLOPreemptSignal.attach(owner.name)
print(owner.name)
print(reader.target_step_id, reader.decision()[1])
del reader
gc.collect()
# The owner's mapping outlives the reader's.
owner.publish(42, "", "", 0.0)
print(owner.target_step_id)
"""

NOISE = ("Traceback", "BufferError", "Exception ignored", "leaked shared_memory")


def test_signals_never_closed_leave_no_traceback_at_exit():
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for word in NOISE:
        assert word not in result.stderr, result.stderr
    name, read, after = result.stdout.split("\n")[:3]
    # Probes: the reader really mapped the owner's segment, and the owner kept working after the
    # reader was dropped ...
    assert read == "41 victim"
    assert after == "42"
    # ... and the owner's exit-time finalizer ran: the segment's name is gone.
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


def test_close_is_idempotent_and_a_reader_closing_leaves_the_owner_alone():
    owner = SLOPreemptSignal.create()
    try:
        reader = SLOPreemptSignal.attach(owner.name)
        reader.close()
        reader.close()
        assert reader.closed and not owner.closed
        owner.publish(7, "", "", 0.0)
        assert SLOPreemptSignal.attach(owner.name).target_step_id == 7
    finally:
        owner.close()
    owner.close()
    assert owner.closed
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=owner.name)
