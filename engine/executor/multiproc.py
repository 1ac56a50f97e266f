"""The multiprocess executor: `--tensor-parallel-size N` spawns N worker processes on this machine
(workers.worker.run_worker_process); rank 0 talks to EngineCore over a pipe."""

from __future__ import annotations

import logging
import multiprocessing
from multiprocessing.connection import wait

from engine.compute_threads import bounded_spin_for_children
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.ports import free_port
from engine.worker_messages import (ExecuteStep, Shutdown, WorkerConfig, decode_output,
                                   decode_pool_size, encode)

logger = logging.getLogger(__name__)


class WorkerStartupError(RuntimeError):
    pass


class MultiprocExecutor:
    """Spawns one process per TP rank. Rank 0 takes steps over a pipe and broadcasts them to the
    others; EngineCore watches every process, so a rank that dies fails the step at once instead
    of leaving EngineCore blocked."""

    def __init__(self, config: WorkerConfig, startup_timeout_s: float = 600.0) -> None:
        # Deferred, as every import of workers here: the model code loads only where it runs.
        from workers.worker import run_worker_process

        config.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        self._conn, driver_end = ctx.Pipe()
        payload = encode(config)
        self._procs = [
            ctx.Process(target=run_worker_process, name=f"sloserve-tp{rank}", daemon=True,
                        args=(payload, rank, driver_end if rank == 0 else None))
            for rank in range(config.tp_size)]
        with bounded_spin_for_children():  # read as each rank imports torch
            for proc in self._procs:
                proc.start()
        driver_end.close()
        self._step_timeout_s = config.engine.collective_timeout_s * 2
        ready = self._receive(step_id=0, timeout_s=startup_timeout_s)
        if ready.status is not StepStatus.OK:
            self.shutdown()
            raise WorkerStartupError(f"TP workers failed to start:\n{ready.error}")
        self.num_kv_blocks = decode_pool_size(self._conn.recv_bytes()).num_blocks  # sent next

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            self._conn.send_bytes(encode(ExecuteStep(scheduler_output)))
        except OSError:
            return self._failure(scheduler_output.step_id, "the rank 0 worker is gone")
        return self._receive(scheduler_output.step_id, self._step_timeout_s)

    def _receive(self, step_id: int, timeout_s: float) -> ModelRunnerOutput:
        sentinels = {proc.sentinel: proc for proc in self._procs}
        ready = wait([self._conn, *sentinels], timeout=timeout_s)
        if self._conn in ready or self._conn.poll(0):
            try:
                return decode_output(self._conn.recv_bytes())
            except EOFError:
                pass
        if not ready:
            return self._failure(step_id, f"no answer from the TP workers in {timeout_s:.0f} s")
        # A rank died.
        # Rank 0's collective breaks with it and it reports the peer's traceback
        # (when the peer had time to write one); give it a moment to do so.
        report = ""
        if self._conn.poll(5.0):
            try:
                answer = decode_output(self._conn.recv_bytes())
                report = answer.error or ""
            except EOFError:
                pass
        return self._failure(step_id, report)

    def _failure(self, step_id: int, reason: str) -> ModelRunnerOutput:
        dead = [f"worker rank {rank} exited with code {proc.exitcode}"
                for rank, proc in enumerate(self._procs) if proc.exitcode is not None]
        details = "; ".join(dead) if dead else "all worker processes are still alive"
        text = f"{details}\n{reason}" if reason else details
        return ModelRunnerOutput(step_id=step_id, status=StepStatus.ERROR, error=text)

    def shutdown(self) -> None:
        try:
            self._conn.send_bytes(encode(Shutdown()))
        except OSError:
            pass
        for proc in self._procs:
            proc.join(timeout=10)
        for rank, proc in enumerate(self._procs):
            # A worker that left after Shutdown exits 0; anything else (a crash in its teardown,
            # a hang) is worth a line even though the engine's work is done.
            if proc.exitcode not in (0, None):
                logger.warning("TP worker rank %d exited with code %s after shutdown", rank,
                               proc.exitcode)
            if proc.is_alive():
                logger.warning("TP worker rank %d did not exit within 10 s of shutdown; "
                               "terminating it", rank)
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conn.close()


