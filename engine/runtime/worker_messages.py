"""Messages between EngineCore and the TP workers, msgpack-encoded with msgspec (never pickle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import msgspec

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.runtime.model_setup import ResolvedModel


class KVPoolPlan(msgspec.Struct, kw_only=True):
    """How the workers size the KV pool on a GPU once the weights are loaded (workers.kv_memory);
    every rank then takes the smallest pool any rank has room for."""

    gpu_memory_utilization: float
    # The profiled steps are the scheduler's largest.
    max_num_batched_tokens: int
    max_num_seqs: int
    # No profiled sequence is longer (nor is any step larger than max_num_seqs of them).
    max_model_len: int
    # Never more: max_num_seqs sequences of max_model_len tokens fill no more, and the scheduler
    # keeps a Python object per block (a tiny model on a large GPU would get millions).
    max_blocks: int


def kv_pool_plan(config: EngineConfig, model: ResolvedModel) -> KVPoolPlan | None:
    """The plan when the workers measure the pool; None when the configuration sized it."""
    from engine.runtime.model_setup import gpu_memory_utilization

    if model.num_blocks is not None:
        return None
    scheduler = config.scheduler
    return KVPoolPlan(gpu_memory_utilization=gpu_memory_utilization(config.cache),
                      max_num_batched_tokens=scheduler.max_num_batched_tokens,
                      max_num_seqs=scheduler.max_num_seqs,
                      max_model_len=model.max_model_len,
                      max_blocks=scheduler.max_num_seqs
                      * -(-model.max_model_len // config.cache.block_size))


class WorkerConfig(msgspec.Struct, kw_only=True):
    """Everything a worker rank needs to build its shard; identical on every rank but `rank`."""

    model_dir: str
    dtype: str
    device: str
    attention_backend: str = "auto"
    fused_ops: str = "auto"  # ModelConfig.fused_ops
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = 512
    load_format: str = "auto"
    # None: the workers measure the pool as kv_pool_plan says.
    num_blocks: int | None
    kv_pool_plan: KVPoolPlan | None = None
    block_size: int
    # The longest sequence and the most sequences a step can hold: the kernel warm-up
    # (workers.kernel_warmup) launches every variant such steps can need.
    max_model_len: int
    max_num_seqs: int
    # The most tokens a step holds (sizes the runner's input buffers; 0: they grow on demand).
    max_num_batched_tokens: int = 0
    seed: int
    tp_size: int
    # torch.distributed rendezvous: "tcp://host:port" or "env://" (torchrun).
    init_method: str
    collective_timeout_s: float = 60.0
    # Mid-forward preemption: every rank votes at every attention op of a preemptible step.
    mid_forward_preemption: bool = False
    stubborn_fraction: float = 0.9
    # Shared-memory signal EngineCore's monitor writes (None: no rank can read it, e.g. the
    # ranks torchrun starts on their own); ranks [0, preempt_signal_ranks) attach to it.
    preempt_signal_name: str | None = None
    preempt_signal_ranks: int = 0


def make_worker_config(config: EngineConfig, model: ResolvedModel, init_method: str = "",
                       preempt_signal_name: str | None = None) -> WorkerConfig:
    preemption = config.preemption
    signal_ranks = preemption.signal_ranks or config.tensor_parallel_size
    return WorkerConfig(
        mid_forward_preemption=preemption.mid_forward_preemption,
        stubborn_fraction=preemption.stubborn_fraction,
        preempt_signal_name=preempt_signal_name,
        preempt_signal_ranks=signal_ranks if preempt_signal_name else 0,
        model_dir=model.model_dir, dtype=config.model.dtype, device=config.model.device,
        attention_backend=config.model.attention_backend, fused_ops=config.model.fused_ops,
        enforce_eager=config.model.enforce_eager,
        max_cudagraph_capture_size=config.model.max_cudagraph_capture_size,
        load_format=config.model.load_format, num_blocks=model.num_blocks, kv_pool_plan=kv_pool_plan(config, model),
        block_size=config.cache.block_size, max_model_len=model.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens, seed=config.model.seed,
        tp_size=config.tensor_parallel_size, init_method=init_method,
        collective_timeout_s=config.collective_timeout_s)


class ExecuteStep(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class KVPoolSize(msgspec.Struct):
    """Rank 0 to EngineCore, after it is ready: the KV blocks every rank allocated."""

    num_blocks: int


WorkerCommand = Union[ExecuteStep, Shutdown]

_command_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(WorkerCommand)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
_config_decoder = msgspec.msgpack.Decoder(WorkerConfig)
_pool_decoder = msgspec.msgpack.Decoder(KVPoolSize)


def encode(message: msgspec.Struct) -> bytes:
    return _command_encoder.encode(message)


def decode_command(payload: bytes) -> WorkerCommand:
    return _command_decoder.decode(payload)


def decode_output(payload: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(payload)


def decode_config(payload: bytes) -> WorkerConfig:
    return _config_decoder.decode(payload)


def decode_pool_size(payload: bytes) -> KVPoolSize:
    return _pool_decoder.decode(payload)
