"""Triton kernels against the PyTorch reference, in Triton's interpreter on CPU."""

from __future__ import annotations

import os

# Must be set before the kernels are decorated (on import).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import torch_attention  # noqa: E402

triton_cache = pytest.importorskip("kernels.triton_cache")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_write_matches_the_reference(dtype, head_dim, block_size):
    g = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks, num_kv_heads, num_tokens = 6, 3, 21
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    # Distinct slots scattered over the blocks, with one padding slot (-1) that writes nothing.
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[5] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    expected_k, expected_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    keep = slots >= 0
    torch_attention.write_kv_cache(key[keep], value[keep], expected_k, expected_v, slots[keep])
    got_k, got_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    triton_cache.write_kv_cache(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    # Probe: the padding token's vectors really are nowhere in the cache.
    assert not (got_k.view(-1, num_kv_heads, head_dim) == key[5]).all(-1).all(-1).any()


def test_kv_write_rejects_mismatched_shapes():
    key = torch.zeros(4, 3, 64)
    cache = torch.zeros(2, 16, 3, 80)
    with pytest.raises(ValueError, match="do not hold"):
        triton_cache.write_kv_cache(key, key, cache, cache, torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_cache.write_kv_cache(key, key, torch.zeros(2, 16, 3, 64),
                                    torch.zeros(2, 16, 3, 64), torch.arange(3))
