"""Host <-> device copies that cost the sampler no more device syncs than it needs.

A read of a device tensor's value on the host waits for everything queued on the device before
it; so does an ordinary (blocking) host-to-device copy, which PyTorch follows with a stream
synchronize. The sampler runs right after the forward pass, so every such wait stalls the host
for the rest of that pass and adds to the time per token (issue 26). Hence two helpers:

- ``upload``: per-row parameters go up in ONE copy, from pinned memory and non-blocking on CUDA
  (the copy queues behind the forward pass instead of waiting for it; the caching host
  allocator keeps the pinned block alive until the copy has run);
- ``read_back``: the step's results come down in ONE transfer: every tensor flattened into a
  single float64 vector (exact for token ids, counts and float32 values alike), read with one
  ``tolist()``.
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
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    values = flat.tolist()
    out: list[list[float]] = []
    start = 0
    for tensor in tensors:
        out.append(values[start:start + tensor.numel()])
        start += tensor.numel()
    return out


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
