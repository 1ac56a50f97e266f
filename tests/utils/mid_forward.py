"""Mid-forward preemption on a tiny model whose layers are slowed by the runner's test hook
(test helper): the `model` fixture (the conftest.py of each folder whose tests use it registers
it), prompts, engines and requests, a run to completion, an action fired while a long step is at
a layer, the unpreempted reference, and the scenarios that tests/gpu and tests/kernels rerun on
other devices and kernels: an urgent arrival unwinding a long prefill, and the same at TP=2."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from engine.benchmarks.reference.greedy_divergence import (NEAR_TIE_MARGIN, assert_no_clear_divergence,
                                     compare_greedy, fresh_engine_top_two)
from engine.config import build_engine_config
from engine.core.request import Request
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from monitor.step_time_model import StepTimeModel
from workers.preemption.layer_delay import LAYER_DELAY_ENV, observe_attention_ops

NUM_LAYERS = 8
# 400 prompt tokens x 150 us = 60 ms per layer (480 ms for the long step); 44 tokens: 7 ms.
DELAY_US_PER_TOKEN = 150
LONG_PROMPT = 400
MAX_TOKENS = 6


# The engines' TTFT line, matching the slowed layers (1.2 ms per token), so that the monitor's
# estimate of the running step's remaining time is right: it preempts only for a waiter whose
# slack does not cover the rest of the step.
URGENT_SLO_MS = 300
_TTFT_FILE: dict[str, str] = {}


@pytest.fixture
def model(tiny_model, monkeypatch, tmp_path_factory) -> str:
    return _slowed_model("llama", tiny_model, monkeypatch, tmp_path_factory)


@pytest.fixture(params=["qwen3_moe", "mixtral"])
def moe_model(request, tiny_model, monkeypatch, tmp_path_factory) -> str:
    """The same slowed tiny model as ``model``, a mixture of experts of each family (8 experts,
    2 per token) between its attention ops."""
    return _slowed_model(request.param, tiny_model, monkeypatch, tmp_path_factory)


# The windowed model's sliding window: the long prompt is more than eight windows long.
WINDOW = 48


@pytest.fixture(params=["mistral", "gemma3", "gpt_oss"])
def windowed_model(request, tiny_model, monkeypatch, tmp_path_factory) -> str:
    """The same slowed tiny model as ``model`` with layers sliding over ``WINDOW`` tokens:
    every layer in Mistral's layout; every other one in Gemma 3's, with its own rotary base,
    and in gpt-oss's, with attention sinks and its experts."""
    return _slowed_model(request.param, tiny_model, monkeypatch, tmp_path_factory,
                         sliding_window=WINDOW)


# The LongRoPE model's threshold: the long prompt rotates by the long factors, the urgent one by
# the short.
LONG_ROPE_AFTER = 256


@pytest.fixture
def long_rope_model(tiny_model, monkeypatch, tmp_path_factory) -> str:
    """The same slowed tiny model as ``model`` in Phi-4-mini's layout: a partial rotary
    (0.75 of each 16-dim head: 6 frequencies) with LongRoPE's two regimes."""
    return _slowed_model(
        "phi3", tiny_model, monkeypatch, tmp_path_factory, partial_rotary_factor=0.75,
        original_max_position_embeddings=LONG_ROPE_AFTER,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                      "long_factor": [1.0, 3.0, 6.0, 12.0, 24.0, 48.0]})


def _slowed_model(arch: str, tiny_model, monkeypatch, tmp_path_factory, **overrides) -> str:
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    if "path" not in _TTFT_FILE:
        path = tmp_path_factory.mktemp("ttft") / "ttft.json"
        StepTimeModel(seconds_per_token=NUM_LAYERS * DELAY_US_PER_TOKEN * 1e-6,
                      intercept_s=0.02).save(path)
        _TTFT_FILE["path"] = str(path)
    return tiny_model(arch, num_hidden_layers=NUM_LAYERS, max_position_embeddings=1024,
                      **overrides)


def _prompt(n: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(3, 250, (n - len(prefix or []),), generator=g).tolist()
    return (prefix or []) + tail


def _engine(model: str, **overrides) -> EngineCore:
    # The CPU unless a case names another device: left at "auto", a GPU machine would run these
    # CPU-timed scenarios (and their references) on CUDA, capturing graphs over Triton kernels
    # that a pytest process interpreting them cannot capture.
    args = dict(device="cpu", dtype="float32", num_kv_blocks=160, block_size=16,
                max_num_batched_tokens=1024, scheduling_policy="slo", slo_preempt_min_tokens=32,
                enable_prefix_caching=True,
                ttft_model=_TTFT_FILE.get("path"))
    args.update(overrides)
    return EngineCore(build_engine_config(model, **args))


def _request(req_id: str, prompt: list[int], slo_ms: float | None) -> Request:
    return Request(request_id=req_id, prompt_token_ids=prompt, ttft_slo_ms=slo_ms,
                   sampling_params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  temperature=0.0))


def _run(engine: EngineCore, timeout_s: float = 120.0) -> list[tuple[float, float]]:
    """Steps until every request finished; returns each step's (start, end) time."""
    deadline = time.monotonic() + timeout_s
    steps = []
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        started = time.monotonic()
        engine.step()
        steps.append((started, time.monotonic()))
        engine.scheduler.check_invariants()
    return steps


def _duration_of_step_at(steps: list[tuple[float, float]], t: float) -> float:
    return next(end - start for start, end in steps if start <= t <= end)


def _on_long_step(engine: EngineCore, layer: int, action: Callable[[], None],
                  min_tokens: int = LONG_PROMPT) -> None:
    """Run `action` on another thread once the forward pass of a long step reaches `layer`
    (the arrival races the forward pass, as it would over HTTP)."""
    reached = threading.Event()

    def observer(layer_idx: int, num_tokens: int) -> None:
        if layer_idx == layer and num_tokens >= min_tokens:
            reached.set()

    # At the layer's attention op, which an eager pass and a step replayed as CUDA graph
    # pieces both run in Python (a hook inside a piece never runs in a real replay).
    observe_attention_ops(engine.executor.runner.model, observer)

    def fire() -> None:
        if reached.wait(timeout=30):
            action()

    threading.Thread(target=fire, daemon=True).start()


def _reference_outputs(model: str, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    engine = _engine(model, slo_preemption=False, enforce_eager=True)
    try:
        requests = {k: _request(k, p, None) for k, p in prompts.items()}
        for r in requests.values():
            engine.add_request(r)
        _run(engine)
        return {k: r.output_token_ids for k, r in requests.items()}
    finally:
        engine.shutdown()


def _assert_equal_to_reference(model: str, prompts: dict[str, list[int]],
                               got: dict[str, list[int]], expected: dict[str, list[int]],
                               device: str) -> None:
    """Every output equals the CPU reference's. On a GPU (CUDA graphs, Triton kernels) an
    argmax may flip where the reference's top two nearly tie: reported and accepted
    (engine/benchmarks/reference/greedy_divergence.py); on the CPU the runs are exact."""
    names = sorted(prompts)
    divergences = compare_greedy(
        [prompts[k] for k in names], [got[k] for k in names], [expected[k] for k in names],
        fresh_engine_top_two(model, device="cpu", dtype="float32", enforce_eager=True),
        tolerance=NEAR_TIE_MARGIN if device == "cuda" else 0.0)
    for tie in assert_no_clear_divergence(divergences):
        print(f"accepted {tie.describe()}")


def _count_tokens_per_layer(engine: EngineCore) -> list[int]:
    """Tokens that reached each layer's attention op, summed over the run (a step replayed as
    pieces counts its real rows; a decode step replayed as one graph is counted at every layer
    alike on the CPU stand-in, and at none on a GPU)."""
    model = engine.executor.runner.model
    counts = [0] * model.num_layers

    def counter(layer_idx: int, num_tokens: int) -> None:
        counts[layer_idx] += num_tokens

    observe_attention_ops(model, counter)
    return counts


def check_urgent_arrival_unwinds_long_prefill(model: str, mode: str, check_timing: bool = True,
                                              **engine_args) -> None:
    """The scenario, with the preempted engine built with ``engine_args`` (another device or
    kernel backend: the reference run is always the CPU's PyTorch path). ``check_timing=False``
    where the kernels run far slower than the engine's TTFT line says (Triton's interpreter):
    the scheduler then plans steps on wrong costs, and only the unwind itself is checked."""
    long_prompt = _prompt(LONG_PROMPT, seed=1)
    # The urgent prompt shares the long one's first 32 tokens: the unwound step must not have
    # committed their prefix-cache hashes, and a hit must still give the same tokens.
    prompts = {"long": long_prompt, "urgent": _prompt(44, seed=2, prefix=long_prompt[:32])}
    expected = _reference_outputs(model, prompts)

    engine = _engine(model, slo_preempt_mode=mode, **engine_args)
    try:
        long = _request("long", prompts["long"], slo_ms=60_000)
        engine.add_request(long)
        arrived: list[Request] = []

        def arrive() -> None:  # the urgent request's arrival time is now, mid-step
            arrived.append(_request("urgent", prompts["urgent"], slo_ms=URGENT_SLO_MS))
            engine.submit_request(arrived[0])

        _on_long_step(engine, layer=1, action=arrive)
        tokens_per_layer = _count_tokens_per_layer(engine)
        steps = _run(engine)
        (urgent,) = arrived

        assert engine.slo_preemption is not None
        (event,) = engine.slo_preemption.events  # probe: the step really was unwound, once
        assert 0 < event.layer < NUM_LAYERS
        # The unwound step had admitted the long prompt: unless its chunk was suspended, it is
        # back in the queue with no KV, which is a recompute whatever the mode.
        applied = "suspend" if mode == "suspend" else "recompute"
        assert (event.victim_id, event.waiter_id, event.applied) == ("long", "urgent", applied)
        if mode == "suspend":
            # The long prompt went through every layer exactly once: the resumed pass began
            # at the layer the unwound one stopped at.
            assert event.wasted_tokens == 0
            assert tokens_per_layer[0] == tokens_per_layer[-1]
            assert len(engine.executor.runner.suspended) == 0
        else:
            # Paired probe: the unwound pass's layers below the stop were run twice.
            assert event.wasted_tokens == LONG_PROMPT
            assert tokens_per_layer[0] == tokens_per_layer[-1] + LONG_PROMPT
        assert long.num_preemptions == long.num_slo_preemptions == 1 and not long.num_kv_preemptions
        assert urgent.num_preemptions == 0
        # The urgent request's first token came sooner after its arrival than the long step
        # takes as a whole (measured in this run: the step that finally prefilled it), so
        # before that step could have finished had it not been stopped.
        assert urgent.first_token_time is not None and long.first_token_time is not None
        if check_timing:
            long_step_s = _duration_of_step_at(steps, long.first_token_time)
            assert urgent.first_token_time - urgent.arrival_time < long_step_s
            assert urgent.first_token_time < long.first_token_time
        _assert_equal_to_reference(
            model, prompts, {"long": long.output_token_ids, "urgent": urgent.output_token_ids},
            expected, engine_args.get("device", "cpu"))
        assert engine.scheduler.kv_cache_manager.num_free_blocks == 160
        pieces = engine.executor.runner.piecewise
        if pieces is not None:
            # With graphs on, the long step (400 tokens) was replayed as pieces and the vote
            # between two of them stopped it; steps ran as pieces and decodes as whole graphs.
            assert pieces.unwinds == 1 and pieces.replays > 0
            assert engine.executor.runner.graphs.replays > 0
    finally:
        engine.shutdown()


def check_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path,
                                             **engine_args) -> None:
    """The scenario, with the TP=2 engine built with ``engine_args`` (e.g. on GPUs); the
    reference is always TP=1 on the CPU."""
    # Spawned workers inherit the environment: both ranks' layers are slowed alike.
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS, max_position_embeddings=1024)
    prompts = {"long": _prompt(LONG_PROMPT, seed=11), "urgent": _prompt(30, seed=12)}
    ttft = tmp_path / "ttft.json"  # the slowed layers' line: see test_mid_forward_preemption
    StepTimeModel(seconds_per_token=NUM_LAYERS * DELAY_US_PER_TOKEN * 1e-6, intercept_s=0.02).save(
        ttft)
    args = dict(dtype="float32", num_kv_blocks=160, block_size=16, max_num_batched_tokens=1024,
                scheduling_policy="slo", slo_preempt_min_tokens=32, collective_timeout_s=60,
                ttft_model=str(ttft))

    # The reference pins the CPU: at "auto" a GPU machine would build it on CUDA (graphs
    # captured over Triton kernels that a process interpreting them cannot capture).
    reference = EngineCore(build_engine_config(model, slo_preemption=False,
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
    config.slo_preemption.signal_ranks = 1  # rank 1 gets no view of the shared memory
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

        (event,) = engine.slo_preemption.events  # probe: the step was unwound
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
