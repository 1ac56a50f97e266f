"""Mid-forward preemption of a model whose layers slide: the long prompt (400 tokens) is many
windows long, so the pass that resumes a suspended chunk at its layer must see exactly the
window each of its rows would have seen. The scenario of
tests/preemption/test_mid_forward_preemption.py (an urgent arrival unwinds a long prefill;
greedy outputs equal an unpreempted run's), in the default mode and in recompute."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from tests.utils.mid_forward import WINDOW, check_urgent_arrival_unwinds_long_prefill


@pytest.mark.parametrize("mode", ["suspend", "recompute"])
def test_urgent_arrival_unwinds_a_windowed_prefill(windowed_model: str, mode: str) -> None:
    assert AutoConfig.from_pretrained(windowed_model).sliding_window == WINDOW  # probe: it slides
    check_urgent_arrival_unwinds_long_prefill(windowed_model, mode)
