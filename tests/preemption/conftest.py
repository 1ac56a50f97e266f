"""Fixtures the preemption tests share: `model`, `moe_model` and `windowed_model`, tiny models
with slowed layers (tests/utils/mid_forward.py)."""

from tests.utils.mid_forward import model, moe_model, windowed_model  # noqa: F401
