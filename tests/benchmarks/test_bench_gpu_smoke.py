"""bench/suite/gpu_smoke.py (`python -m bench.suite.gpu_smoke`), the GPU suite's first
step: it tells the suite whether the rest of the call can use CUDA graphs. On the CPU the graphs are the test stand-in (EagerReplayBackend)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.suite import gpu_smoke
from engine.benchmarks.inputs.random_checkpoints import make_random_model, save_small_tokenizer
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV, EagerReplayBackend


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("smoke-model")
    save_small_tokenizer(folder)
    make_random_model(folder, "llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.3)
    return str(folder)


def _smoke(model: str, out: Path) -> int:
    return gpu_smoke.main(["--model", model, "--load-format", "auto", "--device", "cpu",
                           "--chunk-tokens", "128", "--decode-batch", "4", "--decode-tokens",
                           "4", "--output", str(out)])


def test_graphs_captured_and_replayed_pass(model: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    out = tmp_path / "smoke.json"
    assert _smoke(model, out) == 0
    report = json.loads(out.read_text())
    assert report["verdict"] == "graphs" and len(report["phases"]) == 1
    phase = report["phases"][0]
    assert phase["replays"]["decode"] > 0 and phase["replays"]["pieces"] > 0
    assert phase["startup"]["pieces"] > 0 and phase["tokens"] == 4 * 4 + 2
    kinds = [json.loads(line)["kind"] for line in out.with_suffix(".jsonl").read_text()
             .splitlines()]
    assert kinds == ["engine_started", "engine", "verdict"]


def test_a_failed_capture_falls_back_to_enforce_eager(model: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    calls = []

    def broken(self: EagerReplayBackend, fn):  # noqa: ANN001
        calls.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(EagerReplayBackend, "capture", broken)
    out = tmp_path / "smoke.json"
    assert _smoke(model, out) == gpu_smoke.EXIT_GRAPHS_FAILED
    assert calls  # the probe: a capture was attempted, and failed
    report = json.loads(out.read_text())
    assert report["verdict"] == "eager"
    first, second = report["phases"]
    assert "CUDA graph capture failed" in first["error"] and not first["enforce_eager"]
    assert second["enforce_eager"] and second["error"] is None and second["tokens"] == 18


def test_no_graphs_on_a_cpu_is_not_a_failure(model: str, tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    assert _smoke(model, out) == 0
    report = json.loads(out.read_text())
    assert report["verdict"] == "no graphs on this device"
    assert report["phases"][0]["replays"] == {"decode": None, "pieces": None}


def test_an_engine_that_cannot_start_fails_the_smoke(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    assert _smoke(str(tmp_path / "no-such-model"), out) == 1
    report = json.loads(out.read_text())
    assert report["verdict"] == "failed" and all(p["error"] for p in report["phases"])
