"""Fixtures the preemption tests share: `model` and `moe_model`, tiny models with slowed layers
(tests/utils/mid_forward.py)."""

from tests.utils.mid_forward import model, moe_model  # noqa: F401
