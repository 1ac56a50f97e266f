"""Host <-> device copies that cost the sampler no more device syncs than it needs.

A read of a device tensor's value on the host waits for everything queued on the device before
it; so does an ordinary (blocking) host-to-device copy, which PyTorch follows with a stream
synchronize. The sampler runs right after the forward pass, so every such wait stalls the host
for the rest of that pass and adds to the time per token. Hence two helpers:

- ``upload``: per-row parameters go up in ONE copy, from pinned memory and non-blocking on CUDA
  (the copy queues behind the forward pass instead of waiting for it; the caching host
  allocator keeps the pinned block alive until the copy has run);
- ``read_back``: the step's results come down in ONE transfer: every tensor flattened into a
  single float64 vector (exact for token ids, counts and float32 values alike), read with one
  ``tolist()``. ``start_read_back`` splits it in two: on CUDA the copy is queued into pinned
  host memory behind the work that computes the values, with an event after it, and
  ``PendingRead.values()`` waits for that event alone. With async scheduling the next step is
  queued on the device before this one's values are read, and a device or stream synchronize
  would wait for it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(columns: Sequence[Sequence[float]], device: torch.device | str) -> list[torch.Tensor]:
    """One float64 device tensor per column (cast on the device where another dtype is
    needed), all carried by a single host-to-device copy."""
    sizes = [len(column) for column in columns]
    host = torch.tensor([value for column in columns for value in column], dtype=torch.float64)
    return list(_to_device(host, torch.device(device)).split(sizes))


def upload_ids(ids: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Token ids as a long tensor on ``device``, without waiting for the device."""
    return _to_device(torch.tensor(list(ids), dtype=torch.long), torch.device(device))


def upload_tensor(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``, without waiting for the device."""
    return _to_device(host, torch.device(device))


def read_back(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values, flattened, as Python floats: one device-to-host transfer in all."""
    return start_read_back(tensors).values()


class PendingRead:
    """Values on their way to the host (``start_read_back``); ``values()`` waits for them."""

    def __init__(self, flat: torch.Tensor | None, sizes: list[int],
                 copied: torch.cuda.Event | None = None) -> None:
        # The flattened values: in pinned host memory when ``copied`` is set (the copy
        # completes with that event), else where the tensors were.
        self._flat = flat
        self._sizes = sizes
        self._copied = copied

    def values(self) -> list[list[float]]:
        """Each tensor's values, flattened, as Python floats (what ``read_back`` returns)."""
        if self._flat is None:
            return []
        if self._copied is not None:
            # The copy only: work queued after it (the next step) runs on.
            self._copied.synchronize()
        values = self._flat.tolist()
        out: list[list[float]] = []
        start = 0
        for size in self._sizes:
            out.append(values[start:start + size])
            start += size
        return out


def start_read_back(tensors: Sequence[torch.Tensor]) -> PendingRead:
    """Start the one transfer ``read_back`` makes; on CUDA it does not wait for the device."""
    if not tensors:
        return PendingRead(None, [])
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    sizes = [t.numel() for t in tensors]
    if flat.device.type != "cuda":
        # Computed already (the CPU), or read the ordinary way (no events to wait on).
        return PendingRead(flat, sizes)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    # Non-blocking into pinned memory: queued on the stream, the host goes on.
    host.copy_(flat, non_blocking=True)
    stream = torch.cuda.current_stream(flat.device)
    # Blocking: the thread that waits on it sleeps instead of spinning a core the monitor and
    # the HTTP front end need (as workers.preemption.run_ahead's events).
    copied = torch.cuda.Event(blocking=True)
    copied.record(stream)
    return PendingRead(host, sizes, copied)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
