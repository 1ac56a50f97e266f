"""Derived step-time profiles (engine/benchmarks/inputs/derived_profiles.py): the real-size shapes no GPU has timed
yet (qwen3-30b-a3b, mixtral-8x7b, llama-3.1-8b-fp8), from the measured h100-llama-3.1-8b
profile's limits and each shape's parameter counts. The checks are orderings the derivation's
formulas imply, not its numbers."""

from __future__ import annotations

import time

import pytest

from engine.benchmarks.inputs.model_shapes import SHAPES, write_shape
from engine.config import build_engine_config
from engine.core.request import Request
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.simulation import StepTimeProfile, load_profile, shipped_profiles
from engine.benchmarks.inputs.derived_profiles import (DATASHEET_GBPS, DERIVED, FP8_GEMM_SPEEDUP, MEASURED,
                                      derive_profile, derived_profiles, device_limits, main,
                                      shape_work)

H100 = MEASURED  # the measured profile: Llama-3.1-8B, bf16, one H100
QWEN3, MIXTRAL, FP8 = "h100-qwen3-30b-a3b", "h200-mixtral-8x7b", "h100-llama-3.1-8b-fp8"
CONTEXT = 4096  # each decode's KV tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _decode(profile: StepTimeProfile, batch: int) -> float:
    """The device's time for a decode step of `batch` sequences (the floor apart)."""
    return profile.compute_seconds(batch, 0, batch * CONTEXT)


def _prefill(profile: StepTimeProfile, tokens: int) -> float:
    return profile.compute_seconds(tokens, tokens * tokens, 0)


def test_the_derived_profiles_ship_as_the_generator_computes_them():
    assert set(DERIVED) == {QWEN3, MIXTRAL, FP8}
    computed = derived_profiles()
    for name, (shape, _) in DERIVED.items():
        assert name in shipped_profiles()
        profile = load_profile(name)  # what `--simulate NAME` loads
        assert profile == computed[name]  # regenerate: python -m engine.benchmarks.inputs.derived_profiles
        assert profile.derived_from == MEASURED and profile.description.startswith("DERIVED")
        assert profile.model_shape == shape
        assert profile.num_layers == SHAPES[shape]["num_hidden_layers"]
        assert profile.kv_cache_memory_gb > 0
    assert load_profile(H100).derived_from is None  # measured
    assert main(["--check"]) == 0


def test_derived_from_its_own_shape_the_measured_profile_comes_back():
    """The limits are the measured profile's terms divided by its shape's work: spent on that
    shape again they give its terms (the derivation's probe)."""
    measured = load_profile(H100)
    again = derive_profile("llama-3.1-8b", device_limits("h100"))
    for field in ("seconds_per_token", "seconds_per_attention", "seconds_per_decode_context",
                  "intercept_s", "floor_s", "unwind_s", "kv_cache_memory_gb"):
        assert getattr(again, field) == pytest.approx(getattr(measured, field), rel=1e-3), field


def test_published_parameter_counts():
    """The counts the derivation rests on: 30.5B (3.3B active), 46.7B (12.9B active), 8.0B."""
    for shape, total, active in [("qwen3-30b-a3b", 30.5, 3.3), ("mixtral-8x7b", 46.7, 12.9),
                                 ("llama-3.1-8b", 8.0, 8.0)]:
        work = shape_work(SHAPES[shape])
        assert work.total_params / 1e9 == pytest.approx(total, abs=0.06), shape
        assert work.active_params / 1e9 == pytest.approx(active, abs=0.06), shape


def test_a_moe_decode_reads_the_experts_its_batch_touches():
    dense, qwen = load_profile(H100), load_profile(QWEN3)
    # Mixtral on the H100's limits (its bf16 weights do not fit one: for the comparison only).
    mixtral = derive_profile("mixtral-8x7b", device_limits("h100"), require_fit=False)
    for moe in (qwen, mixtral):
        e, k = moe.num_experts, moe.experts_per_token
        assert moe.experts_read(0) == 0 and moe.experts_read(1) == pytest.approx(k)
        assert moe.experts_read(64) == pytest.approx(e * (1 - (1 - k / e) ** 64))
        assert moe.experts_read(4096) == pytest.approx(e)  # any prefill chunk reads them all
    # Batch 1: Qwen3-30B-A3B reads 8 of 128 experts (3.3B active parameters against 8B), Mixtral
    # 2 of 8 (12.9B: more than the 8B's, less than twice).
    assert _decode(qwen, 1) < _decode(dense, 1) < _decode(mixtral, 1) < 2 * _decode(dense, 1)
    # Batch 64 touches nearly every expert: both read more than the dense 8B.
    assert qwen.experts_read(64) > 0.95 * qwen.num_experts
    assert _decode(dense, 64) < _decode(qwen, 64) < _decode(mixtral, 64)
    # Decode steps of eager mode are the host's: the floor is per layer, and 48 layers launch
    # more than 32, so on the clock Qwen3's batch-1 step is the longer one.
    assert qwen.floor_s / qwen.num_layers == pytest.approx(dense.floor_s / dense.num_layers)
    for profile in (dense, qwen):
        assert profile.step_seconds(1, 0, CONTEXT) == profile.floor_s
    assert qwen.step_seconds(1, 0, CONTEXT) > dense.step_seconds(1, 0, CONTEXT)
    # Prefill: a token's GEMMs are its active parameters' (fewer for Qwen3, more for Mixtral).
    assert qwen.seconds_per_token < dense.seconds_per_token < mixtral.seconds_per_token
    assert _prefill(dense, 4096) < _prefill(mixtral, 4096)


def test_fp8_reads_half_the_weights_and_doubles_the_gemm_rate():
    bf16, fp8 = load_profile(H100), load_profile(FP8)
    assert _decode(fp8, 1) < _decode(bf16, 1) and _decode(fp8, 64) < _decode(bf16, 64)
    assert _prefill(fp8, 4096) < _prefill(bf16, 4096)
    assert fp8.seconds_per_token == pytest.approx(bf16.seconds_per_token / FP8_GEMM_SPEEDUP)
    # The LM head stays bf16: more than half the 8B's reads.
    assert bf16.intercept_s / 2 < fp8.intercept_s < 0.6 * bf16.intercept_s
    # Attention and the KV cache stay bf16; the pool gains what the weights free.
    assert (fp8.seconds_per_attention, fp8.seconds_per_decode_context, fp8.floor_s) == (
        bf16.seconds_per_attention, bf16.seconds_per_decode_context, bf16.floor_s)
    assert fp8.kv_cache_memory_gb > bf16.kv_cache_memory_gb


def test_mixtral_is_an_h200s_its_weights_do_not_fit_an_h100():
    with pytest.raises(ValueError, match="leave no KV pool"):
        derive_profile("mixtral-8x7b", device_limits("h100"))
    on_h100 = derive_profile("mixtral-8x7b", device_limits("h100"), require_fit=False)
    h200 = load_profile(MIXTRAL)
    ratio = DATASHEET_GBPS["h200"] / DATASHEET_GBPS["h100"]
    # Reads are the bandwidth ratio faster; compute and the host are the H100's.
    for field in ("intercept_s", "seconds_per_expert", "seconds_per_decode_context"):
        assert getattr(on_h100, field) / getattr(h200, field) == pytest.approx(ratio, rel=2e-3)
    for field in ("seconds_per_token", "seconds_per_attention", "floor_s"):
        assert getattr(h200, field) == getattr(on_h100, field)
    from bench.kernels.harness import DATASHEET_GBPS as harness_gbps

    assert {name: gbps for words, gbps, name in harness_gbps
            if name in ("H100 SXM", "H200")} == {"H100 SXM": DATASHEET_GBPS["h100"],
                                                  "H200": DATASHEET_GBPS["h200"]}


@pytest.mark.parametrize("spec, expected", [
    ({"num_experts": 8, "experts_per_token": 9, "seconds_per_expert": 1e-3}, "experts_per_token"),
    ({"num_experts": 8, "experts_per_token": 0, "seconds_per_expert": 1e-3}, "experts_per_token"),
    ({"num_experts": 8, "experts_per_token": 2, "seconds_per_expert": -1.0}, "seconds_per_expert"),
])
def test_a_bad_expert_term_is_refused(spec, expected):
    with pytest.raises(ValueError, match=expected):
        StepTimeProfile(name="x", num_layers=4, seconds_per_token=1e-4, **spec)


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_a_simulated_engine_serves_requests_on_a_derived_profile(tokenizer, tmp_path, name):
    """`sloserve serve FOLDER --simulate NAME` on a folder of the profile's shape (`sloserve
    bench shape`): two requests, each step at least its profile time."""
    shape = DERIVED[name][0]
    folder = write_shape(shape, tmp_path / shape, tokenizer)
    engine = EngineCore(build_engine_config(str(folder), simulate=name, max_model_len=4096,
                                            startup_calibration=False))
    try:
        profile = engine.model.profile
        assert profile == load_profile(name)
        steps: list[tuple[int, float]] = []
        execute = engine.executor.execute_model

        def timed(out):
            result = execute(out)
            steps.append((sum(len(r.token_ids) for r in out.requests), result.execute_seconds))
            return result

        engine.executor.execute_model = timed
        requests = [Request(request_id=f"r{i}", prompt_token_ids=[5 + i] * n,
                            sampling_params=SamplingParams(temperature=0, max_tokens=3,
                                                           ignore_eos=True))
                    for i, n in enumerate((40, 300))]
        for request in requests:
            engine.add_request(request)
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            engine.step()
        assert all(r.num_output_tokens == 3 for r in requests)
        assert steps and all(seconds >= 0.95 * profile.floor_s for _, seconds in steps)
    finally:
        engine.shutdown()
