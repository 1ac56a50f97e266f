"""torchrun: every torchrun rank is a worker. Rank 0 (this process) hosts EngineCore and drives
the others through ``ExternalExecutor``; the other ranks run ``run_follower``.

The followers are torchrun's processes, which imported torch before sloserve ran: their OpenMP
wait policy is whatever torchrun's environment held (engine.compute_threads). Each sets its
threads, and its startup log asks for ``GOMP_SPINCOUNT=10000`` or ``OMP_WAIT_POLICY=PASSIVE``
in torchrun's environment where neither is set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.runtime.launch import TorchrunLaunch, check_torchrun_gpus, check_torchrun_world
from engine.worker_messages import WorkerConfig

if TYPE_CHECKING:
    from workers.worker import DriverWorker


class ExternalExecutor:
    """torchrun's rank 0: the driver worker lives in EngineCore's process."""

    def __init__(self, config: WorkerConfig, launch: TorchrunLaunch) -> None:
        # Deferred, as every import of workers here: the model code loads only where it runs.
        from workers.worker import DriverWorker

        self.driver: DriverWorker = DriverWorker(config, launch.rank, launch.local_world_size,
                                                 launch.local_rank)
        self.driver.start()
        self.num_kv_blocks = self.driver.num_kv_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.driver.shutdown()  # drops its runner (workers.worker.Worker.release)


def run_follower(config: EngineConfig, launch: TorchrunLaunch) -> int:
    """A torchrun rank other than 0: load this rank's shard and run the steps rank 0 broadcasts.

    Every rank resolves the same configuration from the same arguments, so bad configuration
    fails on every rank before any weights load, and no configuration has to cross the network.
    """
    from engine.executor.worker_config import worker_config
    from engine.runtime.model_setup import resolve
    from workers.worker import Worker, follower_loop

    check_torchrun_world(launch, config.tensor_parallel_size)
    check_torchrun_gpus(launch, config.model.device)
    worker = Worker(worker_config(config, resolve(config), init_method="env://"), launch.rank,
                    launch.local_world_size, launch.local_rank)
    worker.start()
    return follower_loop(worker)
