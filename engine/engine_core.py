"""EngineCore: the busy loop schedule() -> execute -> update, over one scheduler and one executor."""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import EngineConfig
from engine.executor import Executor, ExternalExecutor, InProcessExecutor, MultiprocExecutor
from engine.input_processor import validate_prompt
from engine.launch import check_torchrun_world, torchrun_launch
from engine.model_setup import ResolvedModel, resolve
from engine.outputs import EngineCoreOutput
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.scheduler_output import StepStatus
from engine.worker_messages import make_worker_config


class EngineStepError(RuntimeError):
    """A worker failed to run a step; carries the worker's error text."""


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.model: ResolvedModel = resolve(config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.model.num_blocks,
                                   self.model.max_model_len)
        self.executor = executor if executor is not None else self._make_executor()
        self.dead: str | None = None

    def _in_process_executor(self) -> Executor:
        from workers.model_runner import ModelRunner

        m = self.model
        runner = ModelRunner(m.model_dir, m.hf_config, m.dtype, m.device, m.num_blocks,
                             self.config.cache.block_size, seed=self.config.model.seed)
        return InProcessExecutor(runner)

    def _make_executor(self) -> Executor:
        config = self.config
        kind = config.distributed_executor
        if kind == "auto":
            kind = "inproc" if config.tensor_parallel_size == 1 else "mp"
        if kind == "inproc":
            return self._in_process_executor()
        worker_config = make_worker_config(config, self.model)
        if kind == "mp":
            return MultiprocExecutor(worker_config)
        launch = torchrun_launch()
        if launch is None:
            raise ValueError("distributed_executor 'external' needs a torchrun launch "
                             "(RANK / WORLD_SIZE in the environment)")
        check_torchrun_world(launch, config.tensor_parallel_size)
        worker_config.init_method = "env://"
        return ExternalExecutor(worker_config, launch.rank, launch.local_world_size)

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model.hf_config.vocab_size

    def validate_request(self, request: Request) -> None:
        """Raises ValueError naming what is wrong with the prompt; changes nothing."""
        validate_prompt(request.prompt_token_ids, self.max_model_len, self.vocab_size)

    def add_request(self, request: Request) -> None:
        self.validate_request(request)
        request.max_model_len = self.max_model_len
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.abort_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns the requests that got a new token this step."""
        if self.dead is not None:
            raise EngineStepError(f"the engine stopped after a worker failure:\n{self.dead}")
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            # With nothing running, an empty step would repeat forever: fail loudly instead.
            if self.scheduler.num_running == 0:
                raise EngineStepError(
                    f"step {scheduler_output.step_id}: {self.scheduler.num_waiting} waiting "
                    f"requests but none could be admitted (KV pool or token budget too small)")
            return []
        runner_output = self.executor.execute_model(scheduler_output)
        if runner_output.status is not StepStatus.OK:
            # The group's collectives are out of step after a failure: shut it down rather than
            # risk a hang, and refuse further work.
            self.dead = f"step {scheduler_output.step_id} failed on a worker:\n{runner_output.error}"
            self.executor.shutdown()
            raise EngineStepError(self.dead)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        return [_core_output(r) for r in updated]

    def shutdown(self) -> None:
        if self.dead is None:
            self.executor.shutdown()


def _core_output(request: Request) -> EngineCoreOutput:
    finished = request.is_finished
    return EngineCoreOutput(
        req_id=request.request_id,
        new_token_ids=request.output_token_ids[-1:],
        finish_reason=request.status.finish_reason if finished else None,
        stop_reason=request.stop_reason if finished else None,
        num_preemptions=request.num_preemptions,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finish_time=request.finish_time,
    )
