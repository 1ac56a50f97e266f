"""The Triton attention kernel's answer for an attention case (tests/utils/attention_cases.py) and
its check against the float64 dense reference and the PyTorch kernel (test helper)."""

from __future__ import annotations

# Must come before the kernels are decorated (on import): it picks interpreted or compiled.
import tests.utils.triton_device  # noqa: F401,I001

import torch  # noqa: E402

from kernels import torch_attention  # noqa: E402
from tests.utils.attention_cases import Case  # noqa: E402

from kernels import triton_attention  # noqa: E402


# Max |error| against the float64 dense reference. The PyTorch reference rounds the same inputs
# differently (bf16 probabilities against float32 ones in SDPA's prefill path), so both are held
# to the dense answer rather than to each other.
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _triton(case: Case, device: torch.device, query: torch.Tensor | None = None,
            **kwargs) -> torch.Tensor:
    """The Triton kernel's answer for the case, run on ``device`` (``query``: already there)."""
    on = case.to(device)
    out = triton_attention.paged_attention(on.query if query is None else query, on.new_keys,
                                           on.new_values, on.key_cache, on.value_cache, on.meta,
                                           on.scale, **kwargs)
    return out.cpu()


def _check(case: Case, out: torch.Tensor, dtype: torch.dtype) -> None:
    dense = case.dense_reference()
    assert out.dtype == dtype and out.shape == dense.shape
    torch.testing.assert_close(out.double(), dense, atol=ATOL[dtype], rtol=0)
    reference = torch_attention.paged_attention(case.query, case.new_keys, case.new_values,
                                                case.key_cache, case.value_cache, case.meta,
                                                case.scale)
    # Same answer as the CPU implementation, to within both kernels' rounding.
    torch.testing.assert_close(out.double(), reference.double(), atol=2 * ATOL[dtype], rtol=0)
