"""Fixtures the core tests share: `engine`, a 4-layer tiny-model EngineCore whose first step a
stand-in vote can unwind (tests/utils/engine_steps.py)."""

from tests.utils.engine_steps import engine  # noqa: F401
