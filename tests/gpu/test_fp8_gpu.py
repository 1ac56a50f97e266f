"""FP8 GEMMs on an FP8 GPU (compute capability 8.9 or newer): ``torch._scaled_mm`` with
per-token activations for per-channel weights, the compiled Triton block-scaled kernel for
128x128 blocks (workers.quantization.fp8_cuda), each against the dequantized reference the CPU
computes, and an FP8 checkpoint served end to end on the GPU. Skipped without such a GPU.

Tolerance: the GPU quantizes the activations to FP8, the reference does not. e4m3 rounds a
normal value within 2**-4 of itself and a value below its smallest normal within 2**-10 of the
scale, so |out - x @ W^T| <= (2**-4 |x| + 2**-10 s_x) @ |W|^T, plus the GEMM's float32 sums
(K * 2**-24 of |x| @ |W|^T) and the output's rounding to bf16 (2**-8 of |out|).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs an NVIDIA GPU with FP8 (compute capability 8.9 or newer)")]


def _skip_if_interpreted() -> None:
    """Triton decides at a kernel module's import whether it runs interpreted (once per
    process, tests/utils/triton_device.py); interpreted kernels cannot take GPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import triton_fp8

    if isinstance(triton_fp8._w8a8_block_matmul_kernel, InterpretedFunction):
        pytest.skip("the Triton kernels are interpreted in this process (TRITON_INTERPRET=1); "
                    "run with TRITON_INTERPRET=0")


def _bound(x: torch.Tensor, x_scale_per_element: torch.Tensor, weights: torch.Tensor,
           out: torch.Tensor) -> torch.Tensor:
    depth = x.shape[1]
    activation = (2.0**-4 * x.abs() + 2.0**-10 * x_scale_per_element) @ weights.abs().T
    sums = depth * 2.0**-24 * (x.abs() @ weights.abs().T)
    return activation * 1.01 + sums + 2.0**-8 * out.abs()


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_scaled_mm_per_channel_against_the_dequantized_reference(rows):
    from tests.utils.fp8_checkpoints import quantize_rows
    from workers.quantization.fp8_cuda import scaled_mm_rowwise
    from workers.quantization.fp8_numerics import quantize_per_token

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=g)
    q, scale = quantize_rows(torch.randn(384, 512, generator=g) * 0.05)
    qx, sx = quantize_per_token(x.cuda())
    out = scaled_mm_rowwise(qx, sx, q.cuda(), scale.cuda(), torch.bfloat16).double().cpu()
    weights = (q.float() * scale[:, None]).double()
    reference = x.double() @ weights.T
    bound = _bound(x.double(), sx.cpu().double().expand(rows, 512), weights, out)
    assert bool(((out - reference).abs() <= bound).all())


@pytest.mark.parametrize("rows", [3, 100])
def test_triton_block_kernel_compiled_against_the_dequantized_reference(rows):
    from kernels.triton_fp8 import w8a8_block_matmul
    from tests.utils.fp8_checkpoints import dequantize_block, quantize_block
    from workers.quantization.fp8_numerics import quantize_per_token_group

    _skip_if_interpreted()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 384, generator=g)
    qw, sw = quantize_block(torch.randn(256, 384, generator=g) * 0.05)
    qx, sx = quantize_per_token_group(x.cuda())
    out = w8a8_block_matmul(qx, sx, qw.cuda(), sw.cuda(), torch.bfloat16).double().cpu()
    weights = dequantize_block(qw, sw).double()
    reference = x.double() @ weights.T
    bound = _bound(x.double(), sx.cpu().double().repeat_interleave(128, 1), weights, out)
    assert bool(((out - reference).abs() <= bound).all())


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_an_fp8_checkpoint_is_served_on_the_gpu(fp8_gpu_checkpoint, layout):
    from engine import LLM, SamplingParams
    from engine.benchmarks.reference.hf_reference import hf_greedy

    if layout == "block":
        _skip_if_interpreted()
    quantized, reference = fp8_gpu_checkpoint(layout)
    llm = LLM(model=quantized, device="cuda", dtype="bfloat16", num_kv_blocks=64,
              max_model_len=256, enforce_eager=True)
    try:
        model = llm.engine.executor.runner.model
        layer = model.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.is_cuda
        prompts = [[5, 9, 200, 31, 7, 77], [3] * 20]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        got = [list(o.token_ids) for o in
               llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    finally:
        llm.shutdown()
    # The first token of each prompt: W8A8 rounding may flip a later near-tie, and a flip
    # then changes every token after it.
    want = hf_greedy(reference, prompts, 4)
    assert [g[0] for g in got] == [w[0] for w in want]


@pytest.fixture(scope="module")
def fp8_gpu_checkpoint(tiny_model, tmp_path_factory):
    from tests.utils.fp8_checkpoints import write_fp8_checkpoint

    source = tiny_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=128, num_hidden_layers=2)

    def make(layout: str) -> tuple[str, str]:
        root = tmp_path_factory.mktemp(f"fp8-gpu-{layout}")
        return write_fp8_checkpoint(source, root / "fp8", root / "reference", layout)

    return make
