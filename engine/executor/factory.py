"""Which executor runs a configuration: EngineCore calls ``make_executor`` and nothing else."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.runtime.launch import check_torchrun_gpus, check_torchrun_world, torchrun_launch
from engine.executor.worker_config import worker_config
from engine.runtime.model_setup import ResolvedModel
from monitor.slo_preempt_signal import SLOPreemptSignal


def make_executor(config: EngineConfig, model: ResolvedModel,
                  signal: SLOPreemptSignal | None) -> Executor:
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

        return MultiprocExecutor(worker_config(config, model, slo_preempt_signal_name=signal_name))
    launch = torchrun_launch()
    if launch is None:
        raise ValueError("distributed_executor 'external' needs a torchrun launch "
                         "(RANK / WORLD_SIZE in the environment)")
    check_torchrun_world(launch, config.tensor_parallel_size)
    check_torchrun_gpus(launch, config.model.device)
    from engine.executor.external import ExternalExecutor

    return ExternalExecutor(worker_config(config, model, init_method="env://",
                                          slo_preempt_signal_name=signal_name), launch)


def _simulated_executor(config: EngineConfig, model: ResolvedModel,
                        signal: SLOPreemptSignal | None) -> Executor:
    from engine.executor.simulated import SimulatedExecutor
    from workers.preemption.slo_preempt_vote import SLOPreemptVote

    profile = model.profile
    assert profile is not None and model.num_blocks is not None
    vote = (SLOPreemptVote(signal, profile.num_layers, config.slo_preemption.stubborn_fraction)
            if signal is not None else None)
    eos = getattr(model.hf_config, "eos_token_id", None)
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return SimulatedExecutor(profile, model.num_blocks, model.hf_config.vocab_size, eos_ids, vote)
