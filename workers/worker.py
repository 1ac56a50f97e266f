"""TP worker ranks: rank 0 (the driver) takes steps from EngineCore and fans them out to the
other ranks (followers) over the gloo control group; every rank runs the forward pass on its shard,
and the driver samples and returns the result.

The same two roles serve both launch modes: spawned by the multiprocess executor (the driver talks
to EngineCore over a pipe) and started by torchrun (the driver lives in EngineCore's process).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch

from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.worker_messages import (ExecuteStep, Shutdown, WorkerConfig, decode_command,
                                    decode_config, encode)
from workers.distributed import (ParallelGroups, broadcast_bytes, collect_errors, destroy,
                                 init_distributed, report_error)


class Worker:
    """One rank: its process-group membership and a model runner over its weight shard."""

    def __init__(self, config: WorkerConfig, rank: int, local_world_size: int | None = None) -> None:
        from engine.model_setup import load_hf_config, resolve_dtype
        from workers.model_runner import ModelRunner

        # Ranks sharing a machine split its cores; oversubscribed OpenMP threads spin each other.
        local = local_world_size or config.tp_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        self.rank = rank
        device = torch.device(config.device)
        self.groups: ParallelGroups = init_distributed(rank, config.tp_size, config.init_method,
                                                       device, config.collective_timeout_s)
        try:
            hf_config = load_hf_config(config.model_dir)
            self.runner = ModelRunner(config.model_dir, hf_config,
                                      resolve_dtype(config.dtype, device), device,
                                      config.num_blocks, config.block_size, seed=config.seed,
                                      tp_rank=rank, tp_size=config.tp_size,
                                      tp_group=self.groups.tensor_group, sample=rank == 0)
        except Exception:
            report_error(self.groups, traceback.format_exc())
            raise
        # Nobody starts stepping before every shard is loaded (and a failed load surfaces here).
        try:
            torch.distributed.barrier(group=self.groups.cpu_group)
        except Exception as exc:
            raise RuntimeError(_with_peer_errors(self.groups, traceback.format_exc())) from exc


class DriverWorker(Worker):
    """Rank 0. `execute_model` never raises: failures come back as a structured ERROR status."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            started = time.perf_counter()
            broadcast_bytes(encode(ExecuteStep(scheduler_output)), self.groups.cpu_group)
            transport_seconds = time.perf_counter() - started
            output = self.runner.execute(scheduler_output)
            output.transport_seconds = transport_seconds
            return output
        except Exception:
            return ModelRunnerOutput(step_id=scheduler_output.step_id, status=StepStatus.ERROR,
                                     error=_with_peer_errors(self.groups, traceback.format_exc()))

    def shutdown(self) -> None:
        try:
            broadcast_bytes(encode(Shutdown()), self.groups.cpu_group)
        except Exception:  # a broken group: the followers are gone or will time out
            destroy()
            return
        destroy(self.groups)


def _with_peer_errors(groups: ParallelGroups, own: str) -> str:
    peers = collect_errors(groups)
    if not peers:
        return own
    parts = [f"--- rank {r} ---\n{text}" for r, text in sorted(peers.items())]
    return "a worker rank failed:\n" + "\n".join(parts) + f"\n--- rank 0 ---\n{own}"


def follower_loop(worker: Worker) -> int:
    """Ranks 1..N-1: run every step rank 0 broadcasts until it says shut down."""
    while True:
        try:
            command = decode_command(broadcast_bytes(None, worker.groups.cpu_group))
        except Exception:
            print(f"sloserve worker rank {worker.rank}: lost rank 0; exiting", file=sys.stderr)
            return 1
        if isinstance(command, Shutdown):
            destroy(worker.groups)
            return 0
        try:
            worker.runner.execute(command.scheduler_output)
        except Exception:
            report_error(worker.groups, traceback.format_exc())
            traceback.print_exc()
            # Leaving the group breaks rank 0's pending collective at once, instead of at the
            # collective timeout.
            destroy()
            return 1


def run_worker_process(config_bytes: bytes, rank: int, conn: Connection | None) -> None:
    """Entry point of a process spawned by the multiprocess executor. Rank 0 gets `conn`."""
    config = decode_config(config_bytes)
    try:
        worker = DriverWorker(config, rank) if rank == 0 else Worker(config, rank)
    except Exception:
        if conn is not None:
            conn.send_bytes(encode(ModelRunnerOutput(
                step_id=0, status=StepStatus.ERROR, error=traceback.format_exc())))
        time.sleep(0.5)  # let rank 0 read this rank's traceback from the store
        sys.exit(1)
    if conn is None:
        sys.exit(follower_loop(worker))
    assert isinstance(worker, DriverWorker)
    conn.send_bytes(encode(ModelRunnerOutput(step_id=0)))  # ready
    while True:
        try:
            command = decode_command(conn.recv_bytes())
        except EOFError:  # EngineCore is gone
            worker.shutdown()
            sys.exit(1)
        if isinstance(command, Shutdown):
            worker.shutdown()
            return
        conn.send_bytes(encode(worker.execute_model(command.scheduler_output)))
