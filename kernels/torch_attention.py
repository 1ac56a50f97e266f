"""PyTorch reference for paged attention (the CPU implementation).

Decodes: all of a step's decodes in one batched computation over K/V gathered through their padded
block tables, written as two bmm calls instead of scaled_dot_product_attention: SDPA's bfloat16
CPU path is slow for one-row queries (measured here, 16 decodes x 512 context, 9/3 heads: ~6 ms
vs ~2 ms per layer; in float32 the two are on par). K/V are used as gathered, never copied
head-major or (float32 caches) upcast, into buffers reused by every layer of the step
(bench/diagnostics/cpu_attention.py prints the figures against the earlier head-major float32 copies).

Prefill chunks: one SDPA call each (SDPA is fast when the query has many rows).

A float32 model that the CPU's fused ops serve takes its decodes to ``kernels.cpu_fused`` instead
(one compiled loop over the paged cache, no gathered copy: 2-3x faster at one to sixteen
decodes), and its prefill chunks here (``attend_prefills``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

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
                    meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None,
                    sliding_window: int | None = None,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    if meta.device_layout is not None:
        # Its lengths live on the device; reading them here would stall every layer on it.
        raise ValueError("a device layout (a captured step's) is read by the Triton kernels "
                         "only; the PyTorch kernels take the host-side lengths")
    out = output_for(query, key_cache, out)
    num_decodes = meta.num_decodes
    if num_decodes > 0:
        out[:num_decodes] = _decode_attention(query[:num_decodes], key_cache, value_cache, meta,
                                              scale, sliding_window, softcap, sinks)
    attend_prefills(out, query, key, value, key_cache, value_cache, meta, scale, sliding_window,
                    softcap, sinks)
    return out


def output_for(query: torch.Tensor, key_cache: torch.Tensor,
               out: torch.Tensor | None) -> torch.Tensor:
    """``out``, or a new tensor of the query's shape, once the head counts are checked."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if out is None:
        return torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype,
                           device=query.device)
    if out.shape != query.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, the query {tuple(query.shape)}")
    return out


def attend_prefills(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> None:
    """The prefill chunks' attention (the rows after the decodes), into ``out``; with a
    ``sliding_window`` W, a query at position p sees the keys after p - W only (HF's
    sliding-window mask); with a ``softcap`` c, scores are ``c * tanh(scores / c)`` before the
    mask (Gemma 2); with ``sinks`` ([heads] logits: gpt-oss), each head's softmax denominator
    also counts exp(its sink), a key that holds no value."""
    start = meta.num_decodes
    for i, (q_len, ctx_len) in enumerate(zip(meta.prefill_query_lens, meta.prefill_context_lens)):
        end = start + q_len
        out[start:end] = _prefill_attention(query[start:end], key[start:end], value[start:end],
                                            key_cache, value_cache, meta, i, scale,
                                            sliding_window, softcap, sinks)
        start = end
    if start != query.shape[0]:
        raise ValueError(f"metadata covers {start} tokens but the batch has {query.shape[0]}")


# Decodes whose contexts differ by more than 2x go in separate groups (each padded only to its own
# longest context); contexts up to this many tokens all share the first group, where one
# product of a few hundred slots costs less than another group's calls.
_DECODE_GROUP_FLOOR = 256


class _DecodeGroup(NamedTuple):
    """Decodes computed together: their rows (None: all, in order), the block ids to gather
    (flattened [rows * n_blocks]), the gathered context length ctx (n_blocks * block_size),
    the shortest context, and a boolean mask [rows, ctx - shortest], true at the slots past
    each context."""

    rows: torch.Tensor | None
    block_ids: torch.Tensor
    ctx: int
    shortest: int
    hidden: torch.Tensor


def decode_groups(context_lens: list[int]) -> list[list[int]]:
    """Rows of a step's decodes grouped by context: ascending, a new group once a context is
    more than twice the group's first (and past _DECODE_GROUP_FLOOR). Padding every row to
    the longest context would make one 4000-token decode beside five 100-token ones cost six
    4000-token decodes (measured: 20-30x the grouped time on this CPU); grouped, each row
    costs at most twice its own context."""
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    groups: list[list[int]] = []
    first = 0
    for row in order:
        ctx = context_lens[row]
        if not groups or (ctx > 2 * first and ctx > _DECODE_GROUP_FLOOR):
            groups.append([])
            first = ctx
        groups[-1].append(row)
    return groups


def _decode_plan(meta: AttentionMetadata, block_size: int) -> list[_DecodeGroup]:
    """The step's decode groups (one, of every row, without host context lengths). Every slot
    below a group's shortest context is visible to all its rows, so only the tail needs
    masking (none but the last block's padding when all contexts are equal)."""
    plan = meta.derived.get("decode")
    if plan is None:
        lens = meta.decode_context_list
        groups = decode_groups(lens) if lens is not None else []
        if len(groups) <= 1:
            # Host ints from the metadata: no read-back from the device in the forward pass.
            plan = [_group(meta, None, meta.decode_max_context, meta.decode_min_context,
                           block_size)]
        else:
            assert lens is not None
            plan = [_group(meta, rows, max(lens[r] for r in rows), min(lens[r] for r in rows),
                           block_size) for rows in groups]
        meta.derived["decode"] = plan
    return plan


def _group(meta: AttentionMetadata, rows: list[int] | None, longest: int, shortest: int,
           block_size: int) -> _DecodeGroup:
    context_lens, tables = meta.decode_context_lens, meta.decode_block_tables
    index = None
    if rows is not None:
        index = torch.tensor(rows, dtype=torch.long, device=context_lens.device)
        context_lens, tables = context_lens[index], tables[index]
    # Trim the padded tables to the longest context: the padding would only be masked out.
    n_blocks = -(-longest // block_size)
    block_ids = tables[:, :n_blocks].reshape(-1)
    ctx = n_blocks * block_size
    tail = torch.arange(shortest, ctx, device=context_lens.device)
    return _DecodeGroup(index, block_ids, ctx, shortest, tail[None, :] >= context_lens[:, None])


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, meta: AttentionMetadata,
            name: str) -> torch.Tensor:
    """cache[block_ids] (contiguous: [len(block_ids), block_size, Hkv, D]), written into a
    buffer kept on the step's metadata so every layer reuses it: a fresh buffer this large
    is a fresh mmap whose page faults cost more than the copy (measured here, 64 x 2000
    decodes' 98 MB of K: ~250 ms to first-touch a fresh tensor vs ~56 ms for the whole gather
    into a reused one). The layers run one after another and nothing returned aliases it."""
    buf = meta.derived.get(name)
    if buf is None or buf.dtype != cache.dtype or buf.device != cache.device:
        buf = torch.empty((block_ids.numel(), *cache.shape[1:]), dtype=cache.dtype,
                          device=cache.device)
        meta.derived[name] = buf
    return torch.index_select(cache, 0, block_ids, out=buf)


# Block-diagonal products (below) do num_kv_heads times the FLOPs; past this many KV heads the
# per-head strided products are used instead.
_BLOCK_DIAGONAL_MAX_KV_HEADS = 4


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float,
                      sliding_window: int | None, softcap: float | None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    groups = _decode_plan(meta, key_cache.shape[1])
    if len(groups) == 1:
        return _decode_group(query, key_cache, value_cache, meta, scale, groups[0], "",
                             sliding_window, softcap, sinks)
    out = torch.empty_like(query)
    for i, plan in enumerate(groups):
        assert plan.rows is not None
        out[plan.rows] = _decode_group(query[plan.rows], key_cache, value_cache, meta, scale,
                                       plan, str(i), sliding_window, softcap, sinks)
    return out


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None,
                        head_dim: int = 1) -> torch.Tensor:
    """softmax over the last dim of float32 ``scores``, each head's (dim ``head_dim``) with
    its sink's logit beside its keys (gpt-oss: HF appends it as a last column, then drops
    that column's probability)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    shape = [1] * scores.dim()
    shape[head_dim] = -1
    column = sinks.float().view(shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def _window_start(meta: AttentionMetadata, plan: _DecodeGroup, window: int,
                  key: str) -> torch.Tensor | None:
    """A sliding window's mask [rows, ctx] of the slots before each decode's window (a decode
    at position p sees the keys after p - window), or None where every window covers its whole
    context."""
    if meta.decode_max_context <= window:
        return None
    masks = meta.derived.setdefault("decode_window", {})
    mask = masks.get((key, window))
    if mask is None:
        lens = meta.decode_context_lens if plan.rows is None else \
            meta.decode_context_lens[plan.rows]
        slots = torch.arange(plan.ctx, device=lens.device)
        mask = slots[None, :] < (lens[:, None] - window)
        masks[(key, window)] = mask
    return mask


def _decode_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, plan: _DecodeGroup,
                  buffer: str, sliding_window: int | None = None,
                  softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    _, block_ids, ctx, shortest, hidden = plan
    width = num_kv_heads * head_dim
    before = None if not sliding_window else _window_start(meta, plan, sliding_window, buffer)

    # K/V stay as gathered, [B, ctx, Hkv, D]: making them head-major would be one more copy of
    # all of them (the largest cost of the step). Each request's K is then one [ctx, Hkv * D]
    # matrix, and its query a block-diagonal [Hq, Hkv * D] one (query head h in the columns of
    # KV head h // group: HF's repeat_kv order), so one bmm gives every head's scores with K
    # read in place. Scores are float32 (K upcast only when the cache is not), as SDPA's fused
    # CPU kernel does, so bf16 results stay close to HF's sdpa attention.
    keys = _gather(key_cache, block_ids, meta, "decode_keys" + buffer).view(num_decodes, ctx,
                                                                             width)
    if keys.dtype != torch.float32:
        keys = keys.float()
    q = (query.to(torch.float32) * scale).view(num_decodes, num_kv_heads, group, head_dim)
    block_diagonal = num_kv_heads <= _BLOCK_DIAGONAL_MAX_KV_HEADS
    if block_diagonal:
        q_wide = query.new_zeros((num_decodes, num_kv_heads, group, num_kv_heads, head_dim),
                                 dtype=torch.float32)
        q_wide.diagonal(dim1=1, dim2=3).copy_(q.permute(0, 2, 3, 1))
        scores = torch.bmm(q_wide.view(num_decodes, num_heads, width), keys.transpose(1, 2))
    else:
        keys = keys.view(num_decodes, ctx, num_kv_heads, head_dim)
        scores = torch.stack([torch.bmm(q[:, h], keys[:, :, h].transpose(1, 2))
                              for h in range(num_kv_heads)], dim=1)
        scores = scores.view(num_decodes, num_heads, ctx)
    # The hidden slots hold whatever an earlier owner of the block left there, NaN included
    # (a request that failed with NaN logits): masked_fill, unlike adding -inf, replaces a NaN
    # score, and those slots' values are zeroed since 0 * NaN is still NaN.
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if shortest < ctx:
        scores[..., shortest:].masked_fill_(hidden[:, None, :], float("-inf"))
    if before is not None:
        scores.masked_fill_(before[:, None, :], float("-inf"))
    probs = _softmax_with_sinks(scores, sinks).to(query.dtype)

    values = _gather(value_cache, block_ids, meta, "decode_values" + buffer).view(
        num_decodes, ctx, num_kv_heads, head_dim)
    if shortest < ctx:
        values[:, shortest:].masked_fill_(hidden[:, :, None, None], 0.0)
    if before is not None:
        # The slots before a window may hold anything (a block reused since): 0 * NaN is NaN.
        values.masked_fill_(before[:, :, None, None], 0.0)
    if block_diagonal:
        # [B, Hq, Hkv * D]: head h's output is its own KV head's block of columns.
        wide = torch.bmm(probs, values.view(num_decodes, ctx, width))
        out = wide.view(num_decodes, num_kv_heads, group, num_kv_heads, head_dim).diagonal(
            dim1=1, dim2=3)  # [B, group, D, Hkv]
        return out.permute(0, 3, 1, 2).reshape(num_decodes, num_heads, head_dim)
    probs = probs.view(num_decodes, num_kv_heads, group, ctx)
    out = torch.stack([torch.bmm(probs[:, h], values[:, :, h]) for h in range(num_kv_heads)],
                      dim=1)
    return out.view(num_decodes, num_heads, head_dim)


def _prefill_plan(meta: AttentionMetadata, index: int, block_size: int,
                  sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block ids covering chunk `index`'s context from the first block its window reaches, the
    first position they hold, and the boolean offset-causal mask [q_len, ctx_len - first]:
    query i sits at position ctx_len - q_len + i and sees keys up to there (with a window W,
    only those after position - W). A window's earlier blocks are never read: a sliding layer's
    table may hold blocks given back since (engine.core.kv_groups)."""
    key = f"prefill{index}" + (f"w{sliding_window}" if sliding_window else "")
    plan = meta.derived.get(key)
    if plan is None:
        q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
        table = meta.prefill_block_tables[index]
        first_block = (max(0, ctx_len - q_len - sliding_window + 1) // block_size
                       if sliding_window else 0)
        first = first_block * block_size
        block_ids = table[first_block:-(-ctx_len // block_size)]
        rows = torch.arange(ctx_len - q_len, ctx_len, device=table.device)
        cols = torch.arange(first, ctx_len, device=table.device)
        visible = cols[None, :] <= rows[:, None]
        if sliding_window:
            visible &= cols[None, :] > rows[:, None] - sliding_window
        plan = (block_ids, visible, first)
        meta.derived[key] = plan
    return plan


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       meta: AttentionMetadata, index: int, scale: float,
                       sliding_window: int | None = None,
                       softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
    q = query.transpose(0, 1).unsqueeze(0)
    if sliding_window is not None and sliding_window >= ctx_len:
        sliding_window = None  # the window holds the whole context: plain causal attention
    if softcap or sinks is not None:
        return _scored_prefill(query, key, value, key_cache, value_cache, meta, index, scale,
                               sliding_window, softcap, sinks)
    if ctx_len == q_len and sliding_window is None:
        # No cached prefix: the chunk's own K/V is the whole context, plain causal attention.
        out = F.scaled_dot_product_attention(
            q, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True)
    else:
        # SDPA's is_causal aligns the diagonal top-left, which is wrong once keys outnumber
        # queries, so the offset-causal mask is explicit.
        block_ids, mask, first = _prefill_plan(meta, index, key_cache.shape[1], sliding_window)
        keys, values = _context_kv(key_cache, value_cache, block_ids, ctx_len - first)
        out = F.scaled_dot_product_attention(
            q, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _scored_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, index: int, scale: float,
                    sliding_window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """A chunk's attention from explicit scores, as HF's eager attention computes it (SDPA
    has neither): scores ``q.k * scale`` in float32, soft-capped (Gemma 2: ``softcap *
    tanh(scores / softcap)``), the mask, and the softmax with each head's sink (gpt-oss)."""
    q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
    _, block_size, num_kv_heads, _ = key_cache.shape
    block_ids, mask, first = _prefill_plan(meta, index, block_size, sliding_window)
    if ctx_len == q_len:
        keys, values = key, value  # no prefix: the window starts at the first block
    else:
        keys, values = _context_kv(key_cache, value_cache, block_ids, ctx_len - first)
    group = query.shape[1] // num_kv_heads
    q = query.transpose(0, 1).float()  # [H, q_len, D]
    k = keys.transpose(0, 1).float().repeat_interleave(group, dim=0)
    v = values.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = _softmax_with_sinks(scores, sinks, head_dim=0).to(query.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


def _context_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor,
                ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's whole context's K and V [ctx_len, Hkv, D], gathered through its blocks."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    keys = key_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:ctx_len]
    values = value_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:ctx_len]
    return keys, values
