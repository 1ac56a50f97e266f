"""Reading a torchrun launch from the environment, and the checks every rank makes of it (world
size, a GPU per rank on its node). The ranks other than 0 run engine.executor.external's
run_follower."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunLaunch:
    rank: int
    world_size: int
    local_world_size: int
    # This rank's index on its node: its GPU.
    local_rank: int


def torchrun_launch() -> TorchrunLaunch | None:
    """The launch torchrun describes in the environment, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    return TorchrunLaunch(rank=rank, world_size=world,
                          local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                          local_rank=int(os.environ.get("LOCAL_RANK", rank)))


def check_torchrun_world(launch: TorchrunLaunch, tensor_parallel_size: int) -> None:
    if tensor_parallel_size != launch.world_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs {tensor_parallel_size} "
                         f"ranks but the torchrun world has {launch.world_size}; every torchrun "
                         f"rank is one tensor-parallel worker")


def check_torchrun_gpus(launch: TorchrunLaunch, device: str) -> None:
    """On a GPU every rank takes the GPU of its local rank: the ranks torchrun starts on this
    node must not outnumber the GPUs it has. Every rank checks, so every rank fails alike."""
    if device != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    if launch.local_world_size > count:
        raise ValueError(f"device 'cuda': torchrun starts {launch.local_world_size} ranks on "
                         f"this node, each on the GPU of its LOCAL_RANK, but {count} "
                         f"{'GPU is' if count == 1 else 'GPUs are'} visible: start at most "
                         f"{count} per node (--nproc-per-node), or run on the CPU with "
                         f"--device cpu")
