"""Messages between EngineCore and the workers, msgpack-encoded with msgspec (never pickle),
and the configuration a worker rank is built from (``WorkerConfig``).

Below both the engine and the workers (tests/project/test_import_layers.py): the executors
(engine/executor/) send these, the workers (workers/worker.py) receive them.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any, Union

import msgspec

from engine.config import EngineConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class KVPoolPlan(msgspec.Struct, kw_only=True):
    """How the workers size the KV pool on a GPU once the weights are loaded (workers.startup.kv_memory);
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


class WorkerConfig(msgspec.Struct, kw_only=True):
    """EngineConfig as a worker rank sees it: the whole configuration (a rank reads what it
    needs, so a new setting is one field of EngineConfig and the code that reads it), what
    EngineCore resolved from it once for every rank, and where the ranks meet. Identical on
    every rank; crosses to spawned ranks msgpack-encoded."""

    engine: EngineConfig
    # What engine.runtime.model_setup resolved (the same on every rank): the dtype's name
    # (torch.<name>), the longest sequence, and the KV blocks (None: the workers measure the
    # pool as kv_pool_plan says).
    dtype: str
    max_model_len: int
    num_blocks: int | None
    kv_pool_plan: KVPoolPlan | None = None
    # torch.distributed rendezvous: "tcp://host:port" or "env://" (torchrun); "": one rank in
    # EngineCore's own process, which joins no process group.
    init_method: str = ""
    # Shared-memory signal EngineCore's monitor writes (None: no rank can read it, e.g. the
    # ranks torchrun starts on their own); ranks below slo_preempt_signal_ranks attach to it.
    slo_preempt_signal_name: str | None = None

    @property
    def tp_size(self) -> int:
        return self.engine.tensor_parallel_size

    @property
    def slo_preempt_signal_ranks(self) -> int:
        """How many ranks (from 0) read the signal; the others vote 0, as on another node."""
        if self.slo_preempt_signal_name is None:
            return 0
        return self.engine.slo_preemption.signal_ranks or self.tp_size


class ExecuteStep(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class KVPoolSize(msgspec.Struct):
    """Rank 0 to EngineCore, after it is ready: the KV blocks every rank allocated."""

    num_blocks: int


WorkerCommand = Union[ExecuteStep, Shutdown]

def _encode_path(obj: Any) -> Any:
    # ModelConfig.model may be a Path where a caller passed one; it crosses as its text.
    if isinstance(obj, PurePath):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_command_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_path)
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
