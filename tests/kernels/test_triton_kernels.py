"""Triton kernels against the PyTorch reference: in Triton's interpreter on the CPU, or compiled
on a GPU under TRITON_INTERPRET=0 (tests/utils/triton_device.py). Cases are built on the CPU; the
kernels get copies on the ``triton_device`` and their results come back for the comparison."""

from __future__ import annotations

# Must come before the kernels are decorated (on import): it picks interpreted or compiled.
import tests.utils.triton_device  # noqa: F401,I001

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import torch_attention, variants  # noqa: E402
from tests.utils.attention_cases import MIXED, MIXED_DECODES, make_case  # noqa: E402
from tests.utils.triton_attention_check import _triton, _check  # noqa: E402

# On a GPU, bench/suite/gpu_suite.sh's tests-triton-compiled step runs the tests marked gpu.
pytestmark = pytest.mark.gpu
from kernels import triton_attention, triton_cache  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_write_matches_the_reference(dtype, head_dim, block_size, triton_device):
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
    got_k = torch.zeros(shape, dtype=dtype, device=triton_device)
    got_v = torch.zeros(shape, dtype=dtype, device=triton_device)
    triton_cache.write_kv_cache(key.to(triton_device), value.to(triton_device), got_k, got_v,
                                slots.to(triton_device))
    got_k, got_v = got_k.cpu(), got_v.cpu()
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    # Probe: the padding token's vectors really are nowhere in the cache.
    assert not (got_k.view(-1, num_kv_heads, head_dim) == key[5]).all(-1).all(-1).any()


def test_kv_write_reads_strided_views_without_a_copy(triton_device):
    # The model's value is a slice of its fused qkv output; one-token batches included.
    g = torch.Generator().manual_seed(9)
    for num_tokens in (1, 5):
        qkv = torch.randn(num_tokens, 8, 64, generator=g).to(triton_device)
        key, value = qkv[:, 4:6], qkv[:, 6:]
        assert not value.is_contiguous() or num_tokens == 1
        shape = (4, 16, 2, 64)
        got_k = torch.zeros(shape, device=triton_device)
        got_v = torch.zeros(shape, device=triton_device)
        slots = torch.arange(3, 3 + num_tokens, device=triton_device)
        triton_cache.write_kv_cache(key, value, got_k, got_v, slots)
        expected_k, expected_v = torch.zeros(shape), torch.zeros(shape)
        torch_attention.write_kv_cache(key.cpu(), value.cpu(), expected_k, expected_v,
                                       slots.cpu())
        assert torch.equal(got_k.cpu(), expected_k) and torch.equal(got_v.cpu(), expected_v)
        assert got_v.abs().sum() > 0  # probe: something was written


def test_kv_write_rejects_mismatched_shapes(triton_device):
    key = torch.zeros(4, 3, 64, device=triton_device)
    cache = torch.zeros(2, 16, 3, 80, device=triton_device)
    slots = torch.arange(4, device=triton_device)
    with pytest.raises(ValueError, match="do not hold"):
        triton_cache.write_kv_cache(key, key, cache, cache, slots)
    cache = torch.zeros(2, 16, 3, 64, device=triton_device)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_cache.write_kv_cache(key, key, cache, cache, slots[:3])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_batch_matches_the_references(dtype, head_dim, block_size, group, triton_device):
    num_kv_heads = 2
    case = make_case(MIXED, MIXED_DECODES, num_kv_heads * group, num_kv_heads, head_dim,
                     block_size, dtype, seed=head_dim + block_size + group)
    _check(case, _triton(case, triton_device), dtype)


@pytest.mark.parametrize("group", [1, 3])
def test_float32_is_exact_to_rounding(group, triton_device):
    case = make_case(MIXED, MIXED_DECODES, 2 * group, 2, 64, 16, torch.float32)
    _check(case, _triton(case, triton_device), torch.float32)


@pytest.mark.parametrize("num_kv_splits", [2, 3, 7])
@pytest.mark.parametrize("group", [1, 4])
def test_split_decodes_merge_to_the_same_answer(num_kv_splits, group, triton_device):
    # Contexts from one token to several splits long, so some splits of the short ones see no key.
    specs = [(0, 1), (300, 1), (45, 1), (513, 1), (16, 1)]
    case = make_case(specs, len(specs), 2 * group, 2, 64, 16, torch.bfloat16, num_blocks=96)
    split = _triton(case, triton_device, num_kv_splits=num_kv_splits)
    _check(case, split, torch.bfloat16)
    # Probe: the merged path really ran (a split launch differs from the unsplit one in rounding).
    unsplit = _triton(case, triton_device, num_kv_splits=1)
    assert not torch.equal(split, unsplit)


def test_each_row_spreads_its_own_keys_over_a_plan_made_for_a_longer_context(triton_device,
                                                                             monkeypatch):
    # A CUDA graph captures the split decode once for max_model_len: 8 splits and block tables
    # as wide as 4096 keys, replayed for rows of any length (here 1, TILE_N - 1, TILE_N + 1 and
    # 700 keys). Each row must still share its keys among the splits, not pile them into the
    # first ones as a split length sized for 4096 keys (512) would.
    splits, planned = 8, 4096
    tile = triton_attention.DECODE_TILE_N
    contexts = [1, tile - 1, tile + 1, 700]
    case = make_case([(c - 1, 1) for c in contexts], len(contexts), 4, 2, 64, 16,
                     torch.bfloat16, seed=5)
    on = case.to(triton_device)
    width = planned // 16
    tables = on.meta.decode_block_tables
    wide = torch.zeros((len(contexts), width), dtype=torch.long, device=triton_device)
    wide[:, :tables.shape[1]] = tables
    # A copy: on the CPU `to` returns the case itself, whose metadata the reference reads.
    on = dataclasses.replace(on, meta=dataclasses.replace(
        on.meta, decode_block_tables=wide, decode_max_context=planned, decode_min_context=1))
    merged: list[torch.Tensor] = []
    launch = triton_attention.launch

    def spy(kernel, grid, *args, **constants):
        launch(kernel, grid, *args, **constants)
        if kernel is triton_attention._merge_splits_kernel:
            merged.append(args[2].cpu())  # the partial log-sum-exps, [token, head, split]

    monkeypatch.setattr(triton_attention, "launch", spy)
    with variants.recording() as seen:
        out = triton_attention.paged_attention(on.query, on.new_keys, on.new_values,
                                               on.key_cache, on.value_cache, on.meta, on.scale,
                                               num_kv_splits=splits).cpu()
    _check(case, out, torch.bfloat16)
    # Probe: one split launch of 8 programs per row, then the merge.
    attention = [v for v in seen if v.kernel == "_paged_attention_kernel"]
    assert [v.constant("SPLIT") for v in attention] == [True] and len(merged) == 1
    # Splits holding keys, per row: ceil(c / 8) keys rounded up to whole tiles each, so 1, 1, 2
    # and all 8 (a 512-key split would give 1, 1, 1, 2); the rest hold none and log -inf.
    lse = merged[0]
    assert lse.shape == (len(contexts), 4, splits)
    used = torch.isfinite(lse).sum(-1)
    assert used.tolist() == [[n] * 4 for n in (1, 1, 2, 8)]
    assert torch.isfinite(lse).all(-1).tolist() == [[False] * 4] * 3 + [[True] * 4]


def test_long_chunks_span_several_query_tiles(triton_device):
    # 64-row prefill tiles: group 1 holds 64 tokens per tile, group 3 holds 21; the chunks below
    # cover 3+ tiles, with tile edges inside blocks and a prefix that ends mid-block.
    for group in (1, 3):
        case = make_case([(0, 150), (37, 140)], 0, 2 * group, 2, 64, 16, torch.float32,
                         num_blocks=64)
        _check(case, _triton(case, triton_device), torch.float32)


def test_decode_only_and_prefill_only_batches(triton_device):
    decodes = make_case([(3, 1), (50, 1)], 2, 6, 2, 64, 32, torch.float16)
    _check(decodes, _triton(decodes, triton_device), torch.float16)
    prefills = make_case([(0, 40), (33, 31)], 0, 6, 2, 64, 32, torch.float16)
    _check(prefills, _triton(prefills, triton_device), torch.float16)


def test_strided_query_view(triton_device):
    # The model passes q as a view of the fused q/k tensor: heads are not the last contiguous run.
    case = make_case(MIXED, MIXED_DECODES, 4, 2, 64, 16, torch.float32)
    fused = torch.cat([case.query, torch.randn(case.query.shape[0], 2, 64)], dim=1)
    # Sliced on the device: copying a view there would make it contiguous.
    query = fused.to(triton_device)[:, :4]
    assert not query.is_contiguous()
    _check(case, _triton(case, triton_device, query=query), torch.float32)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_attention_writes_into_a_given_output(num_kv_splits, triton_device):
    """``out``: a static buffer's rows (the CUDA graph pieces' attention output), split decodes'
    merge included; a buffer of the wrong shape or dtype is refused."""
    case = make_case(MIXED, MIXED_DECODES, 4, 2, 64, 16, torch.float32)
    buffer = torch.full((case.query.shape[0] + 5, 4, 64), float("nan"), device=triton_device)
    rows = buffer[:case.query.shape[0]]
    returned = _triton(case, triton_device, num_kv_splits=num_kv_splits, out=rows)
    assert torch.equal(returned, rows.cpu())
    _check(case, rows.cpu(), torch.float32)
    assert buffer[case.query.shape[0]:].isnan().all()  # nothing written past the step's rows
    for wrong in (buffer[:3], rows.double()):
        with pytest.raises(ValueError, match="out is"):
            _triton(case, triton_device, out=wrong)


def test_split_counts_beyond_the_merge_width_are_refused(triton_device):
    case = make_case([(3, 1)], 1, 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="num_kv_splits 33 is outside 1..32"):
        _triton(case, triton_device, num_kv_splits=33)


def test_attention_rejects_bad_inputs(triton_device):
    case = make_case([(3, 1), (0, 5)], 1, 4, 2, 64, 16, torch.float32).to(triton_device)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_attention.paged_attention(case.query[:, :3], None, None, case.key_cache,
                                         case.value_cache, case.meta, case.scale)
    with pytest.raises(ValueError, match="covers 6 tokens"):
        triton_attention.paged_attention(case.query[:5], None, None, case.key_cache,
                                         case.value_cache, case.meta, case.scale)
    with pytest.raises(ValueError, match="cache dtype"):
        triton_attention.paged_attention(case.query.half(), None, None, case.key_cache,
                                         case.value_cache, case.meta, case.scale)


@pytest.mark.parametrize("group, window, sinks", [(1, None, False), (4, 24, True)],
                         ids=["plain", "window-sinks"])
def test_a_device_layout_launch_equals_the_host_plans(group, window, sinks, triton_device):
    """A captured mixed step's single launch (kernels.DeviceLayout, written by the pieces'
    AttentionLayouts: every sequence a chunk, decodes too, over a grid fixed for a padded
    size) gives the host-planned decode and prefill launches' answer, and writes no padding
    row."""
    from workers.graphs.attention_layout import AttentionLayouts
    from workers.step_buffers import StepBuffers, StepLimits

    num_heads, num_kv_heads, block_size = 2 * group, 2, 16
    case = make_case(MIXED, MIXED_DECODES, num_heads, num_kv_heads, 64, block_size,
                     torch.float32, seed=group)
    on = case.to(triton_device)
    meta = on.meta
    head_sinks = (torch.randn(num_heads, generator=torch.Generator().manual_seed(1))
                  .to(triton_device) if sinks else None)
    options = dict(sliding_window=window, sinks=head_sinks)
    expected = triton_attention.paged_attention(on.query, on.new_keys, on.new_values,
                                                on.key_cache, on.value_cache, meta, on.scale,
                                                **options)
    num_tokens = on.query.shape[0]
    size = num_tokens + 9  # the captured size: nine padding rows
    buffers = StepBuffers(triton_device, StepLimits(size, len(MIXED), 512), block_size)
    tables = [*meta.decode_block_tables, *meta.prefill_block_tables]
    for row, table in enumerate(tables):
        buffers.block_tables[row, :table.numel()] = table
    layouts = AttentionLayouts(buffers, triton_attention.layout_block_q(num_heads, num_kv_heads),
                               size)
    layouts.write([1] * meta.num_decodes + meta.prefill_query_lens,
                  meta.decode_context_lens.tolist() + meta.prefill_context_lens)
    query = torch.zeros((size, *on.query.shape[1:]), dtype=on.query.dtype, device=triton_device)
    query[:num_tokens] = on.query
    out = torch.full_like(query, 7.0)
    triton_attention.paged_attention(query, query, query, on.key_cache, on.value_cache,
                                     layouts.metadata(size, 1), on.scale, out=out, **options)
    torch.testing.assert_close(out[:num_tokens], expected, atol=2e-5, rtol=0)
    assert bool((out[num_tokens:] == 7.0).all())  # probe: no tile covers a padding row
    # The grid is the size's, larger than the step's own tiles: the spare ones did nothing.
    assert layouts.tiles(size) > sum(-(-n // layouts.block_q)
                                     for n in [1] * meta.num_decodes + meta.prefill_query_lens)
