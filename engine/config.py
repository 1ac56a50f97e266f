"""Engine configuration, grouped by the component that reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

# Which running step the monitor may stop for a waiter: the monitor's own rule (its one home).
from monitor.policy import SLOPreemptPolicy

# slo: slack-EDF (docs/design.md section 5) for both the waiting queue and the running budget order.
SchedulingPolicy = Literal["fcfs", "priority", "slo"]
# What an SLO preemption does to its victim (docs/design.md section 4).
SLOPreemptMode = Literal["recompute", "pause", "suspend"]
# auto: in-process at TP=1, spawned worker processes above; external: ranks started by torchrun.
DistributedExecutor = Literal["auto", "mp", "external"]

# The KV pool where nothing sizes it (CacheConfig's None, resolved per device by
# engine.runtime.model_setup): this much on a CPU; on a GPU, what is left of vLLM's default share
# of its memory once the weights are loaded (workers.startup.kv_memory).
DEFAULT_CPU_KV_CACHE_GB = 1.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks; derived from kv_cache_memory_gb when None.
    num_blocks: int | None = None
    # None: DEFAULT_CPU_KV_CACHE_GB on a CPU; on a GPU, what gpu_memory_utilization leaves.
    kv_cache_memory_gb: float | None = None
    # vLLM's: on a GPU whose pool neither field above sizes, the share of its memory the engine
    # may fill; the pool gets what the weights and a profiled step leave of it. None:
    # DEFAULT_GPU_MEMORY_UTILIZATION.
    # No effect on a CPU.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # Fraction of blocks kept free when admitting a new request while others run.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None and not 0 < self.kv_cache_memory_gb < math.inf:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.gpu_memory_utilization is not None and \
                not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # Largest prefill chunk one request gets per step (0 = no limit beyond the budget).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # slo (the default) schedules exactly as fcfs while no request carries a deadline.
    policy: SchedulingPolicy = "slo"
    # slo policy: a request still waiting for its first token this long past its TTFT deadline
    # is aged (monitor.policy): it goes ahead of every other and its steps are never stopped.
    aging_bound_ms: float = 5000.0
    # Admit a request only if the whole sequence (prompt + max_tokens) fits in the free blocks.
    full_sequence_admission: bool = True
    # Schedule the next decode step while the device runs this one (engine.runtime.engine_core;
    # vLLM's --async-scheduling). Takes effect where steps run while the host goes on: a GPU
    # at TP=1, or --simulate (engine.executor.base.Overlapping.overlaps_host).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if not 0 <= self.aging_bound_ms < float("inf"):
            raise ValueError(f"aging_bound_ms must be a non-negative number, got "
                             f"{self.aging_bound_ms}")
        if self.policy not in ("fcfs", "priority", "slo"):
            raise ValueError(f"policy must be 'fcfs', 'priority' or 'slo', got {self.policy!r}")


@dataclass
class SLOPreemptionConfig:
    """SLO preemption (a forward pass stopped between layers): the slack-EDF monitor thread and
    the attention-op vote."""

    # Off (--slo-preemption off): no monitor, no vote; the slo policy still orders by slack at
    # step level.
    enabled: bool = True
    policy: SLOPreemptPolicy = "conservative"
    margin: float = 1.2
    # Rule 2: past this fraction of the layers a step is finished rather than thrown away.
    stubborn_fraction: float = 0.9
    # Steps with fewer prefill tokens do not vote: they end sooner than a preemption pays off.
    min_tokens: int = 128
    monitor_interval_ms: float = 2.0
    # suspend: zero wasted prefill work (the stopped pass resumes at its layer); pause and
    # recompute are the simpler modes of docs/design.md section 4.
    mode: SLOPreemptMode = "suspend"
    # JSON line from `sloserve calibrate`; None: fit online from the engine's own steps.
    ttft_model: str | None = None
    # Without ttft_model: time a few step shapes before serving (a few seconds at most) and
    # seed the online fit with them (engine/runtime/startup_calibration.py). Off: start from
    # the pessimistic default (tests that need an exact seed).
    startup_calibration: bool = True
    # The quantile of the TTFT predictor's recent relative errors that the monitor adds as a
    # safety margin before deciding that an urgent waiter can wait out the running step.
    predictor_error_quantile: float = 0.9
    # TP ranks [0, n) read the shared-memory signal; the others vote 0 and learn the outcome
    # from the all_reduce, as ranks on another node would. None: every rank (all local).
    signal_ranks: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("conservative", "aggressive"):
            raise ValueError(f"preempt policy must be 'conservative' or 'aggressive', "
                             f"got {self.policy!r}")
        if self.margin < 1.0:
            raise ValueError(f"preempt margin must be >= 1, got {self.margin}")
        if not 0.0 <= self.stubborn_fraction <= 1.0:
            raise ValueError(f"stubborn_fraction must be in [0, 1], got {self.stubborn_fraction}")
        if self.min_tokens < 0:
            raise ValueError(f"slo_preempt_min_tokens must be >= 0, got {self.min_tokens}")
        if self.monitor_interval_ms <= 0:
            raise ValueError(f"monitor_interval_ms must be > 0, got {self.monitor_interval_ms}")
        if self.mode not in ("recompute", "pause", "suspend"):
            raise ValueError(f"slo preempt mode must be 'recompute', 'pause' or 'suspend', got "
                             f"{self.mode!r}")
        if not 0.0 < self.predictor_error_quantile <= 1.0:
            raise ValueError(f"predictor_error_quantile must be in (0, 1], got "
                             f"{self.predictor_error_quantile}")
        if self.signal_ranks is not None and self.signal_ranks < 1:
            raise ValueError(f"signal_ranks must be >= 1, got {self.signal_ranks}")


@dataclass
class ModelConfig:
    # Local Hugging Face model folder (config.json + safetensors [+ tokenizer files]).
    model: str
    # "auto": bfloat16 on a CPU with native bf16 (AMX, AVX512-BF16) and on sm_80+ GPUs, float32 on
    # other CPUs (bf16 is emulated there, ~100x slower), float16 on older GPUs.
    dtype: str = "auto"
    # "cpu" or "cuda" (each TP rank takes the GPU of its local rank). "auto" (the default) is
    # resolved on construction: cuda when torch sees a GPU, else cpu (engine.device).
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    # Kernels: "auto" (Triton on CUDA, PyTorch on CPU), or force "torch" / "triton".
    attention_backend: str = "auto"
    # The Triton fused RMSNorm(+residual), rotary and SiLU-and-mul kernels: "auto" (on with the
    # Triton backend, off with PyTorch's), "on" (needs Triton) or "off". A bool means on/off.
    fused_ops: str = "auto"
    # vLLM's --enforce-eager: never replay CUDA graphs (workers.graphs.graph_shapes); every step runs
    # its kernels one launch at a time. No effect on the CPU, which has no graphs.
    enforce_eager: bool = False
    # vLLM's max_cudagraph_capture_size: the largest decode batch and the largest step (in
    # tokens) captured as CUDA graphs (workers.graphs.graph_shapes); larger ones run eager. Fewer
    # sizes: a faster startup and less graph memory.
    max_cudagraph_capture_size: int = 512
    # A local tokenizer folder other than the model's (vLLM's --tokenizer); None: the model's.
    tokenizer: str | None = None
    # Jinja text replacing the tokenizer's chat template (build_engine_config reads a file).
    chat_template: str | None = None
    # "auto": the folder's safetensors; "dummy": random weights drawn on the device (vLLM's
    # --load-format dummy: a model's shape from its config.json alone, for benchmarks).
    load_format: str = "auto"
    # A step-time profile (engine/simulation): run no model, every step takes the profile's
    # time. The name of a shipped profile, a profile file, or a calibration file.
    simulate: str | None = None
    # vLLM's --quantization: "fp8" quantizes a full-precision checkpoint's linear weights at
    # load (one scale per output channel; workers.quantization). None: the checkpoint decides
    # (an FP8 checkpoint's quantization_config is read whatever this says).
    quantization: str | None = None

    def __post_init__(self) -> None:
        from engine.device import resolve_device

        # Before anything reads it, and before the configuration reaches any other process.
        self.device = resolve_device(self.device, simulate=self.simulate is not None)
        if self.simulate is not None and self.device != "cpu":
            raise ValueError("simulate runs no model on any device: leave device as auto or cpu")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be >= 1, got "
                             f"{self.max_cudagraph_capture_size}")
        from kernels.backend import BACKENDS, fused_ops_setting

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.attention_backend!r}")
        self.fused_ops = fused_ops_setting(self.fused_ops)


ShutdownMode = Literal["abort", "wait"]


@dataclass(frozen=True)
class ShutdownConfig:
    """What the HTTP server does on SIGTERM (or when a fleet removes its replica):
    engine.serving.drain. Not an engine setting: EngineConfig does not carry it."""

    # "abort": in-flight requests end at once with an error (a stream with an error event).
    # "wait": drain: refuse new generation requests (503), let those in flight finish, then
    # stop; past `timeout_s` what is left is aborted.
    mode: ShutdownMode = "abort"
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in ("abort", "wait"):
            raise ValueError(f"shutdown mode must be abort or wait, got {self.mode!r}")
        if not (self.timeout_s >= 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"shutdown timeout must be a finite number of seconds >= 0, "
                             f"got {self.timeout_s}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    slo_preemption: SLOPreemptionConfig = field(default_factory=SLOPreemptionConfig)
    tensor_parallel_size: int = 1
    distributed_executor: DistributedExecutor = "auto"
    # Bound on any collective (and on joining the group): a dead rank cannot hang the engine.
    collective_timeout_s: float = 60.0
    # Each rank's torch threads (--cpu-threads); None: what fits the machine
    # (engine.compute_threads).
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or
                                             not isinstance(self.cpu_threads, int) or
                                             self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")
        if self.distributed_executor not in ("auto", "mp", "external"):
            raise ValueError(f"distributed_executor must be auto, mp or external, "
                             f"got {self.distributed_executor!r}")


def build_engine_config(model: str, *, dtype: str = ModelConfig.dtype,
                        device: str = ModelConfig.device,
                        attention_backend: str = ModelConfig.attention_backend,
                        fused_ops: str | bool = ModelConfig.fused_ops,
                        enforce_eager: bool = ModelConfig.enforce_eager,
                        max_cudagraph_capture_size: int = ModelConfig.max_cudagraph_capture_size,
                        tokenizer: str | None = ModelConfig.tokenizer,
                        chat_template: str | None = ModelConfig.chat_template,
                        load_format: str = ModelConfig.load_format,
                        simulate: str | None = ModelConfig.simulate,
                        quantization: str | None = ModelConfig.quantization,
                        max_model_len: int | None = ModelConfig.max_model_len,
                        block_size: int = CacheConfig.block_size,
                        num_kv_blocks: int | None = CacheConfig.num_blocks,
                        kv_cache_memory_gb: float | None = CacheConfig.kv_cache_memory_gb,
                        gpu_memory_utilization: float | None = CacheConfig.gpu_memory_utilization,
                        enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                        watermark: float = CacheConfig.watermark,
                        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                        max_num_seqs: int = SchedulerConfig.max_num_seqs,
                        long_prefill_token_threshold: int =
                        SchedulerConfig.long_prefill_token_threshold,
                        enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill,
                        scheduling_policy: str = SchedulerConfig.policy,
                        full_sequence_admission: bool = SchedulerConfig.full_sequence_admission,
                        aging_bound_ms: float = SchedulerConfig.aging_bound_ms,
                        async_scheduling: bool = SchedulerConfig.async_scheduling,
                        seed: int = ModelConfig.seed,
                        tensor_parallel_size: int = EngineConfig.tensor_parallel_size,
                        distributed_executor: str = EngineConfig.distributed_executor,
                        collective_timeout_s: float = EngineConfig.collective_timeout_s,
                        cpu_threads: int | None = EngineConfig.cpu_threads,
                        slo_preemption: bool = SLOPreemptionConfig.enabled,
                        slo_preempt_policy: str = SLOPreemptionConfig.policy,
                        slo_preempt_margin: float = SLOPreemptionConfig.margin,
                        stubborn_fraction: float = SLOPreemptionConfig.stubborn_fraction,
                        slo_preempt_min_tokens: int = SLOPreemptionConfig.min_tokens,
                        monitor_interval_ms: float = SLOPreemptionConfig.monitor_interval_ms,
                        slo_preempt_mode: str = SLOPreemptionConfig.mode,
                        ttft_model: str | None = SLOPreemptionConfig.ttft_model,
                        predictor_error_quantile: float =
                        SLOPreemptionConfig.predictor_error_quantile,
                        startup_calibration: bool = SLOPreemptionConfig.startup_calibration,
                        ) -> EngineConfig:
    """The flat engine arguments (as vLLM names them) grouped into an EngineConfig. Every
    default is the config dataclass field's own (defined there, once; the command line reads it
    from there too: engine.entrypoints.engine_args).
    ``chat_template``: a file path or the template itself (read and checked here)."""
    from engine.processing.chat_template import load_chat_template  # jinja2: only when needed

    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, device=device,
                          attention_backend=attention_backend, fused_ops=fused_ops,
                          enforce_eager=enforce_eager,
                          max_cudagraph_capture_size=max_cudagraph_capture_size,
                          max_model_len=max_model_len,
                          seed=seed, tokenizer=tokenizer, load_format=load_format,
                          simulate=simulate, quantization=quantization,
                          chat_template=None if chat_template is None
                          else load_chat_template(chat_template)),
        cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                          kv_cache_memory_gb=kv_cache_memory_gb,
                          gpu_memory_utilization=gpu_memory_utilization,
                          enable_prefix_caching=enable_prefix_caching, watermark=watermark),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs,
                                  long_prefill_token_threshold=long_prefill_token_threshold,
                                  enable_chunked_prefill=enable_chunked_prefill,
                                  policy=scheduling_policy,  # type: ignore[arg-type]
                                  full_sequence_admission=full_sequence_admission,
                                  aging_bound_ms=aging_bound_ms,
                                  async_scheduling=async_scheduling),
        slo_preemption=SLOPreemptionConfig(
            enabled=slo_preemption, policy=slo_preempt_policy,  # type: ignore[arg-type]
            margin=slo_preempt_margin, stubborn_fraction=stubborn_fraction,
            min_tokens=slo_preempt_min_tokens, monitor_interval_ms=monitor_interval_ms,
            mode=slo_preempt_mode,  # type: ignore[arg-type]
            ttft_model=ttft_model, predictor_error_quantile=predictor_error_quantile,
            startup_calibration=startup_calibration),
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor=distributed_executor,  # type: ignore[arg-type]
        collective_timeout_s=collective_timeout_s,
        cpu_threads=cpu_threads,
    )
