"""Paged attention (PyTorch reference) against dense attention over each request's full K/V."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import AttentionMetadata, paged_attention, write_kv_cache

HEAD_DIM = 32
NUM_BLOCKS = 64


@dataclass
class _Request:
    num_cached: int  # tokens whose K/V are already in the cache
    num_new: int  # tokens computed this step
    keys: torch.Tensor  # [num_cached + num_new, Hkv, D], the whole context
    values: torch.Tensor
    blocks: list[int]


def _make_requests(specs: list[tuple[int, int]], num_kv_heads: int, block_size: int,
                   dtype: torch.dtype, gen: torch.Generator) -> list[_Request]:
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # non-contiguous block ids
    requests = []
    for num_cached, num_new in specs:
        ctx = num_cached + num_new
        n_blocks = -(-ctx // block_size)
        blocks, free = free[:n_blocks], free[n_blocks:]
        keys = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        values = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        requests.append(_Request(num_cached, num_new, keys, values, blocks))
    return requests


def _slots(req: _Request, positions: range, block_size: int) -> list[int]:
    return [req.blocks[p // block_size] * block_size + p % block_size for p in positions]


def _build_step(requests: list[_Request], num_decodes: int,
                block_size: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata plus this step's new K/V, flattened in batch order."""
    slot_mapping: list[int] = []
    for req in requests:
        slot_mapping += _slots(req, range(req.num_cached, req.num_cached + req.num_new),
                               block_size)
    decodes, prefills = requests[:num_decodes], requests[num_decodes:]
    max_blocks = max((len(r.blocks) for r in decodes), default=1) + 2  # extra padding columns
    tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
    for i, req in enumerate(decodes):
        tables[i, :len(req.blocks)] = torch.tensor(req.blocks)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        num_decodes=num_decodes,
        decode_block_tables=tables,
        decode_context_lens=torch.tensor([r.num_cached + 1 for r in decodes], dtype=torch.long),
        prefill_query_lens=[r.num_new for r in prefills],
        prefill_context_lens=[r.num_cached + r.num_new for r in prefills],
        prefill_block_tables=[torch.tensor(r.blocks, dtype=torch.long) for r in prefills],
    )
    new_keys = torch.cat([r.keys[r.num_cached:] for r in requests])
    new_values = torch.cat([r.values[r.num_cached:] for r in requests])
    return meta, new_keys, new_values


def _dense_reference(query: torch.Tensor, requests: list[_Request], scale: float) -> torch.Tensor:
    """float64 attention from each request's full K/V, query i at position num_cached + i."""
    outs = []
    start = 0
    for req in requests:
        q = query[start:start + req.num_new].double()
        group = q.shape[1] // req.keys.shape[1]
        k = req.keys.double().repeat_interleave(group, dim=1)
        v = req.values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(req.num_cached, req.num_cached + req.num_new)
        visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
        start += req.num_new
    return torch.cat(outs)


def _run(specs: list[tuple[int, int]], num_decodes: int, num_heads: int, num_kv_heads: int,
         block_size: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    requests = _make_requests(specs, num_kv_heads, block_size, dtype, gen)
    # Stale values everywhere: any slot the kernel reads by mistake changes the result.
    key_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    value_cache = torch.randn(key_cache.shape, generator=gen).to(dtype)
    for req in requests:  # the cached prefix, as earlier steps would have left it
        slots = torch.tensor(_slots(req, range(req.num_cached), block_size), dtype=torch.long)
        key_cache.view(-1, num_kv_heads, HEAD_DIM)[slots] = req.keys[:req.num_cached]
        value_cache.view(-1, num_kv_heads, HEAD_DIM)[slots] = req.values[:req.num_cached]
    meta, new_keys, new_values = _build_step(requests, num_decodes, block_size)
    query = torch.randn(new_keys.shape[0], num_heads, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    write_kv_cache(new_keys, new_values, key_cache, value_cache, meta.slot_mapping)
    out = paged_attention(query, new_keys, new_values, key_cache, value_cache, meta, scale)
    return out, _dense_reference(query, requests, scale)


# (num_cached, num_new): decodes first (num_new == 1), then prefill chunks. Prefixes are not
# multiples of the block size; one chunk has no prefix, one is a single token after a prefix.
MIXED = [(0, 1), (16, 1), (40, 1), (77, 1), (130, 1),
         (0, 23), (37, 50), (5, 1), (64, 16), (100, 9)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mixed_batch_matches_dense(block_size: int, num_heads: int, num_kv_heads: int,
                                   dtype: torch.dtype, atol: float) -> None:
    out, ref = _run(MIXED, 5, num_heads, num_kv_heads, block_size, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_decode_only_and_prefill_only(num_heads: int, num_kv_heads: int) -> None:
    out, ref = _run([(3, 1), (50, 1), (15, 1)], 3, num_heads, num_kv_heads, 16, torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    out, ref = _run([(0, 40), (33, 31)], 0, num_heads, num_kv_heads, 16, torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_metadata_reused_across_layers() -> None:
    """The per-step plan is cached on the metadata: a second layer with other data must still be
    correct (the plan depends only on the metadata, never on a layer's tensors)."""
    gen = torch.Generator().manual_seed(1)
    requests = _make_requests([(20, 1), (0, 12), (18, 7)], 2, 16, torch.float32, gen)
    meta, new_keys, new_values = _build_step(requests, 1, 16)
    for layer in range(2):
        key_cache = torch.zeros(NUM_BLOCKS, 16, 2, HEAD_DIM)
        value_cache = torch.zeros_like(key_cache)
        for req in requests:
            req.keys = req.keys + layer
            req.values = req.values * (layer + 1)
            slots = torch.tensor(_slots(req, range(req.num_cached), 16), dtype=torch.long)
            key_cache.view(-1, 2, HEAD_DIM)[slots] = req.keys[:req.num_cached]
            value_cache.view(-1, 2, HEAD_DIM)[slots] = req.values[:req.num_cached]
        new_keys = torch.cat([r.keys[r.num_cached:] for r in requests])
        new_values = torch.cat([r.values[r.num_cached:] for r in requests])
        query = torch.randn(new_keys.shape[0], 4, HEAD_DIM, generator=gen)
        write_kv_cache(new_keys, new_values, key_cache, value_cache, meta.slot_mapping)
        out = paged_attention(query, new_keys, new_values, key_cache, value_cache, meta, 0.2)
        torch.testing.assert_close(out.double(), _dense_reference(query, requests, 0.2),
                                   atol=1e-5, rtol=0)
    assert "decode" in meta.derived


def test_write_kv_cache_puts_tokens_at_their_slots() -> None:
    key_cache = torch.zeros(4, 16, 2, 8)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(3, 2, 8)
    value = torch.randn(3, 2, 8)
    write_kv_cache(key, value, key_cache, value_cache, torch.tensor([5, 16 * 3 + 15, 20]))
    assert torch.equal(key_cache[0, 5], key[0]) and torch.equal(value_cache[0, 5], value[0])
    assert torch.equal(key_cache[3, 15], key[1]) and torch.equal(key_cache[1, 4], key[2])
    assert int((key_cache != 0).any(dim=(-1, -2)).sum()) == 3
