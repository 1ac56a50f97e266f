"""Where the Triton tests run: on the CPU in Triton's interpreter (the default, so CI needs no
GPU), or compiled on a GPU when the environment says ``TRITON_INTERPRET=0``:

    TRITON_INTERPRET=0 python -m pytest -q tests/kernels/test_triton_*.py   # on a machine with a GPU

Triton decides when a kernel module is first imported (its kernels decorated) whether they run
compiled or interpreted, once per process. A test module that uses the Triton kernels imports
this module before any ``kernels.triton_*`` module, and takes its device from the
``triton_device`` fixture (tests/conftest.py), which follows how the kernels were decorated.
"""

from __future__ import annotations

import os

import pytest
import torch

# Unset means the interpreter. Set only here, by the modules that import this one: a global
# default would interpret the kernels of GPU tests elsewhere in the session.
os.environ.setdefault("TRITON_INTERPRET", "1")


def kernels_interpreted() -> bool:
    """Whether this process's Triton kernels run in the interpreter (decided at their import)."""
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import triton_attention

    return isinstance(triton_attention._paged_attention_kernel, InterpretedFunction)


def triton_device() -> torch.device:
    """The device to put the Triton tests' tensors on: the CPU for interpreted kernels, the GPU
    for compiled ones; skips the test where compiled kernels have no GPU to run on."""
    pytest.importorskip("triton")
    if kernels_interpreted():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernels are compiled in this process (TRITON_INTERPRET="
                    f"{os.environ.get('TRITON_INTERPRET')!r} when they were imported) but no "
                    "CUDA GPU is visible (torch.cuda.is_available() is False); unset "
                    "TRITON_INTERPRET to run them in Triton's interpreter on the CPU")
    return torch.device("cuda")
