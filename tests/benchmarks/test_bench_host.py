"""`sloserve bench host`: the engine loop against a simulated device, at tiny sizes."""

from __future__ import annotations

import json

import pytest

from engine.benchmarks.e2e import host
from engine.entrypoints.cli import build_parser


def test_bench_host_is_a_standing_benchmark() -> None:
    args = build_parser().parse_args(["bench", "host", "--batches", "1", "4", "--steps", "3"])
    assert args.func is host.run and args.batches == [1, 4] and args.steps == 3


def test_bench_host_times_both_loops_against_the_profile(tmp_path, capsys) -> None:
    """Each loop's timed steps are all decodes of the batch; the device's step is what the
    floorless profile gives such a step; every arrival gets its wait. (How much busier the
    async loop keeps the device is for the printed figures to show, not for a test.)"""
    output = tmp_path / "host.json"
    assert host.main(["--batches", "1", "8", "--steps", "6", "--arrivals", "2",
                      "--prompt-tokens", "32", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "host us/seq" in printed and "device idle" in printed and "arrival wait" in printed
    figures = json.loads(output.read_text())
    assert figures["profile"] == "h100-llama-3.1-8b"
    assert [(b["loop"], b["batch"]) for b in figures["batches"]] == [
        ("serial", 1), ("serial", 8), ("async", 1), ("async", 8)]
    from engine.simulation.profile import load_profile

    profile = load_profile("h100-llama-3.1-8b")
    for b in figures["batches"]:
        batch = b["batch"]
        # Probe: the device time is the profile's work for a batch of decodes at this context
        # (prompt 32 + the tokens decoded so far), never its 30 ms host-launch floor.
        lowest = profile.compute_seconds(batch, 0, batch * 33) * 1e3
        assert lowest <= b["device_ms"] < profile.floor_s * 1e3
        # The loop's own work (scheduling, the update, encoding the outputs) takes time.
        assert b["host_ms"] > 0
        assert b["host_us_per_sequence"] == pytest.approx(b["host_ms"] * 1e3 / batch)
        assert len(b["arrival_wait_ms"]) == 2 and all(w >= 0 for w in b["arrival_wait_ms"])
    # The serial loop leaves the device idle for all of the host's work.
    assert all(b["device_idle_pct"] > 0 for b in figures["batches"] if b["loop"] == "serial")


def test_max_tokens_cover_the_prefill_stagger() -> None:
    # The first of 256 requests decodes while the other 255 prefill in 2048-token steps.
    assert host.max_tokens_for(256, 512, 50) > 64 + host.WARM_UP_STEPS + 50
