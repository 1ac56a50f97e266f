"""Worker ranks: rank 0 (the driver) takes steps from EngineCore and fans them out to the other
ranks (followers) over the gloo control group; every rank runs the forward pass on its shard, and
the driver samples and returns the result.

Every rank starts the same way (``Worker.start``: join, load, size the KV pool, warm up and
capture, vote, wait for the others), whichever executor (engine/executor/) drives it: spawned by
the multiprocess executor (the driver talks to EngineCore over a pipe), started by torchrun (the
driver lives in EngineCore's process), or the lone rank of the in-process executor, which joins
no process group.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from engine.compute_threads import compute_threads_for_rank, wait_policy
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.worker_messages import (ExecuteStep, KVPoolSize, Shutdown, WorkerConfig,
                                    decode_command, decode_config, encode)
from monitor.slo_preempt_signal import SLOPreemptSignal
from workers.distributed import (ParallelGroups, broadcast_bytes, collect_errors, destroy,
                                 init_distributed, report_error)
from workers.runner_release import collector_off, outlived, runner_probes

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Test hook: a folder where each rank writes, when it releases its runner at shutdown, which of
# the runner, its weights and its KV cache outlived the release, checked with the garbage
# collector off (tests/engine/test_engine_release.py). Set in the environment, so spawned ranks
# inherit
# it.
RELEASE_REPORT_ENV = "SLOSERVE_TEST_RELEASE_REPORT_DIR"


class Worker:
    """One rank: its process-group membership and a model runner over its weight shard.

    Built empty; ``start`` runs the startup sequence, the same for every kind of rank (a spawned
    TP rank, a torchrun rank, the lone rank of the in-process executor). A lone rank in
    EngineCore's process (``config.init_method`` empty) joins no process group: every
    distributed part of a step is then skipped."""

    def __init__(self, config: WorkerConfig, rank: int = 0, local_world_size: int | None = None,
                 local_rank: int | None = None, signal: SLOPreemptSignal | None = None) -> None:
        """``local_rank``: this rank's index on its machine (its GPU); spawned ranks all share
        one machine, so it defaults to ``rank``. Never read from the environment here: spawned
        ranks inherit their parent's, which may be a torchrun rank's. ``signal``: the preempt
        signal where this process maps it already (EngineCore's own, for the in-process rank;
        its owner closes it); other ranks attach to it by name."""
        self.config = config
        self.rank = rank
        self._local_world_size = local_world_size or config.tp_size
        self._local_rank = rank if local_rank is None else local_rank
        self._shared_signal = signal
        self.device = torch.device(config.engine.model.device)
        self.groups: ParallelGroups | None = None
        self.runner: ModelRunner | None = None
        self.num_kv_blocks = 0

    @property
    def distributed(self) -> bool:
        return bool(self.config.init_method)

    def start(self) -> None:
        """The startup sequence, in order. A step that fails on one rank writes its traceback
        where rank 0 can read it (workers.distributed) before it raises."""
        self.init_device()
        self._reporting_errors(self.load_model)
        self.size_kv_pool()
        self._reporting_errors(self.prepare_for_serving)
        self.install_vote()
        self.install_test_hooks()
        self.wait_for_peers()

    def init_device(self) -> None:
        """Set this rank's compute threads; take its GPU and join the process group (a lone
        in-process rank does neither: it runs on the configured device in EngineCore's
        process)."""
        self.set_compute_threads()
        if not self.distributed:
            return
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self._local_rank)
            torch.cuda.set_device(self.device)
        config = self.config
        self.groups = init_distributed(self.rank, config.tp_size, config.init_method,
                                       self.device, config.engine.collective_timeout_s)

    def set_compute_threads(self) -> None:
        """Threads that fit the machine (engine.compute_threads): oversubscribed OpenMP threads
        wait at every barrier for one that another process descheduled."""
        choice = compute_threads_for_rank(self.device.type, self._local_world_size,
                                          self.config.engine.cpu_threads)
        torch.set_num_threads(choice.threads)
        rank = f"rank {self.rank}: " if self.distributed else ""
        # Read back: what torch runs with, not what was asked.
        logger.info("%scompute threads: %d (%s); OpenMP wait policy: %s", rank,
                    torch.get_num_threads(), choice.why, wait_policy(os.environ))

    def load_model(self) -> None:
        """Build the runner: this rank's shard of the weights, and a KV pool of the configured
        size (empty until ``size_kv_pool`` where the workers measure it)."""
        from workers.model_runner import ModelRunner

        tp_group = self.groups.tensor_group if self.groups is not None else None
        self.runner = ModelRunner(self.config, self.device, rank=self.rank, tp_group=tp_group)
        self.num_kv_blocks = self.runner.num_kv_blocks

    def size_kv_pool(self) -> None:
        """Where the configuration left the pool open: measure what fits on this rank's GPU,
        agree with the other ranks on the smallest, and allocate it."""
        from workers.startup.kv_memory import measure_kv_pool

        plan = self.config.kv_pool_plan
        if plan is None:
            return
        runner = self._runner
        fits = self._reporting_errors(lambda: measure_kv_pool(runner, plan))
        runner.resize_kv_pool(self._agree_on_pool(fits))
        self.num_kv_blocks = runner.num_kv_blocks

    def prepare_for_serving(self) -> None:
        """The kernel warm-up and the graph capture (workers.startup.serving_startup)."""
        self._runner.prepare_for_serving()

    def install_test_hooks(self) -> None:
        """The tests' slow-layer and slow-machine hooks, where LAYER_DELAY_ENV and SLOWDOWN_ENV
        ask for them (in the environment, so every rank has them): after the startup passes,
        outside the model runner's code."""
        from workers.preemption.layer_delay import install_layer_delay
        from workers.preemption.slowdown import install_slowdown

        install_layer_delay(self._runner)
        install_slowdown(self._runner)

    def install_vote(self) -> None:
        """With SLO preemption, every rank votes (so every rank enters each
        collective); only ranks that can see EngineCore's shared memory read the signal, the
        others vote 0, as on another node."""
        from workers.preemption.slo_preempt_vote import SLOPreemptVote

        config = self.config
        if not config.engine.slo_preemption.enabled:
            return
        signal = self._shared_signal
        if signal is None and config.slo_preempt_signal_name and \
                self.rank < config.slo_preempt_signal_ranks:
            signal = SLOPreemptSignal.attach(config.slo_preempt_signal_name)
        cpu_group = self.groups.cpu_group if self.groups is not None and config.tp_size > 1 \
            else None
        runner = self._runner
        runner.install_vote(SLOPreemptVote(signal, runner.model.num_layers,
                                        config.engine.slo_preemption.stubborn_fraction, cpu_group))

    def wait_for_peers(self) -> None:
        """Nobody starts stepping before every shard is loaded (and a failed load on another
        rank surfaces here)."""
        if self.groups is None:
            return
        try:
            torch.distributed.barrier(group=self.groups.cpu_group)
        except Exception as exc:
            raise RuntimeError(_with_peer_errors(self.groups, traceback.format_exc())) from exc

    @property
    def joined(self) -> ParallelGroups:
        """The process groups of a rank that joined them (every rank but the in-process one)."""
        assert self.groups is not None, "this rank joined no process group"
        return self.groups

    @property
    def _runner(self) -> ModelRunner:
        assert self.runner is not None, "the worker has not loaded its model"
        return self.runner

    def _reporting_errors(self, step: Callable[[], T]) -> T:
        try:
            return step()
        except Exception:
            if self.groups is not None:
                report_error(self.groups, traceback.format_exc())
            raise

    def _agree_on_pool(self, fits: int) -> int:
        """Every rank holds the same blocks (one block table serves all shards): the smallest
        pool any rank's GPU has room for."""
        if self.groups is None:
            return fits
        blocks = torch.tensor([fits], dtype=torch.int64)
        try:
            torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN,
                                         group=self.groups.cpu_group)
        except Exception as exc:
            raise RuntimeError(_with_peer_errors(self.groups, traceback.format_exc())) from exc
        return int(blocks.item())

    def close_signal(self) -> None:
        """Unmap the preempt signal this rank attached (the owner, EngineCore, removes it). At
        shutdown, so that no view over it is left for the interpreter's exit to trip on. One
        EngineCore shares with this worker is its own to close."""
        vote = getattr(self.runner, "vote", None)
        if vote is not None and vote.signal is not None and vote.signal is not self._shared_signal:
            vote.signal.close()

    def release(self) -> None:
        """At shutdown: unmap the signal and drop the model runner. This is the last reference
        to it in the process and nothing it reaches refers back to it (workers.graphs.cuda_graphs),
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
    """Rank 0 of ranks in a process group. `execute_model` never raises: failures come back as a
    structured ERROR status."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            started = time.perf_counter()
            broadcast_bytes(encode(ExecuteStep(scheduler_output)), self.joined.cpu_group)
            transport_seconds = time.perf_counter() - started
            output = self._runner.execute(scheduler_output)
            output.transport_seconds = transport_seconds
            if output.status is StepStatus.SLO_PREEMPTED:
                self._check_unwound_together(output)
            return output
        except Exception:
            return ModelRunnerOutput(step_id=scheduler_output.step_id, status=StepStatus.ERROR,
                                     error=_with_peer_errors(self.joined, traceback.format_exc()))

    def _check_unwound_together(self, output: ModelRunnerOutput) -> None:
        """Every rank must have stopped before the same layer (the all_reduce makes them agree;
        a rank that did not would desynchronise every later collective): read the layer each
        follower reported and fail the step loudly if they differ."""
        layers = [output.slo_preempted_layer]
        for rank in range(1, self.joined.world_size):
            key = _unwound_key(output.step_id, rank)
            layers.append(int(self.joined.store.get(key)))
            self.joined.store.delete_key(key)
        output.unwound_layers = [layer for layer in layers if layer is not None]
        if len(set(layers)) != 1:
            output.status = StepStatus.ERROR
            output.error = f"step {output.step_id}: ranks unwound at different layers {layers}"

    def shutdown(self) -> None:
        try:
            broadcast_bytes(encode(Shutdown()), self.joined.cpu_group)
        except Exception:  # a broken group: the followers are gone or will time out
            destroy()
        else:
            destroy(self.joined)
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
            command = decode_command(broadcast_bytes(None, worker.joined.cpu_group))
        except Exception:
            print(f"sloserve worker rank {worker.rank}: lost rank 0; exiting", file=sys.stderr)
            return 1
        if isinstance(command, Shutdown):
            destroy(worker.joined)
            return 0
        try:
            output = worker._runner.execute(command.scheduler_output)
            if output.status is StepStatus.SLO_PREEMPTED:
                worker.joined.store.set(_unwound_key(output.step_id, worker.rank),
                                        str(output.slo_preempted_layer))
        except Exception:
            report_error(worker.joined, traceback.format_exc())
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
        worker.start()
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
