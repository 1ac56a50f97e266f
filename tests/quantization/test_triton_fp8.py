"""The Triton block-scaled FP8 GEMM (kernels.triton_fp8) against two references, in Triton's
interpreter on the CPU (compiled on a GPU under TRITON_INTERPRET=0: tests/utils/triton_device.py).

1. The same quantized operands multiplied in float64: the kernel's only error is its float32
   sums. A float32 sum of K products errs by at most K * 2**-24 of the sum of their magnitudes
   (each addition rounds once, relative error u = 2**-24), so |out - ref| <= K * 2**-24 *
   (|A| @ |B|^T) per element, then one rounding of the output to its dtype.
2. The dequantized reference the CPU path computes (activations unquantized, the weights
   dequantized): the difference is the activations' quantization, bounded element by element.
   e4m3 keeps 3 mantissa bits, so a normal value rounds within 2**-4 of itself; below the
   smallest normal (2**-6 in scale units) the spacing is 2**-9, so the rounding is within 2**-10
   of the group's scale. Hence |out - x @ W^T| <= (2**-4 |x| + 2**-10 s_x) @ |W|^T plus bound 1.
"""

from __future__ import annotations

# Must come before the Triton kernels are first imported (decorated).
import tests.utils.triton_device  # noqa: F401,I001

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.utils.fp8_checkpoints import dequantize_block, quantize_block  # noqa: E402
from workers.quantization.fp8_numerics import quantize_per_token_group  # noqa: E402

U32 = 2.0**-24
OUTPUT_ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _weight_scales(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """One 128x128 block scale per element."""
    return scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols].double()


def _activation_scales(scale: torch.Tensor, cols: int) -> torch.Tensor:
    """One per-token, per-128-column-group scale per element."""
    return scale.repeat_interleave(128, 1)[:, :cols].double()


# M = 5 runs the 16-row decode tile, M = 40 the 64-row prefill tile; N = 200 and K = 300 cut
# the last block and group short (masked loads).
@pytest.mark.parametrize("rows", [5, 40])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_block_scaled_gemm_against_its_references(triton_device, rows, out_dtype):
    from kernels.triton_fp8 import w8a8_block_matmul

    g = torch.Generator().manual_seed(rows)
    cols, depth = 200, 300
    x = torch.randn(rows, depth, generator=g)
    x[0, :128] *= 1e-4  # a group of tiny activations: its codes are subnormal
    w = torch.randn(cols, depth, generator=g) * 0.05
    qw, sw = quantize_block(w)
    qx, sx = quantize_per_token_group(x)
    dev = triton_device
    out = w8a8_block_matmul(qx.to(dev), sx.to(dev), qw.to(dev), sw.to(dev), out_dtype).cpu()
    assert out.shape == (rows, cols) and out.dtype == out_dtype
    out = out.double()

    a = qx.double() * _activation_scales(sx, depth)
    b = qw.double() * _weight_scales(sw, cols, depth)
    same_operands = a @ b.T
    magnitude = a.abs() @ b.abs().T
    sums = depth * U32 * magnitude + OUTPUT_ROUNDING[out_dtype] * same_operands.abs()
    assert bool(((out - same_operands).abs() <= sums + 1e-30).all())

    weights = dequantize_block(qw, sw).double()
    dequantized = x.double() @ weights.T
    activation_error = (2.0**-4 * x.double().abs()
                        + 2.0**-10 * _activation_scales(sx, depth)) @ weights.abs().T
    assert bool(((out - dequantized).abs() <= activation_error + sums).all())
    # Probe: the bound is not vacuous; the kernel lands far closer than the error it allows.
    assert float((out - dequantized).abs().max()) < 0.5 * float(activation_error.max())


def test_shapes_are_checked(triton_device):
    from kernels.triton_fp8 import w8a8_block_matmul

    a = torch.zeros(2, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="must share K"):
        w8a8_block_matmul(a, torch.ones(2, 2), a[:, :128], torch.ones(1, 1), torch.float32)
    with pytest.raises(ValueError, match="scales must be"):
        w8a8_block_matmul(a, torch.ones(2, 1), a, torch.ones(1, 2), torch.float32)
