"""Which executor runs a configuration, and the ``WorkerConfig`` its ranks are built from.

EngineCore calls ``make_executor`` and nothing else here; torchrun's other ranks build their
``WorkerConfig`` with ``worker_config`` too (engine.executor.external.run_follower), so every
rank starts from the same one.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.runtime.launch import check_torchrun_gpus, check_torchrun_world, torchrun_launch
from engine.runtime.model_setup import ResolvedModel, gpu_memory_utilization
from engine.worker_messages import KVPoolPlan, WorkerConfig
from monitor.preempt_signal import PreemptSignal


def make_executor(config: EngineConfig, model: ResolvedModel,
                  signal: PreemptSignal | None) -> Executor:
    """The executor ``config`` asks for, its workers started (weights loaded, KV pool sized,
    warmed up, graphs captured, voting where ``signal`` is given)."""
    if model.profile is not None:
        return _simulated_executor(config, model, signal)
    kind = config.distributed_executor
    if kind == "auto":
        kind = "inproc" if config.tensor_parallel_size == 1 else "mp"
    signal_name = signal.name if signal is not None else None
    if kind == "inproc":
        from engine.executor.in_process import InProcessExecutor

        return InProcessExecutor(worker_config(config, model), signal)
    if kind == "mp":
        from engine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(worker_config(config, model, preempt_signal_name=signal_name))
    launch = torchrun_launch()
    if launch is None:
        raise ValueError("distributed_executor 'external' needs a torchrun launch "
                         "(RANK / WORLD_SIZE in the environment)")
    check_torchrun_world(launch, config.tensor_parallel_size)
    check_torchrun_gpus(launch, config.model.device)
    from engine.executor.external import ExternalExecutor

    return ExternalExecutor(worker_config(config, model, init_method="env://",
                                          preempt_signal_name=signal_name), launch)


def worker_config(config: EngineConfig, model: ResolvedModel, init_method: str = "",
                  preempt_signal_name: str | None = None) -> WorkerConfig:
    """``config`` with what resolving it fixed for every rank. ``init_method`` "": the one rank
    lives in this process and joins no process group."""
    return WorkerConfig(engine=config, dtype=str(model.dtype).removeprefix("torch."),
                        max_model_len=model.max_model_len, num_blocks=model.num_blocks,
                        kv_pool_plan=kv_pool_plan(config, model), init_method=init_method,
                        preempt_signal_name=preempt_signal_name)


def kv_pool_plan(config: EngineConfig, model: ResolvedModel) -> KVPoolPlan | None:
    """The plan when the workers measure the pool; None when the configuration sized it."""
    if model.num_blocks is not None:
        return None
    scheduler = config.scheduler
    return KVPoolPlan(gpu_memory_utilization=gpu_memory_utilization(config.cache),
                      max_num_batched_tokens=scheduler.max_num_batched_tokens,
                      max_num_seqs=scheduler.max_num_seqs,
                      max_model_len=model.max_model_len,
                      max_blocks=scheduler.max_num_seqs
                      * -(-model.max_model_len // config.cache.block_size))


def _simulated_executor(config: EngineConfig, model: ResolvedModel,
                        signal: PreemptSignal | None) -> Executor:
    from engine.executor.simulated import SimulatedExecutor
    from workers.preempt_vote import PreemptVote

    profile = model.profile
    assert profile is not None and model.num_blocks is not None
    vote = (PreemptVote(signal, profile.num_layers, config.preemption.stubborn_fraction)
            if signal is not None else None)
    eos = getattr(model.hf_config, "eos_token_id", None)
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return SimulatedExecutor(profile, model.num_blocks, model.hf_config.vocab_size, eos_ids, vote)
