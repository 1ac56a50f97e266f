"""The bfloat16-weight linear loop (kernels.cpu_bf16_linear) against F.linear: tails in every
dimension, bias, strided and 3-d inputs, more input rows than one register group; what counts as
a bfloat16 weight; bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_bf16_linear


@pytest.fixture(scope="module")
def compiled() -> None:
    if not cpu_bf16_linear.warm_up():
        pytest.skip("the bfloat16-weight CPU kernel cannot be compiled here (no C++ compiler?)")


def _bf16_valued(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


# 960 x 576: the default model's q/k/v (whole blocks and chunks); 10 x 37 and 3 x 5: a block and
# a chunk cut short; 70 x 1536: the down projection's width with a short last block.
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (10, 37), (3, 5), (70, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 17])
def test_matches_f_linear(compiled, out_features: int, in_features: int, rows: int) -> None:
    weight = _bf16_valued(out_features, in_features, seed=rows)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features)
    packed = cpu_bf16_linear.pack(weight)
    torch.testing.assert_close(cpu_bf16_linear.linear(x, packed, bias), F.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_bf16_linear.linear(x, packed), F.linear(x, weight),
                               atol=1e-4, rtol=1e-5)


def test_strided_and_batched_inputs(compiled) -> None:
    weight = _bf16_valued(12, 40, seed=0)
    packed = cpu_bf16_linear.pack(weight)
    # A column slice of a wider row (q/k/v views are) whose columns past the slice hold NaN: the
    # loop must not read them into a product.
    wide = torch.full((6, 64), float("nan"))
    wide[:, 8:48] = torch.randn(6, 40)
    x = wide[:, 8:48]
    torch.testing.assert_close(cpu_bf16_linear.linear(x, packed), F.linear(x, weight),
                               atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 3, 40)
    out = cpu_bf16_linear.linear(x3, packed)
    assert out.shape == (2, 3, 12)
    torch.testing.assert_close(out, F.linear(x3, weight), atol=1e-4, rtol=1e-5)
    assert cpu_bf16_linear.linear(torch.randn(0, 40), packed).shape == (0, 12)


def test_what_counts_as_a_bfloat16_weight(compiled) -> None:
    exact = _bf16_valued(8, 8, seed=1)
    assert cpu_bf16_linear.is_exactly_bf16(exact)
    nudged = exact.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(float("inf")))
    assert not cpu_bf16_linear.is_exactly_bf16(nudged)
    assert not cpu_bf16_linear.is_exactly_bf16(exact.bfloat16())  # not float32: nothing to save
    # Half the bytes, whatever the padding.
    packed = cpu_bf16_linear.pack(_bf16_valued(960, 576, seed=2))
    assert packed.nbytes == 960 * 576 * 2


def test_bad_inputs_are_named(compiled) -> None:
    packed = cpu_bf16_linear.pack(_bf16_valued(4, 8, seed=0))
    with pytest.raises(ValueError, match=r"float32 \[\.\.\., 8\]"):
        cpu_bf16_linear.linear(torch.randn(2, 9), packed)
    with pytest.raises(ValueError, match="float32"):
        cpu_bf16_linear.linear(torch.randn(2, 8).double(), packed)
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 \[4\]"):
        cpu_bf16_linear.linear(torch.randn(2, 8), packed, torch.randn(5))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        cpu_bf16_linear.pack(torch.randn(2, 3, 4))
