"""PyTorch reference for paged attention (the CPU implementation).

Decodes: all of a step's decodes in one batched computation over K/V gathered through their padded
block tables, written as two bmm calls instead of scaled_dot_product_attention: SDPA's bfloat16
CPU path is slow for one-row queries (measured here, 16 decodes x 512 context, 9/3 heads: ~6 ms
vs ~2 ms per layer; in float32 the two are on par). Scores are computed in float32 (K is upcast in
the copy that makes it head-major anyway), as SDPA's fused CPU kernel does, so bf16 results stay
close to HF's sdpa attention.

Prefill chunks: one SDPA call each (SDPA is fast when the query has many rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    num_decodes = meta.num_decodes
    if num_decodes > 0:
        out[:num_decodes] = _decode_attention(query[:num_decodes], key_cache, value_cache, meta,
                                              scale)
    start = num_decodes
    for i, (q_len, ctx_len) in enumerate(zip(meta.prefill_query_lens, meta.prefill_context_lens)):
        end = start + q_len
        out[start:end] = _prefill_attention(query[start:end], key[start:end], value[start:end],
                                            key_cache, value_cache, meta, i, scale)
        start = end
    if start != num_tokens:
        raise ValueError(f"metadata covers {start} tokens but the batch has {num_tokens}")
    return out


def _decode_plan(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids to gather (flattened [num_decodes * n_blocks]) and a boolean mask
    [num_decodes, n_blocks * block_size], true at the slots past each context."""
    plan = meta.derived.get("decode")
    if plan is None:
        context_lens = meta.decode_context_lens
        # Trim the padded tables to the longest context: the padding would only be masked out.
        n_blocks = -(-int(context_lens.max()) // block_size)
        block_ids = meta.decode_block_tables[:, :n_blocks].reshape(-1)
        slots = torch.arange(n_blocks * block_size, device=context_lens.device)
        plan = (block_ids, slots[None, :] >= context_lens[:, None])
        meta.derived["decode"] = plan
    return plan


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    block_ids, hidden = _decode_plan(meta, block_size)
    ctx = hidden.shape[-1]
    batch = num_decodes * num_kv_heads

    # [B, ctx, Hkv, D] as gathered; bmm wants one (request, kv head) pair per batch entry, so K
    # is made head-major, upcast to float32 in the same copy. (Keeping D innermost keeps this
    # copy row-wise; bmm then reads K transposed for free.)
    keys = key_cache.index_select(0, block_ids).view(num_decodes, ctx, num_kv_heads, head_dim)
    keys_f32 = torch.empty((num_decodes, num_kv_heads, ctx, head_dim), dtype=torch.float32,
                           device=query.device)
    keys_f32.copy_(keys.transpose(1, 2))
    # Query head h reads KV head h // group (HF's repeat_kv order), so the view groups them.
    q = (query.to(torch.float32) * scale).reshape(batch, group, head_dim)
    scores = torch.bmm(q, keys_f32.view(batch, ctx, head_dim).transpose(1, 2))
    # The hidden slots hold whatever an earlier owner of the block left there, NaN included
    # (a request that failed with NaN logits): masked_fill, unlike adding -inf, replaces a NaN
    # score, and those slots' values are zeroed since 0 * NaN is still NaN.
    scores = scores.view(num_decodes, num_heads, ctx).masked_fill_(hidden[:, None, :],
                                                                    float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)

    values = value_cache.index_select(0, block_ids).view(num_decodes, ctx, num_kv_heads, head_dim)
    values.masked_fill_(hidden[:, :, None, None], 0.0)
    values = values.transpose(1, 2).contiguous().view(batch, ctx, head_dim)
    out = torch.bmm(probs.view(batch, group, ctx), values)
    return out.view(num_decodes, num_heads, head_dim)


def _prefill_plan(meta: AttentionMetadata, index: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids covering chunk `index`'s context and its boolean offset-causal mask
    [q_len, ctx_len]: query i sits at position ctx_len - q_len + i and sees keys up to there."""
    key = f"prefill{index}"
    plan = meta.derived.get(key)
    if plan is None:
        q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
        table = meta.prefill_block_tables[index]
        block_ids = table[:-(-ctx_len // block_size)]
        rows = torch.arange(ctx_len - q_len, ctx_len, device=table.device)
        cols = torch.arange(ctx_len, device=table.device)
        plan = (block_ids, cols[None, :] <= rows[:, None])
        meta.derived[key] = plan
    return plan


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       meta: AttentionMetadata, index: int, scale: float) -> torch.Tensor:
    q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
    q = query.transpose(0, 1).unsqueeze(0)
    if ctx_len == q_len:
        # No cached prefix: the chunk's own K/V is the whole context, plain causal attention.
        out = F.scaled_dot_product_attention(
            q, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True)
    else:
        # SDPA's is_causal aligns the diagonal top-left, which is wrong once keys outnumber
        # queries, so the offset-causal mask is explicit.
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        block_ids, mask = _prefill_plan(meta, index, block_size)
        keys = key_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:ctx_len]
        values = value_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:ctx_len]
        out = F.scaled_dot_product_attention(
            q, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
