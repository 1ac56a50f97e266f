"""bench/diagnostics/cpu_linear.py without timing anything: it runs on a tiny model's shapes and prints both
kernels' times per row count (the figures are the script's to print, never a test's to assert)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.layers import cpu_prepack

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_prepack.prepack_available("cpu", torch.float32),
                    reason="this PyTorch build has no oneDNN linear prepacking")
def test_script_prints_both_kernels_per_row_count(tiny_model):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "bench.diagnostics.cpu_linear", "--model", tiny_model("llama"),
         "--rows", "1", "7", "--repeats", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert [r["rows"] for r in result["results"]] == [1, 7]
    for r in result["results"]:
        for part in ("layers_ms", "lm_head_ms"):
            assert set(r[part]) == {"mkl", "onednn_prepacked"}
            assert all(v > 0 for v in r[part].values())
    assert result["layer_weight_mb"] > 0
