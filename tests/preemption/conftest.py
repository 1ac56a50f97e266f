"""Fixtures the preemption tests share: `model`, `moe_model`, `windowed_model` and
`long_rope_model`, tiny models with slowed layers (tests/utils/mid_forward.py)."""

from tests.utils.mid_forward import long_rope_model, model, moe_model, windowed_model  # noqa: F401
