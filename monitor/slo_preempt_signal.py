"""The shared-memory preempt signal: the id of the step to stop, plus whom the monitor chose.

The monitor thread writes it; the TP rank(s) on EngineCore's node read the target step id at every
attention-op boundary of a preemptible step. The signal is a step id, never a boolean: step ids
only grow, so a value written for step N can never stop step N+1 (docs/design.md section 5).

Its owner (`create()`) removes the segment's name; everyone else `attach()`es and only unmaps it.
Under `sloserve serve` the owner is the API server process, not EngineCore's: the owner must
outlive every process that maps the segment, and EngineCore's process is the one that may die
without a word (engine/ipc/async_client.py). An engine run in-process (LLM, `sloserve generate`)
owns its own. Once every process that reads the signal has attached (EngineCore and its worker
ranks, before EngineCore reports ready), the owner calls `unlink()`: the name leaves /dev/shm at
once and the memory lives on in the mappings until the last process holding one exits, however
it exits. Before that, an owner killed by SIGKILL leaves the name to multiprocessing's resource
tracker, which removes it at its own exit, unless it was killed too (a whole process group, as
a cluster manager kills a worker): the window is startup only.

Layout (little-endian): int64 target step id | uint8 len + 63 bytes victim id |
uint8 len + 63 bytes waiter id | float64 decision time (time.monotonic()) | int64 progress |
float64 progress time.

The progress words go the other way: the rank running a preemptible step writes
`step_id * 1024 + layer` at every attention-op boundary, the number of layers the device has
finished (one store, so a reader never sees a step id with another step's layer), and the
time.monotonic() it learned that (stored first: a reader that catches the two stores apart sees
a time later than the layer's, which only makes the step look slower). The monitor reads how far
the step has got, and when, to measure its pace.
"""

from __future__ import annotations

import struct
import sys
import time
import weakref
from multiprocessing import resource_tracker, shared_memory

_ID_BYTES = 64
_LAYOUT = struct.Struct(f"<q{_ID_BYTES}s{_ID_BYTES}sd")
_PROGRESS_AT = -(-_LAYOUT.size // 8) * 8  # int64-aligned
_MAX_LAYERS = 1024
NO_TARGET = -1


def _pack_id(request_id: str) -> bytes:
    raw = request_id.encode()[: _ID_BYTES - 1]
    return bytes([len(raw)]) + raw


def _unpack_id(field: bytes) -> str:
    return field[1 : 1 + field[0]].decode(errors="replace")


def _release(shm: shared_memory.SharedMemory, views: tuple[memoryview, ...],
             name_held: list[bool]) -> None:
    """Unmap the segment (and remove its name, where this process still holds it). The views
    over it go first: the mapping cannot close while a view exports it (`BufferError: cannot
    close exported pointers exist`, printed as 'Exception ignored' when SharedMemory.__del__
    meets them at exit)."""
    for view in views:
        view.release()
    shm.close()
    _unlink_name(shm, name_held)


def _unlink_name(shm: shared_memory.SharedMemory, name_held: list[bool]) -> None:
    """Remove the segment's name once (SharedMemory.unlink also drops it from the resource
    tracker, which would otherwise try again at exit)."""
    if name_held[0]:
        name_held[0] = False
        shm.unlink()


class SLOPreemptSignal:
    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self._owner = owner
        # Whether this process still has the segment's name to remove: the owner's until
        # unlink() or close(). A list, shared with the finalizer, so that unlink() tells it.
        self._name_held = [owner]
        # A one-element int64 view: reading the target is one memory load on the hot path.
        self._target = shm.buf[:8].cast("q")
        self._progress = shm.buf[_PROGRESS_AT:_PROGRESS_AT + 8].cast("q")
        self._progress_time = shm.buf[_PROGRESS_AT + 8:_PROGRESS_AT + 16].cast("d")
        # close() runs it; so does dropping the signal, or the interpreter's exit, for a holder
        # that never calls close(). It holds the SharedMemory, so SharedMemory.__del__ (which
        # closes the mapping whatever views remain) cannot run before the views are released.
        self._finalizer = weakref.finalize(
            self, _release, shm, (self._target, self._progress, self._progress_time),
            self._name_held)

    @classmethod
    def create(cls) -> SLOPreemptSignal:
        shm = shared_memory.SharedMemory(create=True, size=_PROGRESS_AT + 16)
        signal = cls(shm, owner=True)
        signal.publish(NO_TARGET, "", "", 0.0)
        return signal

    @classmethod
    def attach(cls, name: str) -> SLOPreemptSignal:
        if sys.version_info >= (3, 13):
            return cls(shared_memory.SharedMemory(name=name, track=False), owner=False)
        # Before 3.13 attaching registers the segment with this process's resource tracker:
        # a tracker of its own would unlink it at exit under the owner's feet, and
        # unregistering afterwards would drop the owner's entry from a tracker shared with it
        # (spawned children share their parent's). So do not register at all.
        register = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None
        try:
            shm = shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    def unlink(self) -> None:
        """The owner's: remove the segment's name now that every process that reads the signal
        has attached. The mapping stays valid in every process that has it, and nothing can
        attach any more; from here no way the processes end, SIGKILL included, leaves anything
        in /dev/shm. Idempotent; nothing for a process that only attached."""
        _unlink_name(self._shm, self._name_held)

    @property
    def target_step_id(self) -> int:
        return self._target[0]

    def publish(self, step_id: int, victim_id: str, waiter_id: str, decided_at: float) -> None:
        # Ids and time first, the step id last: a reader that sees the new target sees the ids
        # that go with it (x86 keeps stores in order; the monitor is the only writer).
        self._shm.buf[8:_LAYOUT.size] = _LAYOUT.pack(0, _pack_id(victim_id), _pack_id(waiter_id),
                                                     decided_at)[8:]
        self._target[0] = step_id

    def decision(self) -> tuple[int, str, str, float]:
        """(target step id, victim id, waiter id, decision time)."""
        step_id, victim, waiter, decided_at = _LAYOUT.unpack(bytes(self._shm.buf[:_LAYOUT.size]))
        return step_id, _unpack_id(victim), _unpack_id(waiter), decided_at

    def report_progress(self, step_id: int, layer: int, at: float | None = None) -> None:
        """The device finished the layers of `step_id` before `layer`, as of `at` (default:
        now)."""
        if layer < _MAX_LAYERS:
            self._progress_time[0] = time.monotonic() if at is None else at
            self._progress[0] = step_id * _MAX_LAYERS + layer

    def layers_done(self, step_id: int) -> int:
        """How many layers of `step_id` are done (0 when it has not reported yet)."""
        return self.progress(step_id)[0]

    def progress(self, step_id: int) -> tuple[int, float]:
        """(layers of `step_id` done, when that was reported); (0, 0.0) before any report."""
        word = self._progress[0]
        reported_at = self._progress_time[0]
        if word // _MAX_LAYERS != step_id:
            return 0, 0.0
        return word % _MAX_LAYERS, reported_at

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Idempotent: the first call releases the mapping, later ones do nothing."""
        self._finalizer()
