"""Fixtures the fleet tests share: `model`, the tiny model with slowed layers
(tests/utils/mid_forward.py)."""

from tests.utils.mid_forward import model  # noqa: F401
from tests.utils.ray_fleet import ray_serve_port  # noqa: F401,E402
