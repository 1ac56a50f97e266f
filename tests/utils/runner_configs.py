"""The configuration a test's model runner is built from (``ModelRunner(config, device)``), with
what the engine would resolve given here: a tiny model, a fixed KV pool, float32."""

from __future__ import annotations

from typing import Any

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.worker_messages import WorkerConfig
from workers.step_buffers import StepLimits


def runner_config(model_dir: str, *, num_blocks: int, block_size: int = 16,
                  limits: StepLimits | None = None, dtype: str = "float32",
                  device: str = "cpu", **model_settings: Any) -> WorkerConfig:
    """``limits``: the largest step the scheduler would hand over, which sizes the input buffers
    and the startup passes; left out, the smallest (the buffers grow with the steps: fine for
    tests, not for CUDA graphs). ``model_settings``: ModelConfig fields (attention_backend,
    fused_ops, enforce_eager, ...)."""
    limits = limits or StepLimits()
    engine = EngineConfig(
        model=ModelConfig(model=model_dir, dtype=dtype, device=device, **model_settings),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks or None),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(1, limits.max_num_tokens),
                                  max_num_seqs=max(1, limits.max_num_seqs)))
    return WorkerConfig(engine=engine, dtype=dtype, max_model_len=max(1, limits.max_model_len),
                        num_blocks=num_blocks)
