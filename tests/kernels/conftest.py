"""Fixtures the kernel tests share: `model`, the tiny model with slowed layers of the mid-forward
preemption scenario they rerun on the Triton kernels (tests/utils/mid_forward.py)."""

from tests.utils.mid_forward import model  # noqa: F401
