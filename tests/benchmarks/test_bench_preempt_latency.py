"""`sloserve bench latency` (engine/benchmarks/e2e/latency.py) with several prompt sizes on one
engine, on a tiny model on the CPU:
a block of figures per size, and how each size's long steps ran. With the CPU stand-in for CUDA
graphs (workers.graphs.cuda_graphs.EagerReplayBackend) a step of up to 512 prefill tokens replays as
pieces and an urgent arrival stops it between two of them; a larger step runs eager."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.benchmarks.measure.figures import read_figures
from engine.benchmarks.measure.stats import percentile
from engine.benchmarks.e2e.latency import main
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV
from workers.preemption.layer_delay import LAYER_DELAY_ENV
from tests.utils.figures_wait import wait_for_figures

# Above the largest size replayed as pieces (512), and one below it that the scheduler still marks
# preemptible (slo_preempt_min_tokens, 128).
EAGER_SIZE, PIECES_SIZE = 600, 160
TRIALS = 2
# Slowed layers (600 tokens: 30 ms a layer; 160 tokens: 8 ms), so that an early arrival lands
# well before the step's last vote.
DELAY_US_PER_TOKEN = 50
# The arrival points are drawn from this seed: the small size's two trials (after the large
# size's two) get 34% and 21% of the step, early enough that the monitor always stops it (an
# arrival past ~70% of a 4-layer step may come after the last vote, and rightly miss).
SEED = 0


def _blocks(stdout: str) -> dict[int, dict[str, str]]:
    """Each size's `key: value` lines, keyed by the size its first line names."""
    blocks: dict[int, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in stdout.splitlines():
        header = re.match(r"^layers: \d+, prompt_tokens: (\d+), threads: \d+$", line)
        if header:
            current = blocks.setdefault(int(header.group(1)), {})
        elif current is not None and (m := re.match(r"^([a-z_0-9]+): (.*)$", line)):
            current[m.group(1)] = m.group(2)
    return blocks


def _run(tiny_model, tmp_path: Path, capsys) -> tuple[dict[int, dict[str, str]], dict]:
    model = tiny_model("llama", num_hidden_layers=4, max_position_embeddings=1024)
    report_path = tmp_path / "latency.json"
    main(["--model", model, "--device", "cpu", "--dtype", "float32", "--prompt-tokens",
          str(EAGER_SIZE), str(PIECES_SIZE), "--trials", str(TRIALS), "--seed", str(SEED),
          "--output", str(report_path)])
    report = json.loads(report_path.read_text())
    _check_lines(read_figures(report_path.with_suffix(".jsonl")), report)
    return _blocks(capsys.readouterr().out), report


def _check_lines(records: list[dict], report: dict) -> None:
    """The .jsonl twin, written as the run went: the run, the urgent request alone, each
    trial, each size's figures as the JSON has them, done."""
    kinds = [r["kind"] for r in records]
    per_size = ["trial"] * TRIALS + ["size"]
    assert kinds == ["run", "urgent_alone", *per_size, *per_size, "done"]
    assert records[0]["layers"] == report["layers"] and records[0]["device"] == report["device"]
    assert records[1]["urgent_ttft_alone_ms"] == report["urgent_ttft_alone_ms"]
    sizes = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "size"]
    assert sizes == report["sizes"]
    for size in report["sizes"]:
        trials = [r for r in records if r["kind"] == "trial"
                  and r["prompt_tokens"] == size["prompt_tokens"]]
        assert [t["long_step_ms"] for t in trials] == size["long_step_ms"]
        assert [t["arrival_to_unwind_ms"] for t in trials if t["unwound"]] == \
            size["arrival_to_unwind_ms"]
        assert [t["arrival_to_first_token_ms"] for t in trials if t["unwound"]] == \
            size["arrival_to_first_token_ms"]


def _check_blocks(blocks: dict[int, dict[str, str]], report: dict) -> None:
    assert list(blocks) == [EAGER_SIZE, PIECES_SIZE]
    assert [size["prompt_tokens"] for size in report["sizes"]] == [EAGER_SIZE, PIECES_SIZE]
    for size in report["sizes"]:
        block = blocks[size["prompt_tokens"]]
        assert float(block["long_step_ms_median"]) > 0 and float(block["layer_ms"]) > 0
        assert block["trials"] == f"{TRIALS}, unwound: {size['unwound']}, not_unwound: " \
                                  f"{size['not_unwound']}"
        assert size["unwound"] + size["not_unwound"] == TRIALS
        assert len(size["long_step_ms"]) == TRIALS
        assert len(size["arrival_to_unwind_ms"]) == size["unwound"]
        if size["unwound"]:
            assert float(block["arrival_to_unwind_p99_ms"]) >= 0
            # The urgent request got its first token after each unwind, and not before it.
            assert all(first > unwind for first, unwind in zip(
                size["arrival_to_first_token_ms"], size["arrival_to_unwind_ms"], strict=True))
            assert float(block["arrival_to_first_token_p99_ms"]) == pytest.approx(
                percentile(size["arrival_to_first_token_ms"], 99), abs=0.01)
            within = sum(ms <= size["urgent_slo_ms"] for ms in size["arrival_to_first_token_ms"])
            assert size["first_token_within_slo"] == within
            assert block["first_token_within_slo"] == f"{within}/{size['unwound']}"
        assert block["long_step_ran_as"] == size["long_step_ran_as"]
        assert block["unwinds_between_pieces"] == str(size["unwinds_between_pieces"])
        assert size["long_steps"] == 2 * TRIALS  # a clean step and a preempted one per trial


def test_each_size_gets_its_block_and_runs_eager_on_the_cpu(tiny_model, tmp_path, capsys,
                                                            monkeypatch) -> None:
    monkeypatch.delenv(FAKE_GRAPHS_ENV, raising=False)
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    blocks, report = _run(tiny_model, tmp_path, capsys)
    _check_blocks(blocks, report)
    assert report["device"] == "cpu" and report["layers"] == 4
    for size in report["sizes"]:
        assert size["long_step_ran_as"] == "eager"
        assert size["long_steps_as_pieces"] == 0 and size["unwinds_between_pieces"] == 0


def test_the_small_size_replays_as_pieces_and_unwinds_between_them(tiny_model, tmp_path, capsys,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    blocks, report = _run(tiny_model, tmp_path, capsys)
    _check_blocks(blocks, report)
    eager, pieces = report["sizes"]
    assert eager["long_step_ran_as"] == "eager" and eager["unwinds_between_pieces"] == 0
    assert pieces["long_step_ran_as"] == "pieces"
    assert pieces["long_steps_as_pieces"] == 2 * TRIALS
    # Every unwind of the small size happened between two pieces; the probe that one did.
    assert pieces["unwinds_between_pieces"] == pieces["unwound"]
    assert pieces["unwound"] > 0, blocks[PIECES_SIZE]


def test_a_killed_run_keeps_the_trials_it_finished(tiny_model, tmp_path) -> None:
    """SIGKILL once the first trial is in the .jsonl: it stays there, whole, and no JSON is
    written (it is written at exit)."""
    import os
    import signal
    import subprocess
    import sys

    model = tiny_model("llama", num_hidden_layers=4, max_position_embeddings=1024)
    report_path = tmp_path / "latency.json"
    env = {**os.environ, LAYER_DELAY_ENV: str(DELAY_US_PER_TOKEN), "HF_HUB_OFFLINE": "1"}
    env.pop(FAKE_GRAPHS_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.entrypoints.cli", "bench", "latency", "--model", model,
         "--device", "cpu",
         "--dtype", "float32", "--prompt-tokens", str(EAGER_SIZE), "--trials", "50",
         "--output", str(report_path)], cwd=Path(__file__).resolve().parents[2], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    twin = report_path.with_suffix(".jsonl")
    try:
        wait_for_figures(proc, twin, lambda rs: any(r["kind"] == "trial" for r in rs),
                         "its first trial")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not report_path.exists()
    records = read_figures(twin)
    assert [r["kind"] for r in records][:3] == ["run", "urgent_alone", "trial"]
    trial = records[2]
    assert trial["prompt_tokens"] == EAGER_SIZE and trial["trial"] == 0
    assert trial["long_step_ms"] > 0 and "done" not in [r["kind"] for r in records]
