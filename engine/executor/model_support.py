"""What EngineCore asks of the workers' model code while it resolves a configuration, before any
rank starts (engine.runtime.model_setup): whether the architecture is supported, and how many
bytes a KV block takes."""

from __future__ import annotations

from typing import Any

from workers.kv_cache import kv_cache_bytes_per_block
from workers.models import get_model_class


def check_architecture(hf_config: Any) -> None:
    """A ValueError naming the supported architectures where ``hf_config``'s is not one."""
    get_model_class(hf_config)


__all__ = ["check_architecture", "kv_cache_bytes_per_block"]
