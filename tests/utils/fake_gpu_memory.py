"""torch.cuda's memory accounting faked, so that the KV-pool measurement (workers/startup/kv_memory.py)
runs its real profile steps on the CPU's model runner."""

from __future__ import annotations

import torch

GIB = 2**30


class FakeGPUMemory:
    """What measure_kv_pool reads of torch.cuda, for a CPU that plays a GPU of `total` bytes
    with `free` bytes free once the profile has run. `profiles` counts the measurements (each
    one after its profile steps ran)."""

    def __init__(self, total: int = 80 * GIB, free: int = 70 * GIB) -> None:
        self.total, self.free, self.profiles = total, free, 0

    def install(self, monkeypatch) -> None:
        def max_memory_allocated(device=None) -> int:
            self.profiles += 1
            return 0

        for name, fake in (("synchronize", lambda device=None: None),
                           ("memory_allocated", lambda device=None: 0),
                           ("reset_peak_memory_stats", lambda device=None: None),
                           ("max_memory_allocated", max_memory_allocated),
                           ("empty_cache", lambda: None),
                           ("mem_get_info", lambda device=None: (self.free, self.total))):
            monkeypatch.setattr(torch.cuda, name, fake)


def play_a_gpu(monkeypatch, free: int = 70 * GIB) -> FakeGPUMemory:
    """The CPU engine as on a GPU: resolve() leaves the KV pool open (the workers measure it)
    and the memory accounting is faked, so the profile steps run for real on the CPU."""
    import dataclasses

    import engine.runtime.engine_core as engine_core

    real_resolve = engine_core.resolve
    monkeypatch.setattr(engine_core, "resolve", lambda config: dataclasses.replace(
        real_resolve(config), num_blocks=None))
    fake = FakeGPUMemory(free=free)
    fake.install(monkeypatch)
    return fake
