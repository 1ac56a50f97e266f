"""The whole engine on the Triton kernels: the same greedy tokens as the PyTorch kernels, and a
mid-forward preemption on them. Run on the CPU in Triton's interpreter, or compiled on a GPU
under TRITON_INTERPRET=0 (tests/utils/triton_device.py); tests/gpu/test_cuda.py runs more scenarios on a
GPU."""

from __future__ import annotations

# Must come before the Triton kernels are first imported (decorated).
import tests.utils.triton_device  # noqa: F401,I001

import random  # noqa: E402

import pytest  # noqa: E402

from engine.benchmarks.reference.greedy_divergence import (  # noqa: E402
    NEAR_TIE_MARGIN, assert_no_clear_divergence, compare_greedy, fresh_engine_top_two)
from engine import LLM, SamplingParams  # noqa: E402
from tests.utils.kernel_counts import KernelsRan  # noqa: E402
from tests.utils.mid_forward import check_urgent_arrival_unwinds_long_prefill  # noqa: E402

# On a GPU, bench/suite/gpu_suite.sh's tests-triton-compiled step runs the tests marked gpu.
pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [5, 150, 17, 60, 1, 33]  # the 150-token prompt spans three 64-token chunks
# The mixtures of experts, slow in Triton's interpreter, take three: a short prompt, the
# chunked one, and one that shares its 40-token prefix (a prefix-cache hit).
MOE_LENGTHS = [5, 150, 60]


def _generate(model_dir: str, backend: str, device: str, ran: KernelsRan, lengths: list[int],
              **overrides) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    """The scenario's prompts and tokens, and how many times each kernel op ran while it was
    served (what ran, CUDA graph replays included: tests/utils/kernel_counts.py)."""
    # fused_ops left at its default ("auto"): on with the Triton kernels, off with PyTorch's.
    llm = LLM(model=model_dir, dtype="float32", block_size=16, max_num_batched_tokens=64,
              enable_prefix_caching=True, attention_backend=backend, device=device,
              **overrides)
    try:
        runner = llm.engine.executor.runner
        # The startup warm-up ran the Triton kernels (and only those) before any request.
        assert (runner.kernel_warmup is not None) == (backend == "triton")
        rng = random.Random(3)
        shared = [rng.randrange(1, llm.engine.vocab_size) for _ in range(40)]
        prompts = [{"prompt_token_ids": (shared if n > 40 else [])
                    + [rng.randrange(1, llm.engine.vocab_size) for _ in range(n)]}
                   for n in lengths]
        before = ran.snapshot()
        outs = llm.generate(prompts, GREEDY)
        return ([p["prompt_token_ids"] for p in prompts], [o.token_ids for o in outs],
                ran.since(before))
    finally:
        llm.shutdown()


# Qwen3's per-head q/k norms are Gemma 3's too, which adds its own norms, GeGLU and windows.
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe", "gpt_oss"])
def test_triton_kernels_give_the_torch_kernels_tokens(tiny_model, arch, triton_device,
                                                       monkeypatch):
    model_dir = tiny_model(arch)
    ran = KernelsRan.install(monkeypatch)
    moe = arch.endswith("_moe") or arch == "gpt_oss"
    lengths = MOE_LENGTHS if moe else LENGTHS
    prompts, want, torch_calls = _generate(model_dir, "torch", triton_device.type, ran, lengths)
    _, got, triton_calls = _generate(model_dir, "triton", triton_device.type, ran, lengths)
    # On a GPU the kernels sum in other orders (and replay CUDA graphs): an argmax may flip
    # where the PyTorch run's top two nearly tie, reported and accepted; interpreted, exact.
    on_gpu = triton_device.type == "cuda"
    torch_top_two = fresh_engine_top_two(model_dir, dtype="float32", device=triton_device.type,
                                         attention_backend="torch", enforce_eager=True)
    for tie in assert_no_clear_divergence(compare_greedy(
            prompts, got, want, torch_top_two, tolerance=NEAR_TIE_MARGIN if on_gpu else 0.0)):
        print(f"accepted {tie.describe()}")
    # Probe: the Triton run really used Triton attention and, by default, the fused norm, rotary
    # and SiLU-and-mul kernels (the PyTorch backend has none of the latter).
    assert triton_calls["paged_attention"] > 0 and triton_calls["paged_attention"] == \
        torch_calls["paged_attention"]
    # A mixture of experts has no dense MLP: its experts fuse their activation themselves, in
    # the fused experts kernel on Triton (in PyTorch otherwise); gpt-oss's with its biases and
    # clamped SwiGLU.
    fused = ("rms_norm", "apply_rotary") + (("fused_moe",) if moe else ("silu_and_mul",))
    if arch == "gemma3":  # its norms scale before the cast, its MLP is GeGLU
        fused = ("rms_norm_float32_scale", "apply_rotary", "gelu_tanh_and_mul")
    assert all(triton_calls[name] > 0 for name in fused)
    assert all(torch_calls[name] == 0 for name in fused)


@pytest.mark.timeout(300)
def test_mid_forward_preemption_on_triton_kernels(model, triton_device):  # noqa: F811
    check_urgent_arrival_unwinds_long_prefill(model, "suspend", check_timing=False,
                                              attention_backend="triton",
                                              device=triton_device.type)

