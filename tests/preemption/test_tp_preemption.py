"""Mid-forward preemption at TP=2 (two gloo worker processes): only rank 0 can see the shared
memory (rank 1 stands in for a rank on another node and always votes 0), yet both ranks unwind
before the same layer, nothing hangs, and the outputs equal TP=1 without preemption."""

from __future__ import annotations

import pytest

from tests.utils.mid_forward import check_tp2_remote_rank_unwinds_with_rank0


@pytest.mark.timeout(300)
def test_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path) -> None:
    # The CPU case (tests/gpu/test_cuda.py runs it on GPUs): never "auto", which picks CUDA.
    check_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path, device="cpu")


