"""Messages between EngineCore and the TP workers, msgpack-encoded with msgspec (never pickle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import msgspec

from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.runtime.model_setup import ResolvedModel


class WorkerConfig(msgspec.Struct, kw_only=True):
    """Everything a worker rank needs to build its shard; identical on every rank but `rank`."""

    model_dir: str
    dtype: str
    device: str
    attention_backend: str = "auto"
    fused_ops: bool = False
    num_blocks: int
    block_size: int
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
        num_blocks=model.num_blocks, block_size=config.cache.block_size, seed=config.model.seed,
        tp_size=config.tensor_parallel_size, init_method=init_method,
        collective_timeout_s=config.collective_timeout_s)


class ExecuteStep(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


WorkerCommand = Union[ExecuteStep, Shutdown]

_command_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(WorkerCommand)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
_config_decoder = msgspec.msgpack.Decoder(WorkerConfig)


def encode(message: msgspec.Struct) -> bytes:
    return _command_encoder.encode(message)


def decode_command(payload: bytes) -> WorkerCommand:
    return _command_decoder.decode(payload)


def decode_output(payload: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(payload)


def decode_config(payload: bytes) -> WorkerConfig:
    return _config_decoder.decode(payload)
