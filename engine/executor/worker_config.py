"""The ``WorkerConfig`` every rank is built from: the engine's configuration with what resolving
it fixed. EngineCore's executors build it (engine.executor.factory), and so do torchrun's other
ranks (engine.executor.external.run_follower), so every rank starts from the same one."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.runtime.model_setup import ResolvedModel, gpu_memory_utilization
from engine.worker_messages import KVPoolPlan, WorkerConfig


def worker_config(config: EngineConfig, model: ResolvedModel, init_method: str = "",
                  slo_preempt_signal_name: str | None = None) -> WorkerConfig:
    """``config`` with what resolving it fixed for every rank. ``init_method`` "": the one rank
    lives in this process and joins no process group."""
    return WorkerConfig(engine=config, dtype=str(model.dtype).removeprefix("torch."),
                        max_model_len=model.max_model_len, num_blocks=model.num_blocks,
                        kv_pool_plan=kv_pool_plan(config, model), init_method=init_method,
                        slo_preempt_signal_name=slo_preempt_signal_name)


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
