"""Paged attention API, dispatched by device to an implementation.

KV cache layout, per layer: key_cache and value_cache of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at position p of a request lives in
slot ``block_ids[p // block_size] * block_size + p % block_size``.

A step's batch is flattened (no padding): the first ``num_decodes`` tokens are decodes (one query
token each, attending over their whole cached context), followed by prefill chunks (each causal
within the chunk and attending fully over its cached prefix).

Implementations: the PyTorch reference (``kernels.torch_attention``, the CPU default) and Triton
kernels (``kernels.triton_cache`` / ``kernels.triton_attention``, the CUDA default), chosen by
``kernels.backend.select_backend``; callers never import an implementation module directly.
"""

from __future__ import annotations

import torch

from kernels.backend import select_backend
from kernels.metadata import AttentionMetadata, padded_block_tables

__all__ = ["AttentionMetadata", "padded_block_tables", "paged_attention", "write_kv_cache"]


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values ([num_tokens, num_kv_heads, head_dim]) at their slots."""
    select_backend(key.device).write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, *,
                    sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a flattened mixed batch. query [T, Hq, D]; key/value [T, Hkv, D] are this
    step's new K/V (already written to the cache). Returns [T, Hq, D], written into ``out``
    when given (a CUDA graph's static buffer). GQA: Hq % Hkv == 0. ``sliding_window`` W: a
    query at position p sees the keys after p - W; ``softcap`` c: scores become
    ``c * tanh(s / c)`` (Gemma 2); ``sinks`` ([Hq] logits, gpt-oss): each head's softmax
    denominator also counts exp(its sink)."""
    return select_backend(query.device).paged_attention(
        query, key, value, key_cache, value_cache, meta, scale, out=out,
        sliding_window=sliding_window, softcap=softcap, sinks=sinks)
