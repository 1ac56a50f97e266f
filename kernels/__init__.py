"""Paged attention and fused layer kernels: a PyTorch reference for the CPU, Triton for CUDA."""

from kernels.attention import (AttentionMetadata, paged_attention, padded_block_tables,
                               write_kv_cache)
from kernels.backend import KernelBackend, select_backend

__all__ = ["AttentionMetadata", "KernelBackend", "paged_attention", "padded_block_tables", "select_backend",
           "write_kv_cache"]
