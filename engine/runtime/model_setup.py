"""Resolving what an EngineConfig leaves open: the HF config, dtype, max_model_len, pool size.

All of it is checked before any weights load, so bad configuration fails fast with a clear error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.config import (DEFAULT_CPU_KV_CACHE_GB, DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig,
                           EngineConfig, ModelConfig)
from engine.core.kv_groups import KVCacheGroup, pool_blocks_needed
from engine.model_folder import load_hf_config
from engine.simulation.profile import StepTimeProfile, load_profile
from kernels.backend import resolve_backend_name

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}


@dataclass
class ResolvedModel:
    model_dir: str
    hf_config: object
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    # None: the workers measure it on the GPU once the weights are loaded, and EngineCore
    # fills it in from the executor.
    num_blocks: int | None
    # --simulate: the step times that replace the model (engine/simulation).
    profile: StepTimeProfile | None = None
    # Which layers share a KV block table (engine.core.kv_groups); default: one group of all.
    kv_groups: list[KVCacheGroup] = field(default_factory=list)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        dtype, why = auto_dtype(device)
        logger.info("dtype auto -> %s: %s", str(dtype).removeprefix("torch."), why)
        return dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype: unknown {name!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    dtype = _DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not _supports_bf16(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"dtype bfloat16 needs a GPU of compute capability 8.0 or newer; this "
                         f"one is {major}.{minor}: use --dtype float16")
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_native_bf16()[0]:
        logger.warning("dtype bfloat16 on a CPU without native bf16 (%s): matmuls are emulated, "
                       "typically ~100x slower than float32", cpu_native_bf16()[1])
    return dtype


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """What ``--dtype auto`` picks on ``device``, and why (for the server log)."""
    if device.type == "cuda":
        if _supports_bf16(device):
            return torch.bfloat16, "GPUs from sm_80 on run bf16 natively"
        major, minor = torch.cuda.get_device_capability(device)
        return torch.float16, f"this GPU (sm_{major}{minor}) has no native bf16"
    native, why = cpu_native_bf16()
    if native:
        return torch.bfloat16, why
    return torch.float32, (f"{why}; PyTorch emulates bf16 matmuls there (~1 GFLOP/s against "
                           f"fp32's ~170 on an AVX2 CPU)")


# CPU features that run bf16 dot products in hardware: Intel AMX and AVX512-BF16 (x86), the
# Armv8.6 BF16 extension (Linux calls it "bf16").
_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def cpu_native_bf16(cpuinfo: str | None = None) -> tuple[bool, str]:
    """Whether this CPU runs bf16 matmuls natively, from its feature flags; and why.

    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` alone is not enough: it also says yes for
    plain AVX-512, where oneDNN converts to fp32 and gains nothing.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False, "this CPU's features are unknown (no /proc/cpuinfo)"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    found = [f for f in _NATIVE_BF16_FLAGS if f in flags]
    if not found:
        return False, "the CPU has no native bf16 (no AMX, no AVX512-BF16)"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, f"the CPU has {found[0]} but this PyTorch build's oneDNN cannot use it"
    return True, f"the CPU has {', '.join(found)}"


def _supports_bf16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(f"max_model_len: {requested} must be in [1, {limit}] for this model "
                         f"(its max_position_embeddings)")
    return requested


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype, tp_size: int = 1,
                       layers: int | None = None) -> int:
    """Bytes of one block of the pool: ``layers`` layers' keys and values (a KV cache group's;
    default: every layer) for ``block_size`` tokens, on one rank."""
    from engine.executor.model_support import kv_cache_bytes_per_block

    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    # Fewer KV heads than ranks: each rank holds a replica of one head.
    kv_heads_per_rank = max(1, num_kv_heads // tp_size)
    return kv_cache_bytes_per_block(layers or hf_config.num_hidden_layers, block_size,
                                    kv_heads_per_rank, head_dim, dtype)


def check_device(device: torch.device, tp_size: int, executor: str) -> None:
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA GPU is visible to this process (torch "
                         f"{torch.__version__} reports torch.cuda.is_available() == False)")
    # Ranks spawned here take GPUs 0..tp_size-1; torchrun's ranks may sit on other nodes (each
    # checks its own node: engine.runtime.launch.check_torchrun_gpus).
    count = torch.cuda.device_count()
    if executor != "external" and tp_size > count:
        raise ValueError(f"tensor_parallel_size {tp_size} needs {tp_size} GPUs on this machine; "
                         f"{count} {'is' if count == 1 else 'are'} visible (rank r takes GPU "
                         f"r): lower --tensor-parallel-size to at most {count}, or run on the "
                         f"CPU with --device cpu")


def check_tensor_parallel(hf_config, tp_size: int) -> None:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {heads} "
                         f"attention heads; choose a divisor of {heads}")
    # KV heads are split when there are enough, else each is replicated on tp_size/kv_heads ranks.
    if (kv_heads >= tp_size and kv_heads % tp_size) or (kv_heads < tp_size and tp_size % kv_heads):
        raise ValueError(f"tensor_parallel_size {tp_size} and the model's {kv_heads} KV heads: "
                         f"one must divide the other")
    # Dense MLPs, every expert of a mixture and a shared expert are split over the ranks along
    # their intermediate dimension.
    for name in ("intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size"):
        intermediate = getattr(hf_config, name, None) or tp_size
        if intermediate % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's "
                             f"{name} {intermediate}")


def check_tokenizer(model: ModelConfig) -> None:
    from engine.processing.input_processor import has_tokenizer

    if model.tokenizer is not None and not has_tokenizer(model.tokenizer):
        raise ValueError(f"tokenizer: {model.tokenizer!r} is not a local tokenizer folder (no "
                         f"tokenizer.json, tokenizer.model or tokenizer_config.json); sloserve "
                         f"never downloads from a model hub")
    if model.chat_template is not None and not has_tokenizer(model.tokenizer or model.model):
        raise ValueError(f"a chat template needs a tokenizer, and the model folder "
                         f"{model.model!r} has none: give a tokenizer folder (--tokenizer)")


def resolve(config: EngineConfig) -> ResolvedModel:
    from engine.executor.model_support import check_architecture

    hf_config = load_hf_config(config.model.model)
    check_tokenizer(config.model)
    # Unsupported architectures and quantizations (FP8 on a GPU without it included) fail here,
    # before any weights load; a simulated model computes nothing on this machine's device.
    device = torch.device(config.model.device)
    check_architecture(hf_config, config.model.quantization,
                       "cpu" if config.model.simulate is not None else device)
    check_tensor_parallel(hf_config, config.tensor_parallel_size)
    check_device(device, config.tensor_parallel_size, config.distributed_executor)
    # A Triton request that cannot run here fails now, not in every worker after spawning.
    resolve_backend_name(device, config.model.attention_backend, config.model.fused_ops)
    cache = config.cache
    profile = None
    if config.model.simulate is not None:
        profile = simulated_profile(config, hf_config)
        # The simulated device's dtype (it sizes the KV pool); this CPU never computes in it.
        name = profile.dtype if config.model.dtype == "auto" else config.model.dtype
        if name not in _DTYPES:
            raise ValueError(f"dtype: unknown {name!r}; choose one of auto, "
                             f"{', '.join(sorted(_DTYPES))}")
        dtype = _DTYPES[name]
        if cache.num_blocks is None and cache.kv_cache_memory_gb is None:
            cache = replace(cache, kv_cache_memory_gb=profile.kv_cache_memory_gb)
    else:
        dtype = resolve_dtype(config.model.dtype, device)
    max_model_len = resolve_max_model_len(hf_config, config.model.max_model_len)
    from engine.executor.model_support import kv_cache_groups_of

    kv_groups = kv_cache_groups_of(hf_config)
    num_blocks = configured_num_blocks(
        cache, device, kv_bytes_per_block(hf_config, cache.block_size, dtype,
                                          config.tensor_parallel_size,
                                          layers=len(kv_groups[0].layers)))
    resolved = ResolvedModel(model_dir=str(config.model.model), hf_config=hf_config, dtype=dtype,
                             device=device, max_model_len=max_model_len, num_blocks=num_blocks,
                             profile=profile, kv_groups=kv_groups)
    if num_blocks is not None:
        check_pool_fits(resolved, config, measured=False)
    return resolved


def simulated_profile(config: EngineConfig, hf_config) -> StepTimeProfile:
    """The profile `--simulate` names, checked against the model folder it stands in for."""
    assert config.model.simulate is not None
    profile = load_profile(config.model.simulate, hf_config.num_hidden_layers)
    if profile.num_layers != hf_config.num_hidden_layers:
        raise ValueError(f"simulate: profile {profile.name!r} times a {profile.num_layers}-layer "
                         f"model but {config.model.model!r} has {hf_config.num_hidden_layers} "
                         f"layers: serve a model folder of the profile's shape "
                         f"(sloserve bench shape)")
    if config.tensor_parallel_size != 1:
        raise ValueError("simulate: the simulation runs in one process (a profile's step times "
                         "include its tensor parallelism): leave tensor_parallel_size at 1")
    return profile


def gpu_memory_utilization(cache: CacheConfig) -> float:
    if cache.gpu_memory_utilization is None:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    return cache.gpu_memory_utilization


def configured_num_blocks(cache: CacheConfig, device: torch.device,
                          bytes_per_block: int) -> int | None:
    """The KV pool in blocks as the configuration sizes it; None on a GPU when neither
    num_blocks nor kv_cache_memory_gb is given: the workers then measure what fits."""
    if device.type == "cuda" and cache.num_blocks is None and cache.kv_cache_memory_gb is None:
        return None
    if cache.gpu_memory_utilization is not None:
        why = ("on a CPU the KV pool is kv_cache_memory_gb" if device.type == "cpu" else
               "num_kv_blocks or kv_cache_memory_gb sizes the KV pool")
        logger.info("gpu_memory_utilization %g has no effect: %s",
                    cache.gpu_memory_utilization, why)
    if cache.num_blocks is not None:
        return cache.num_blocks
    gb = DEFAULT_CPU_KV_CACHE_GB if cache.kv_cache_memory_gb is None else cache.kv_cache_memory_gb
    return int(gb * 2**30 // bytes_per_block)


def check_pool_fits(model: ResolvedModel, config: EngineConfig, measured: bool) -> None:
    """A ValueError unless one request of max_model_len tokens fits the pool (over every KV
    cache group: a sliding group holds its window and a chunk)."""
    cache, max_model_len, num_blocks = config.cache, model.max_model_len, model.num_blocks
    assert num_blocks is not None
    needed = pool_blocks_needed(model.kv_groups or [KVCacheGroup(())], max_model_len,
                                cache.block_size, config.scheduler.max_num_batched_tokens)
    if needed <= num_blocks:
        return
    more = (f"raise gpu_memory_utilization (now {gpu_memory_utilization(cache):g}) or free "
            f"memory on the GPU (the log shows how it was counted)" if measured else
            "give the KV cache more memory (kv_cache_memory_gb / num_blocks)")
    raise ValueError(
        f"max_model_len {max_model_len} needs {needed} KV blocks of {cache.block_size} tokens "
        f"but the pool has {num_blocks}; lower max_model_len, or {more}")
