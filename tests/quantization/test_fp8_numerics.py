"""The FP8 arithmetic the CPU path runs (workers.quantization.fp8_numerics, .fp8): dequantized
weights equal, bit for bit, the test's own ``fp8.float() * scale`` (then one rounding to the
compute dtype), blocks cut at the edges included; a layer loaded from full checkpoint tensors
multiplies like ``F.linear`` on those weights; and FP8 NaN codes are refused at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.utils.fp8_checkpoints import (FP8, dequantize_block, quantize_block, quantize_rows)
from workers.layers import MergedColumnParallelLinear, RowParallelLinear
from workers.quantization.fp8 import Fp8LinearMethod
from workers.quantization.fp8_numerics import (dequantize_block as engine_dequantize_block)
from workers.quantization.fp8_numerics import dequantize_rows, quantize_per_token_group
from workers.quantization.fp8_scheme import Fp8Scheme

BLOCK_SCHEME = Fp8Scheme("block", "dynamic", scale_name="weight_scale_inv")


@pytest.mark.parametrize("shape", [(256, 384), (300, 200)], ids=["whole-blocks", "cut-edges"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_dequantization_is_bit_identical(shape, dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = quantize_block(w)
    want = dequantize_block(q, scale).to(dtype)
    got = engine_dequantize_block(q, scale, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_dequantization_is_bit_identical(dtype):
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_rows(w)
    assert torch.equal(dequantize_rows(q, scale, dtype), (q.float() * scale[:, None]).to(dtype))


def test_activation_groups_round_trip_within_fp8_precision():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_per_token_group(x)
    assert q.dtype == FP8 and scale.shape == (5, 3)
    back = q.float() * scale.repeat_interleave(128, dim=1)[:, :300]
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of a normal value; below the smallest
    # normal (2**-6 of the group's scale unit) the spacing is 2**-9 scale units.
    bound = 2**-4 * x.abs() + 2**-10 * scale.repeat_interleave(128, dim=1)[:, :300]
    assert bool(((back - x).abs() <= bound).all())


def _merged_block_layer() -> MergedColumnParallelLinear:
    return MergedColumnParallelLinear(256, [128, 256], bias=False, dtype=torch.float32,
                                      device="cpu",
                                      quant_method=Fp8LinearMethod(BLOCK_SCHEME, "mlp.gate_up"))


def test_a_merged_block_layer_multiplies_like_f_linear_on_its_dequantized_weights():
    layer = _merged_block_layer()
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(rows, 256, generator=g) * 0.1 for rows in (128, 256)]
    quantized = [quantize_block(w) for w in parts]
    for shard, (q, scale) in enumerate(quantized):
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8 and layer.weight_scale_inv.shape == (3, 2)
    x = torch.randn(4, 256, generator=g)
    reference = torch.cat([dequantize_block(q, s) for q, s in quantized])
    assert torch.equal(layer(x), F.linear(x, reference))
    assert not layer.prepack_weight  # oneDNN packing leaves FP8 weights alone


def test_per_tensor_scales_of_a_row_parallel_layer_tp2():
    """Each rank takes its columns; the per-tensor scale becomes one per row."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    scale = w.abs().max() / 448
    q = (w / scale).to(FP8)
    scheme = Fp8Scheme("tensor", "static")
    for rank in range(2):
        layer = RowParallelLinear(128, 64, bias=False, dtype=torch.float32, device="cpu",
                                  tp_rank=rank, tp_size=2,
                                  quant_method=Fp8LinearMethod(scheme, "o_proj"))
        layer.weight.weight_loader(layer.weight, q)
        layer.weight_scale.weight_loader(layer.weight_scale, scale.reshape(1))
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor([0.5]))
        layer.quant_method.process_weights_after_loading(layer)
        assert torch.equal(layer.weight_scale, scale.expand(64))
        dense = dequantize_rows(layer.weight, layer.weight_scale, torch.float32)
        assert torch.equal(dense, q.float()[:, rank * 64:(rank + 1) * 64] * scale)


def test_nan_codes_are_refused_at_load():
    layer = _merged_block_layer()
    for shard, rows in enumerate((128, 256)):
        q, scale = quantize_block(torch.randn(rows, 256) * 0.1)
        if shard == 1:
            q.view(torch.uint8)[7, 9] = 0x7F  # e4m3fn's NaN
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard)
    with pytest.raises(ValueError, match=r"mlp\.gate_up\.weight holds float8 NaN codes"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("block", [False, True], ids=["rows", "blocks"])
def test_compiled_cpu_kernels_multiply_like_the_eager_path(block, dtype):
    """A layer large enough for the compiled kernels (workers.quantization.cpu_dequant): one
    row takes the fused dequantize-and-multiply (float32 sums in another order: within float32
    rounding of |x| @ |W|^T, plus the one rounding of the result to bf16), three rows the
    scratch buffer (bit for bit the eager path)."""
    from workers.quantization import cpu_dequant

    g = torch.Generator().manual_seed(5)
    w = torch.randn(1024, 1024, generator=g) * 0.05
    q, scale = quantize_block(w) if block else quantize_rows(w)
    dense = cpu_dequant.dequantized_weight(q, scale, block, dtype)
    cpu_dequant.warm_up(q, scale, block, dtype)
    assert cpu_dequant._compiled() is not None  # probe: compiled, not fallen back to eager
    with torch.inference_mode():
        one = torch.randn(1, 1024, generator=g).to(dtype)
        fused = cpu_dequant.fp8_linear_cpu(q, scale, block, one, None)
        assert fused.dtype == dtype
        exact = F.linear(one.float(), dense.float())
        magnitude = one.float().abs() @ dense.float().abs().T
        bound = 1024 * 2.0**-24 * magnitude * 2
        if dtype == torch.bfloat16:
            bound = bound + exact.abs() * 2.0**-8
        assert bool(((fused.float() - exact).abs() <= bound).all())
        three = torch.randn(3, 1024, generator=g).to(dtype)
        assert torch.equal(cpu_dequant.fp8_linear_cpu(q, scale, block, three, None),
                           F.linear(three, dense))


def test_compiled_cpu_cast_is_exact_for_every_fp8_code():
    """The compiled kernels widen float8 from its bits (cpu_dequant._fp8_to_float32): every
    finite e4m3fn code, subnormals and both zeros included, gives PyTorch's own cast bit for
    bit, and the bf16 rounding on the bits matches PyTorch's round-to-nearest-even."""
    from workers.quantization import cpu_dequant

    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    fp8 = codes[finite].view(torch.float8_e4m3fn)
    widened = torch.compile(cpu_dequant._fp8_to_float32, dynamic=True)(fp8)
    assert torch.equal(widened.view(torch.int32), fp8.to(torch.float32).view(torch.int32))
    assert bool((widened[fp8.view(torch.uint8) == 0x80].view(torch.int32) < 0).all())  # -0.0
    values = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 1e3
    ties = (values.view(torch.int32) & -0x10000) | 0x8000  # halfway: even and odd both
    values = torch.cat([values, ties.view(torch.float32)])
    rounded = cpu_dequant._round_to_bfloat16(values)
    assert torch.equal(rounded, values.to(torch.bfloat16).to(torch.float32))
