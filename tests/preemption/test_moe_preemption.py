"""Mid-forward preemption of a mixture-of-experts model: the experts sit between two attention
ops like a dense MLP, so the vote, the unwind, suspend and resume work unchanged. The same
scenario as tests/preemption/test_mid_forward_preemption.py (an urgent arrival unwinds a long
prefill; every greedy output equals an unpreempted run), on each MoE family, in every mode."""

from __future__ import annotations

import pytest

from tests.utils.mid_forward import check_urgent_arrival_unwinds_long_prefill
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV


@pytest.mark.parametrize("mode", ["recompute", "pause", "suspend"])
def test_urgent_arrival_unwinds_long_moe_prefill(moe_model: str, mode: str) -> None:
    check_urgent_arrival_unwinds_long_prefill(moe_model, mode)


def test_moe_step_replayed_as_pieces_is_unwound_and_resumed(moe_model: str, monkeypatch) -> None:
    """With CUDA graphs' CPU stand-in the experts run inside the pieces between attention ops;
    the vote between two pieces stops the step and the suspended chunk resumes at its layer."""
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    check_urgent_arrival_unwinds_long_prefill(moe_model, "suspend")
