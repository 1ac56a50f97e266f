"""Mid-forward preemption at TP=2 (two gloo worker processes): only rank 0 can see the shared
memory (rank 1 stands in for a rank on another node and always votes 0), yet both ranks unwind
before the same layer, nothing hangs, and the outputs equal TP=1 without preemption."""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import build_engine_config
from engine.runtime.engine_core import EngineCore
from engine.core.request import Request
from monitor.predictor import LinearTTFT
from tests.preemption.test_mid_forward_preemption import (DELAY_US_PER_TOKEN, LONG_PROMPT, NUM_LAYERS,
                                               URGENT_SLO_MS, _prompt, _request, _run)
from workers.model_runner import LAYER_DELAY_ENV


@pytest.mark.timeout(300)
def test_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path) -> None:
    # The CPU case (tests/gpu/test_cuda.py runs it on GPUs): never "auto", which picks CUDA.
    check_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path, device="cpu")


def check_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path,
                                             **engine_args) -> None:
    """The scenario, with the TP=2 engine built with ``engine_args`` (e.g. on GPUs); the
    reference is always TP=1 on the CPU."""
    # Spawned workers inherit the environment: both ranks' layers are slowed alike.
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS, max_position_embeddings=1024)
    prompts = {"long": _prompt(LONG_PROMPT, seed=11), "urgent": _prompt(30, seed=12)}
    ttft = tmp_path / "ttft.json"  # the slowed layers' line: see test_mid_forward_preemption
    LinearTTFT(seconds_per_token=NUM_LAYERS * DELAY_US_PER_TOKEN * 1e-6, intercept_s=0.02).save(
        ttft)
    args = dict(dtype="float32", num_kv_blocks=160, block_size=16, max_num_batched_tokens=1024,
                scheduling_policy="slo", preempt_min_tokens=32, collective_timeout_s=60,
                ttft_model=str(ttft))

    # The reference pins the CPU: at "auto" a GPU machine would build it on CUDA (graphs
    # captured over Triton kernels that a process interpreting them cannot capture).
    reference = EngineCore(build_engine_config(model, mid_forward_preemption=False,
                                               device="cpu", **args))
    try:
        ref = {k: _request(k, p, None) for k, p in prompts.items()}
        for r in ref.values():
            reference.add_request(r)
        _run(reference)
    finally:
        reference.shutdown()

    # Suspend mode: each rank keeps its own copy of the stopped pass and both resume it.
    config = build_engine_config(model, tensor_parallel_size=2, slo_preempt_mode="suspend",
                                 **args, **engine_args)
    config.preemption.signal_ranks = 1  # rank 1 gets no view of the shared memory
    engine = EngineCore(config)
    try:
        long = _request("long", prompts["long"], slo_ms=60_000)
        engine.add_request(long)
        arrived: list[Request] = []

        def arrive_mid_step() -> None:
            # The long step lasts NUM_LAYERS x 60 ms; arrive a couple of layers into it.
            while engine.scheduler.step_id < 1:
                time.sleep(0.005)
            time.sleep(0.15)
            arrived.append(_request("urgent", prompts["urgent"], slo_ms=URGENT_SLO_MS))
            engine.submit_request(arrived[0])

        threading.Thread(target=arrive_mid_step, daemon=True).start()
        _run(engine, timeout_s=240)
        (urgent,) = arrived

        (event,) = engine.preemption.events  # probe: the step was unwound
        assert event.victim_id == "long" and event.waiter_id == "urgent"
        assert 0 < event.layer < NUM_LAYERS
        assert event.unwound_layers == [event.layer, event.layer]  # both ranks, same layer
        assert long.num_preemptions == 1
        assert event.applied == "suspend" and event.wasted_tokens == 0
        assert urgent.first_token_time < long.first_token_time
        assert long.output_token_ids == ref["long"].output_token_ids
        assert urgent.output_token_ids == ref["urgent"].output_token_ids
    finally:
        engine.shutdown()
