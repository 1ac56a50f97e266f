"""Reading a torchrun launch from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig


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


def run_follower(config: EngineConfig, launch: TorchrunLaunch) -> int:
    """A torchrun rank other than 0: load this rank's shard and run the steps rank 0 broadcasts.

    Every rank resolves the same configuration from the same arguments, so bad configuration
    fails on every rank before any weights load, and no configuration has to cross the network.
    """
    from engine.runtime.model_setup import resolve
    from engine.runtime.worker_messages import make_worker_config
    from workers.worker import Worker, follower_loop

    check_torchrun_world(launch, config.tensor_parallel_size)
    check_torchrun_gpus(launch, config.model.device)
    worker_config = make_worker_config(config, resolve(config), init_method="env://")
    worker = Worker(worker_config, launch.rank, launch.local_world_size, launch.local_rank)
    return follower_loop(worker)
