"""`sloserve bench structured` (engine/benchmarks/e2e/structured_overhead.py) at a tiny size: both
sides decode every token they were asked for, and the figures it prints are consistent with the
masks it really filled."""

from __future__ import annotations

import json

import pytest

from engine.benchmarks.e2e import structured_overhead


def test_the_structured_bench_prints_both_sides_and_the_fill_time(tiny_model, tmp_path):
    output = tmp_path / "structured.json"
    assert structured_overhead.main(["--model", tiny_model("llama"), "--dtype", "float32",
                                     "--batch", "3", "--max-tokens", "6", "--rounds", "2",
                                     "--prompt-len", "8", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["plain_tpot_ms"] > 0 and result["constrained_tpot_ms"] > 0
    ratio = result["constrained_tpot_ms"] / result["plain_tpot_ms"]
    assert result["tpot_overhead"] == pytest.approx(ratio - 1, abs=1e-3)
    # Probe: masks were filled, one per constrained row and step.
    assert result["bitmask_fill_us_per_row"] > 0 and result["bitmask_fill_ms_per_step"] > 0
    assert result["cached_compile_ms"] < result["first_compile_ms"]
