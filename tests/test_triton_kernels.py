"""Triton kernels against the PyTorch reference, in Triton's interpreter on CPU."""

from __future__ import annotations

import os

# Must be set before the kernels are decorated (on import).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import torch_attention  # noqa: E402
from tests.attention_cases import MIXED, MIXED_DECODES, Case, make_case  # noqa: E402

triton_cache = pytest.importorskip("kernels.triton_cache")
triton_attention = pytest.importorskip("kernels.triton_attention")


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


# Max |error| against the float64 dense reference. The PyTorch reference rounds the same inputs
# differently (bf16 probabilities against float32 ones in SDPA's prefill path), so both are held
# to the dense answer rather than to each other.
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _triton(case: Case, **kwargs) -> torch.Tensor:
    return triton_attention.paged_attention(case.query, case.new_keys, case.new_values,
                                            case.key_cache, case.value_cache, case.meta,
                                            case.scale, **kwargs)


def _check(case: Case, out: torch.Tensor, dtype: torch.dtype) -> None:
    dense = case.dense_reference()
    assert out.dtype == dtype and out.shape == dense.shape
    torch.testing.assert_close(out.double(), dense, atol=ATOL[dtype], rtol=0)
    reference = torch_attention.paged_attention(case.query, case.new_keys, case.new_values,
                                                case.key_cache, case.value_cache, case.meta,
                                                case.scale)
    # Same answer as the CPU implementation, to within both kernels' rounding.
    torch.testing.assert_close(out.double(), reference.double(), atol=2 * ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_batch_matches_the_references(dtype, head_dim, block_size, group):
    num_kv_heads = 2
    case = make_case(MIXED, MIXED_DECODES, num_kv_heads * group, num_kv_heads, head_dim,
                     block_size, dtype, seed=head_dim + block_size + group)
    _check(case, _triton(case), dtype)


@pytest.mark.parametrize("group", [1, 3])
def test_float32_is_exact_to_rounding(group):
    case = make_case(MIXED, MIXED_DECODES, 2 * group, 2, 64, 16, torch.float32)
    _check(case, _triton(case), torch.float32)


@pytest.mark.parametrize("num_kv_splits", [2, 3, 7])
@pytest.mark.parametrize("group", [1, 4])
def test_split_decodes_merge_to_the_same_answer(num_kv_splits, group):
    # Contexts from one token to several splits long, so some splits of the short ones see no key.
    specs = [(0, 1), (300, 1), (45, 1), (513, 1), (16, 1)]
    case = make_case(specs, len(specs), 2 * group, 2, 64, 16, torch.bfloat16, num_blocks=96)
    split = _triton(case, num_kv_splits=num_kv_splits)
    _check(case, split, torch.bfloat16)
    # Probe: the merged path really ran (a split launch differs from the unsplit one in rounding).
    unsplit = _triton(case, num_kv_splits=1)
    assert not torch.equal(split, unsplit)


def test_long_chunks_span_several_query_tiles():
    # 64-row prefill tiles: group 1 holds 64 tokens per tile, group 3 holds 21; the chunks below
    # cover 3+ tiles, with tile edges inside blocks and a prefix that ends mid-block.
    for group in (1, 3):
        case = make_case([(0, 150), (37, 140)], 0, 2 * group, 2, 64, 16, torch.float32,
                         num_blocks=64)
        _check(case, _triton(case), torch.float32)


def test_decode_only_and_prefill_only_batches():
    decodes = make_case([(3, 1), (50, 1)], 2, 6, 2, 64, 32, torch.float16)
    _check(decodes, _triton(decodes), torch.float16)
    prefills = make_case([(0, 40), (33, 31)], 0, 6, 2, 64, 32, torch.float16)
    _check(prefills, _triton(prefills), torch.float16)


def test_strided_query_view():
    # The model passes q as a view of the fused q/k tensor: heads are not the last contiguous run.
    case = make_case(MIXED, MIXED_DECODES, 4, 2, 64, 16, torch.float32)
    fused = torch.cat([case.query, torch.randn(case.query.shape[0], 2, 64)], dim=1)
    case.query = fused[:, :4]
    assert not case.query.is_contiguous()
    _check(case, _triton(case), torch.float32)


def test_attention_rejects_bad_inputs():
    case = make_case([(3, 1), (0, 5)], 1, 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_attention.paged_attention(case.query[:, :3], None, None, case.key_cache,
                                         case.value_cache, case.meta, case.scale)
    with pytest.raises(ValueError, match="covers 6 tokens"):
        triton_attention.paged_attention(case.query[:5], None, None, case.key_cache,
                                         case.value_cache, case.meta, case.scale)
    with pytest.raises(ValueError, match="cache dtype"):
        triton_attention.paged_attention(case.query.half(), None, None, case.key_cache,
                                         case.value_cache, case.meta, case.scale)
