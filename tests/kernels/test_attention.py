"""Paged attention (PyTorch reference) against dense attention over each request's full K/V."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, write_kv_cache
from tests.utils.attention_cases import (MIXED, MIXED_DECODES, NUM_BLOCKS, build_step,
                                    dense_reference, make_case, make_requests, slots)

HEAD_DIM = 32


def _run(specs: list[tuple[int, int]], num_decodes: int, num_heads: int, num_kv_heads: int,
         block_size: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    case = make_case(specs, num_decodes, num_heads, num_kv_heads, HEAD_DIM, block_size, dtype,
                     seed)
    out = paged_attention(case.query, case.new_keys, case.new_values, case.key_cache,
                          case.value_cache, case.meta, case.scale)
    return out, case.dense_reference()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mixed_batch_matches_dense(block_size: int, num_heads: int, num_kv_heads: int,
                                   dtype: torch.dtype, atol: float) -> None:
    out, ref = _run(MIXED, MIXED_DECODES, num_heads, num_kv_heads, block_size, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


def test_attention_writes_into_a_given_output() -> None:
    case = make_case(MIXED, MIXED_DECODES, 4, 2, HEAD_DIM, 16, torch.float32, 0)
    buffer = torch.full((case.query.shape[0] + 3, 4, HEAD_DIM), float("nan"))
    rows = buffer[:case.query.shape[0]]
    out = paged_attention(case.query, case.new_keys, case.new_values, case.key_cache,
                          case.value_cache, case.meta, case.scale, out=rows)
    assert out is rows and buffer[case.query.shape[0]:].isnan().all()
    torch.testing.assert_close(out.double(), case.dense_reference(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="out has shape"):
        paged_attention(case.query, case.new_keys, case.new_values, case.key_cache,
                        case.value_cache, case.meta, case.scale, out=buffer)


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
    requests = make_requests([(20, 1), (0, 12), (18, 7)], 2, HEAD_DIM, 16, torch.float32, gen)
    meta, new_keys, new_values = build_step(requests, 1, 16)
    for layer in range(2):
        key_cache = torch.zeros(NUM_BLOCKS, 16, 2, HEAD_DIM)
        value_cache = torch.zeros_like(key_cache)
        for req in requests:
            req.keys = req.keys + layer
            req.values = req.values * (layer + 1)
            cached = torch.tensor(slots(req, range(req.num_cached), 16), dtype=torch.long)
            key_cache.view(-1, 2, HEAD_DIM)[cached] = req.keys[:req.num_cached]
            value_cache.view(-1, 2, HEAD_DIM)[cached] = req.values[:req.num_cached]
        new_keys = torch.cat([r.keys[r.num_cached:] for r in requests])
        new_values = torch.cat([r.values[r.num_cached:] for r in requests])
        query = torch.randn(new_keys.shape[0], 4, HEAD_DIM, generator=gen)
        write_kv_cache(new_keys, new_values, key_cache, value_cache, meta.slot_mapping)
        out = paged_attention(query, new_keys, new_values, key_cache, value_cache, meta, 0.2)
        torch.testing.assert_close(out.double(), dense_reference(query, requests, 0.2),
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


# Decode contexts (cached tokens before the decoded one, block size 16): all equal and ending a
# block (no slot masked), all equal mid-block (only the last block's padding masked), ragged
# (the masked tail starts at the shortest context), one request.
DECODE_SHAPES = {"equal_full_blocks": [(31, 1)] * 4, "equal_mid_block": [(20, 1)] * 3,
                 "ragged": [(2, 1), (47, 1), (16, 1), (33, 1)], "single": [(70, 1)]}


# Group sizes 1, 3 and 4; 5 KV heads take the per-head products instead of the block-diagonal.
@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (9, 3), (8, 2), (10, 5)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_shapes_and_gqa_groups(shape: str, num_heads: int, num_kv_heads: int,
                                      dtype: torch.dtype, atol: float) -> None:
    specs = DECODE_SHAPES[shape]
    out, ref = _run(specs, len(specs), num_heads, num_kv_heads, 16, dtype, seed=3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (9, 3), (8, 2)])
def test_prefill_chunks_with_and_without_prefix(num_heads: int, num_kv_heads: int) -> None:
    out, ref = _run([(0, 37), (48, 16), (5, 40), (90, 1)], 0, num_heads, num_kv_heads, 16,
                    torch.float32, seed=4)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (10, 5)])
def test_nan_in_hidden_slots_does_not_leak(num_heads: int, num_kv_heads: int) -> None:
    """Slots past a context (the rest of its last block, the padding blocks) may hold NaN left by
    an earlier owner: they must not reach the output."""
    specs = [(2, 1), (40, 1), (20, 1), (5, 30)]
    case = make_case(specs, 3, num_heads, num_kv_heads, HEAD_DIM, 16, torch.float32, seed=5)
    for req in case.requests:
        ctx = req.num_cached + req.num_new
        hidden = slots(req, range(ctx, len(req.blocks) * 16), 16)
        case.key_cache.view(-1, num_kv_heads, HEAD_DIM)[hidden] = float("nan")
        case.value_cache.view(-1, num_kv_heads, HEAD_DIM)[hidden] = float("nan")
    # Block 0 pads the decode tables: poison it too when no request owns it.
    if all(0 not in r.blocks for r in case.requests):
        case.key_cache[0] = float("nan")
        case.value_cache[0] = float("nan")
    out = paged_attention(case.query, case.new_keys, case.new_values, case.key_cache,
                          case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), case.dense_reference(), atol=1e-5, rtol=0)
