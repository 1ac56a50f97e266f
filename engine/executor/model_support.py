"""What EngineCore asks of the workers' model code while it resolves a configuration, before any
rank starts (engine.runtime.model_setup): whether the architecture and its quantization are
supported, which layers share a KV block table, and how many bytes a KV block takes."""

from __future__ import annotations

from typing import Any

import torch

from engine.core.kv_groups import KVCacheGroup, kv_cache_groups
from workers.kv_cache import kv_cache_bytes_per_block
from workers.models import get_model_class
from workers.quantization import check_quantization


def check_architecture(hf_config: Any, quantization: str | None = None,
                       device: torch.device | str = "cpu") -> None:
    """A ValueError naming the supported architectures where ``hf_config``'s is not one, and
    naming the quantization method or scheme where the checkpoint's ``quantization_config`` (or
    ``quantization``, the --quantization asked for) is not served, or ``device`` cannot run it
    (FP8 on a GPU older than compute capability 8.9)."""
    get_model_class(hf_config)
    check_quantization(hf_config, quantization, device)


def kv_cache_groups_of(hf_config: Any) -> list[KVCacheGroup]:
    """The model's KV cache groups (engine.core.kv_groups), from each layer's sliding window as
    its family reads the config: what the workers' model computes from the same function."""
    return kv_cache_groups(get_model_class(hf_config).sliding_windows(hf_config))


__all__ = ["check_architecture", "kv_cache_bytes_per_block", "kv_cache_groups_of"]
