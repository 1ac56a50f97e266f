"""TP worker ranks: rank 0 (the driver) takes steps from EngineCore and fans them out to the
other ranks (followers) over the gloo control group; every rank runs the forward pass on its shard,
and the driver samples and returns the result.

The same two roles serve both launch modes: spawned by the multiprocess executor (the driver talks
to EngineCore over a pipe) and started by torchrun (the driver lives in EngineCore's process).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.runtime.worker_messages import (ExecuteStep, KVPoolSize, Shutdown, WorkerConfig,
                                            decode_command, decode_config, encode)
from workers.distributed import (ParallelGroups, broadcast_bytes, collect_errors, destroy,
                                 init_distributed, report_error)
from workers.kv_cache import num_kv_blocks, resized_kv_caches
from workers.runner_release import collector_off, outlived, runner_probes

# Test hook: a folder where each rank writes, when it releases its runner at shutdown, which of
# the runner, its weights and its KV cache outlived the release, checked with the garbage
# collector off (tests/test_engine_release.py). Set in the environment, so spawned ranks inherit
# it.
RELEASE_REPORT_ENV = "SLOSERVE_TEST_RELEASE_REPORT_DIR"


class Worker:
    """One rank: its process-group membership and a model runner over its weight shard."""

    def __init__(self, config: WorkerConfig, rank: int, local_world_size: int | None = None,
                 local_rank: int | None = None) -> None:
        """``local_rank``: this rank's index on its machine (its GPU); spawned ranks all share
        one machine, so it defaults to ``rank``. Never read from the environment here: spawned
        ranks inherit their parent's, which may be a torchrun rank's."""
        from engine.runtime.model_setup import load_hf_config, resolve_dtype
        from workers.kv_memory import measure_kv_pool
        from workers.model_runner import ModelRunner
        from workers.serving_startup import prepare_for_serving
        from workers.step_buffers import StepLimits

        # Ranks sharing a machine split its cores; oversubscribed OpenMP threads spin each other.
        local = local_world_size or config.tp_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        self.rank = rank
        device = torch.device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank if local_rank is None else local_rank)
            torch.cuda.set_device(device)
        self.groups: ParallelGroups = init_distributed(rank, config.tp_size, config.init_method,
                                                       device, config.collective_timeout_s)
        try:
            hf_config = load_hf_config(config.model_dir)
            # No pool size given: an empty pool until the GPU's memory is measured.
            self.runner = ModelRunner(config.model_dir, hf_config,
                                      resolve_dtype(config.dtype, device), device,
                                      config.num_blocks or 0, config.block_size,
                                      seed=config.seed, tp_rank=rank, tp_size=config.tp_size,
                                      tp_group=self.groups.tensor_group, sample=rank == 0,
                                      attention_backend=config.attention_backend,
                                      fused_ops=config.fused_ops,
                                      load_format=config.load_format,
                                      limits=StepLimits(config.max_num_batched_tokens,
                                                        config.max_num_seqs,
                                                        config.max_model_len),
                                      enforce_eager=config.enforce_eager,
                                      max_cudagraph_capture_size=(
                                          config.max_cudagraph_capture_size))
            fits = (None if config.kv_pool_plan is None
                    else measure_kv_pool(self.runner, config.kv_pool_plan))
        except Exception:
            report_error(self.groups, traceback.format_exc())
            raise
        if fits is not None:
            self.runner.kv_caches = resized_kv_caches(self.runner.kv_caches,
                                                      self._agree_on_pool(fits))
        self.num_kv_blocks = num_kv_blocks(self.runner.kv_caches)
        try:
            prepare_for_serving(self.runner, config.max_model_len, config.max_num_seqs,
                                config.tp_size)
        except Exception:
            report_error(self.groups, traceback.format_exc())
            raise
        if config.mid_forward_preemption:
            self._install_vote(config)
        # Nobody starts stepping before every shard is loaded (and a failed load surfaces here).
        try:
            torch.distributed.barrier(group=self.groups.cpu_group)
        except Exception as exc:
            raise RuntimeError(_with_peer_errors(self.groups, traceback.format_exc())) from exc


    def _agree_on_pool(self, fits: int) -> int:
        """Every rank holds the same blocks (one block table serves all shards): the smallest
        pool any rank's GPU has room for."""
        blocks = torch.tensor([fits], dtype=torch.int64)
        try:
            torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN,
                                         group=self.groups.cpu_group)
        except Exception as exc:
            raise RuntimeError(_with_peer_errors(self.groups, traceback.format_exc())) from exc
        return int(blocks.item())

    def _install_vote(self, config: WorkerConfig) -> None:
        """Every rank votes (so every rank enters each collective); only ranks that can see
        EngineCore's shared memory read the signal, the others vote 0, as on another node."""
        from monitor.preempt_signal import PreemptSignal
        from workers.preempt_vote import PreemptVote

        signal = None
        if config.preempt_signal_name and self.rank < config.preempt_signal_ranks:
            signal = PreemptSignal.attach(config.preempt_signal_name)
        cpu_group = self.groups.cpu_group if config.tp_size > 1 else None
        self.runner.vote = PreemptVote(signal, self.runner.model.num_layers,
                                       config.stubborn_fraction, cpu_group)

    def close_signal(self) -> None:
        """Unmap the preempt signal this rank attached (the owner, EngineCore, removes it). At
        shutdown, so that no view over it is left for the interpreter's exit to trip on."""
        vote = getattr(self.runner, "vote", None)
        if vote is not None and vote.signal is not None:
            vote.signal.close()

    def release(self) -> None:
        """At shutdown: unmap the signal and drop the model runner. This is the last reference
        to it in the process and nothing it reaches refers back to it (workers.cuda_graphs),
        so its weights, KV pool and graphs are freed here, not at the next garbage collection
        (torchrun's rank 0 lives on in EngineCore's process)."""
        self.close_signal()
        report_dir = os.environ.get(RELEASE_REPORT_ENV)
        if report_dir is not None and self.runner is not None:
            self._release_and_report(Path(report_dir))
        self.runner = None

    def _release_and_report(self, report_dir: Path) -> None:
        """RELEASE_REPORT_ENV: drop the runner with the collector off and write down what
        outlived it, and whether its graphs were captured and replayed (the test's probes)."""
        runner = self.runner
        report = {"rank": self.rank,
                  "graphs_captured": runner.graphs is not None and runner.piecewise is not None,
                  "replays": sum(graphs.replays for graphs in (runner.graphs, runner.piecewise)
                                 if graphs is not None)}
        probes = runner_probes(runner)
        del runner
        with collector_off():
            self.runner = None
            report.update(probed=sorted(probes), outlived=outlived(probes))
        (report_dir / f"rank{self.rank}.json").write_text(json.dumps(report))


class DriverWorker(Worker):
    """Rank 0. `execute_model` never raises: failures come back as a structured ERROR status."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            started = time.perf_counter()
            broadcast_bytes(encode(ExecuteStep(scheduler_output)), self.groups.cpu_group)
            transport_seconds = time.perf_counter() - started
            output = self.runner.execute(scheduler_output)
            output.transport_seconds = transport_seconds
            if output.status is StepStatus.PREEMPTED:
                self._check_unwound_together(output)
            return output
        except Exception:
            return ModelRunnerOutput(step_id=scheduler_output.step_id, status=StepStatus.ERROR,
                                     error=_with_peer_errors(self.groups, traceback.format_exc()))

    def _check_unwound_together(self, output: ModelRunnerOutput) -> None:
        """Every rank must have stopped before the same layer (the all_reduce makes them agree;
        a rank that did not would desynchronise every later collective): read the layer each
        follower reported and fail the step loudly if they differ."""
        layers = [output.preempted_layer]
        for rank in range(1, self.groups.world_size):
            key = _unwound_key(output.step_id, rank)
            layers.append(int(self.groups.store.get(key)))
            self.groups.store.delete_key(key)
        output.unwound_layers = [layer for layer in layers if layer is not None]
        if len(set(layers)) != 1:
            output.status = StepStatus.ERROR
            output.error = f"step {output.step_id}: ranks unwound at different layers {layers}"

    def shutdown(self) -> None:
        try:
            broadcast_bytes(encode(Shutdown()), self.groups.cpu_group)
        except Exception:  # a broken group: the followers are gone or will time out
            destroy()
        else:
            destroy(self.groups)
        finally:
            self.release()


def _with_peer_errors(groups: ParallelGroups, own: str) -> str:
    peers = collect_errors(groups)
    if not peers:
        return own
    parts = [f"--- rank {r} ---\n{text}" for r, text in sorted(peers.items())]
    return "a worker rank failed:\n" + "\n".join(parts) + f"\n--- rank 0 ---\n{own}"


def _unwound_key(step_id: int, rank: int) -> str:
    return f"sloserve/unwound/{step_id}/{rank}"


def follower_loop(worker: Worker) -> int:
    """Ranks 1..N-1: run every step rank 0 broadcasts until it says shut down."""
    try:
        return _follow(worker)
    finally:
        worker.release()


def _follow(worker: Worker) -> int:
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
            output = worker.runner.execute(command.scheduler_output)
            if output.status is StepStatus.PREEMPTED:
                worker.groups.store.set(_unwound_key(output.step_id, worker.rank),
                                        str(output.preempted_layer))
        except Exception:
            report_error(worker.groups, traceback.format_exc())
            traceback.print_exc()
            # Leaving the group breaks rank 0's pending collective at once, instead of at the
            # collective timeout.
            destroy()
            return 1


def run_worker_process(config_bytes: bytes, rank: int, conn: Connection | None) -> None:
    """Entry point of a process spawned by the multiprocess executor. Rank 0 gets `conn`."""
    from engine.log import configure_logging

    configure_logging()
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
    conn.send_bytes(encode(KVPoolSize(num_blocks=worker.num_kv_blocks)))
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
