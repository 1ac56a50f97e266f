"""Paged attention kernels: a PyTorch reference for the CPU; Triton kernels for CUDA (later)."""

from kernels.attention import AttentionMetadata, paged_attention, write_kv_cache

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
