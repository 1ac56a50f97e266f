"""Sliding windows, soft-capped scores and attention sinks in every attention kernel: the
PyTorch reference, the CPU's compiled decode loop and the Triton kernel (interpreted here)
against a float64 dense reference that masks as HF does (a query at position p sees the keys
after p - W), caps as Gemma 2 does (c * tanh(s / c)) and counts gpt-oss's per-head sinks in the
softmax, over a mixed batch of decodes and prefill chunks with cached prefixes; windows that cut
blocks mid-way, of one token, and longer than every context."""

from __future__ import annotations

# Must come before the kernels are decorated (on import): it picks interpreted or compiled.
import tests.utils.triton_device  # noqa: F401,I001

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import cpu_fused, torch_attention  # noqa: E402
from tests.utils.attention_cases import MIXED, MIXED_DECODES, make_case  # noqa: E402

# 1: each query sees itself only; 7 and 24: mid-block cuts, shorter than most contexts (the
# decodes' 17..131, chunks' 23..100); 1000: longer than every context (full attention).
WINDOWS = [1, 7, 24, 1000]
ATOL = 2e-5


def _case(head_dim: int = 32, block_size: int = 16):
    return make_case(MIXED, MIXED_DECODES, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, dtype=torch.float32, num_blocks=1024 // block_size)


# Caps below the cases' largest scores (|s| up to ~4 at scale 1/sqrt(32)): the tanh bends them.
SOFTCAP = 1.5
# (sliding window, softcap): each alone, and both, as Gemma 2's sliding layers have them.
CAPPED = [(None, SOFTCAP), (7, SOFTCAP)]


def _run(fn, case, window, softcap=None, **kwargs):
    return fn(case.query, case.new_keys, case.new_values, case.key_cache, case.value_cache,
              case.meta, case.scale, sliding_window=window, softcap=softcap, **kwargs)


@pytest.mark.parametrize("window", WINDOWS)
def test_the_reference_masks_as_hf(window: int) -> None:
    case = _case()
    out = _run(torch_attention.paged_attention, case, window)
    torch.testing.assert_close(out.double(), case.dense_reference(window), atol=ATOL, rtol=0)
    if window < 100:
        # Probe: the window changed the answer (it is not full attention in disguise).
        assert (out.double() - case.dense_reference()).abs().max() > 1e-3


@pytest.mark.parametrize("window", WINDOWS)
def test_the_cpu_decode_loop_masks_as_hf(window: int) -> None:
    if not cpu_fused.warm_up():
        pytest.skip("the fused CPU kernels cannot be compiled here (no C++ compiler?)")
    # Blocks of 4 slots: windows start inside blocks, several blocks before each context.
    case = _case(head_dim=20, block_size=4)
    out = _run(cpu_fused.paged_attention, case, window)
    torch.testing.assert_close(out.double(), case.dense_reference(window), atol=ATOL, rtol=0)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", WINDOWS)
def test_the_triton_kernel_masks_as_hf(triton_device, window: int, splits: int) -> None:
    from kernels import triton_attention

    case = _case().to(triton_device)
    out = _run(triton_attention.paged_attention, case, window, num_kv_splits=splits).cpu()
    torch.testing.assert_close(out.double(), case.dense_reference(window), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window, softcap", CAPPED)
def test_soft_capped_scores_in_every_kernel(triton_device, window, softcap) -> None:
    from kernels import triton_attention

    case = _case()
    expected = case.dense_reference(window, softcap)
    # Probe: the cap changes the answer.
    assert (expected - case.dense_reference(window)).abs().max() > 1e-3
    out = _run(torch_attention.paged_attention, case, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)
    on = case.to(triton_device)
    for splits in (1, 4):
        out = _run(triton_attention.paged_attention, on, window, softcap,
                   num_kv_splits=splits).cpu()
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)
    if cpu_fused.warm_up():
        small = _case(head_dim=20, block_size=4)
        out = _run(cpu_fused.paged_attention, small, window, softcap)
        torch.testing.assert_close(out.double(), small.dense_reference(window, softcap),
                                   atol=ATOL, rtol=0)


def test_attention_sinks_in_every_kernel(triton_device) -> None:
    """gpt-oss's sinks, alone and beside its sliding window (128 there; 7 here), with the
    decodes' contexts whole and split (the merge weighs the sink once)."""
    from kernels import triton_attention

    case = _case()
    # Logits around the scores' own (|s| up to ~4): some heads give the sink most weight.
    sinks = torch.linspace(-3.0, 3.0, 8)
    for window in (None, 7):
        expected = case.dense_reference(window, sinks=sinks)
        # Probe: the sinks change the answer.
        assert (expected - case.dense_reference(window)).abs().max() > 1e-2
        out = _run(torch_attention.paged_attention, case, window, sinks=sinks)
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)
        on = case.to(triton_device)
        for splits in (1, 4):
            out = _run(triton_attention.paged_attention, on, window, sinks=sinks.to(on.query.device),
                       num_kv_splits=splits).cpu()
            torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)
        # The CPU's fused decode loop has no sinks: its dispatcher sends them to the reference.
        out = _run(cpu_fused.paged_attention, case, window, sinks=sinks)
        torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)
    # With soft-capped scores too (no family has both; the kernels do not mind).
    expected = case.dense_reference(7, SOFTCAP, sinks)
    torch.testing.assert_close(
        _run(torch_attention.paged_attention, case, 7, SOFTCAP, sinks=sinks).double(), expected,
        atol=ATOL, rtol=0)
