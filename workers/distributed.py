"""torch.distributed set-up for TP workers, and the control channel between ranks.

Two process groups over the same ranks: the tensor group (NCCL on CUDA, gloo on CPU) carries the
model's all-reduces; a separate gloo group carries control traffic (step broadcasts, and the
preemption vote of a later milestone) so that it never queues behind device work.

Errors: a rank that fails writes its traceback into the rendezvous store before it leaves the group,
so rank 0, whose pending collective then fails, can report the real cause instead of
"connection closed by peer". The store is the one thing every node can reach.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take `group=group.WORLD`
# as a default argument, evaluated at import. Imported after init_process_group (transformers
# does so lazily inside AutoConfig.from_pretrained, which every worker calls after joining), the
# defaults pin the default group past destroy_process_group; gloo's threads then live until the
# interpreter's teardown, which kills them mid-flight and aborts the process with SIGABRT
# ("terminate called without an active exception") after a clean shutdown.
import torch.distributed.nn  # noqa: F401

_ERROR_KEY = "sloserve/error/{rank}"


@dataclass
class ParallelGroups:
    rank: int
    world_size: int
    tensor_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    store: dist.Store


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float) -> ParallelGroups:
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # DistNetworkError, DistStoreError, TimeoutError...
        raise RuntimeError(
            f"rank {rank} of {world_size}: could not join the process group at {init_method!r} "
            f"within {timeout_s:.0f} s ({type(exc).__name__}: {exc})") from exc
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    store = dist.distributed_c10d._get_default_store()
    return ParallelGroups(rank, world_size, dist.group.WORLD, cpu_group, store)


def broadcast_bytes(payload: bytes | None, group: dist.ProcessGroup, src: int = 0) -> bytes:
    """Rank `src` passes the payload; every rank returns it. Two small gloo broadcasts."""
    is_src = dist.get_rank() == src
    size = torch.tensor([len(payload) if is_src and payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    if is_src:
        buffer = torch.frombuffer(bytearray(payload or b""), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src, group=group)
    return payload if is_src and payload is not None else buffer.numpy().tobytes()


def report_error(groups: ParallelGroups, text: str) -> None:
    try:
        groups.store.set(_ERROR_KEY.format(rank=groups.rank), text)
    except Exception:  # the store host (rank 0) is gone: nobody is left to tell
        pass


def collect_errors(groups: ParallelGroups, wait_s: float = 3.0) -> dict[int, str]:
    """Tracebacks other ranks reported; waits briefly, since the failing rank may still be
    writing when our collective already broke."""
    keys = {r: _ERROR_KEY.format(rank=r) for r in range(groups.world_size) if r != groups.rank}
    found: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while True:
        for r, key in keys.items():
            if r not in found:
                try:
                    if groups.store.check([key]):
                        found[r] = groups.store.get(key).decode(errors="replace")
                except Exception:
                    pass
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def destroy(groups: ParallelGroups | None = None) -> None:
    """Leave the process group. With `groups`, an orderly exit: every rank passes a barrier
    first, so no rank tears its gloo connections down while a peer still reads from them."""
    if not dist.is_initialized():
        return
    if groups is not None:
        try:
            dist.barrier(group=groups.cpu_group)
        except Exception:  # a peer is already gone; nothing left to order against
            pass
    dist.destroy_process_group()
