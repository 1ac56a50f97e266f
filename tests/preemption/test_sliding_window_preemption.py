"""Mid-forward preemption of models whose layers slide (Mistral's layout, every layer; Gemma
3's, every other layer with its own rotary base): the long prompt (400 tokens) is many windows
long, so the pass that resumes a suspended chunk at its layer must see exactly the window each
of its rows would have seen. The scenario of tests/preemption/test_mid_forward_preemption.py
(an urgent arrival unwinds a long prefill; greedy outputs equal an unpreempted run's), in the
default mode and in recompute, and replayed as pieces with the CUDA graphs' CPU stand-in."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from tests.utils.mid_forward import WINDOW, check_urgent_arrival_unwinds_long_prefill
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV


@pytest.mark.parametrize("mode", ["suspend", "recompute"])
def test_urgent_arrival_unwinds_a_windowed_prefill(windowed_model: str, mode: str) -> None:
    assert AutoConfig.from_pretrained(windowed_model).sliding_window == WINDOW  # probe: it slides
    check_urgent_arrival_unwinds_long_prefill(windowed_model, mode)


@pytest.mark.parametrize("windowed_model", ["gemma3"], indirect=True)
def test_a_windowed_step_replayed_as_pieces_is_unwound_and_resumed(windowed_model: str,
                                                                   monkeypatch) -> None:
    """The pieces between attention ops carry each layer's rotary table; the vote between two
    of them stops the step and the suspended chunk resumes at its layer."""
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    check_urgent_arrival_unwinds_long_prefill(windowed_model, "suspend")
