"""`sloserve calibrate`: sweep prompt sizes on the engine, fit the TTFT line, write its JSON."""

import json
import math

import pytest

from engine.entrypoints.calibrate import calibrate, choose_model
from engine.entrypoints.cli import main
from engine.entrypoints.llm import LLM
from monitor.step_time_fit import fit_line
from monitor.step_time_model import StepTimeModel
from workers.preemption.layer_delay import LAYER_DELAY_ENV

# Small pool and context: the tiny model needs no more, and the engine starts in a blink.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "80"]


@pytest.fixture(autouse=True)
def _slow_layers(monkeypatch):
    """The tiny model prefills in a few milliseconds, which the noise of other processes on the
    machine can outweigh; the runner's test hook adds 20 us per token per layer, so that prefill
    time clearly grows with the prompt (768 tokens: 46 ms more than none)."""
    monkeypatch.setenv(LAYER_DELAY_ENV, "20")


def _calibrate(model: str, *args: str) -> int:
    return main(["calibrate", "--model", model, *ENGINE_ARGS, *args])


def test_calibrate_writes_a_loadable_line(tiny_model, tmp_path, capsys):
    out = tmp_path / "ttft.json"
    # Sizes far apart, and a median of 5: two slow passes are absorbed.
    code = _calibrate(tiny_model("llama"), "--prompt-sizes", "32", "256", "768",
                      "--repeats", "5", "--decode-batches", "1", "64",
                      "--decode-contexts", "32", "256", "--output", str(out))
    assert code == 0
    model = StepTimeModel.load(out)
    assert isinstance(model.r2, float) and -math.inf < model.r2 <= 1.0
    assert model.seconds_per_token > 0
    printed = capsys.readouterr().out
    for word in ("768", "seconds_per_token", "seconds_per_decode_context", "intercept_ms", "r2",
                 "ms per decode step", str(out)):
        assert word in printed
    # 64 sequences of 32 + 9 tokens need more KV than the 80-block pool holds.
    assert "skipping decode shapes (batch, context) [(64, 32), (64, 256)]" in printed


def test_calibrate_skips_sizes_that_do_not_fit_one_step(tiny_model, tmp_path, capsys):
    out = tmp_path / "ttft.json"
    code = _calibrate(tiny_model("llama"), "--prompt-sizes", "32", "768", "1000", "1024",
                      "--max-num-batched-tokens", "800", "--repeats", "5",
                      "--output", str(out))
    assert code == 0
    printed = capsys.readouterr().out
    assert "skipping prompt sizes [1000, 1024]" in printed
    assert json.loads(out.read_text())["seconds_per_token"] > 0


@pytest.mark.parametrize("args, message", [
    (["--prompt-sizes", "0", "16"], "--prompt-sizes must be positive, got [0]"),
    (["--prompt-sizes", "16", "32", "--repeats", "0"], "--repeats must be >= 1"),
    (["--prompt-sizes", "16", "32", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--prompt-sizes", "2000", "4000"], "need two or more distinct prompt sizes"),
])
def test_calibrate_bad_input_exits_2_without_output(tiny_model, tmp_path, capsys, args, message):
    out = tmp_path / "ttft.json"
    assert _calibrate(tiny_model("llama"), *args, "--output", str(out)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("sloserve: error: ")]
    assert len(errors) == 1 and message in errors[0]
    assert not out.exists()


def test_calibrate_unwritable_output_fails_before_measuring(tiny_model, tmp_path, capsys):
    out = tmp_path / "missing-dir" / "ttft.json"
    assert _calibrate(tiny_model("llama"), "--prompt-sizes", "16", "32",
                      "--output", str(out)) == 2
    assert "is not writable" in capsys.readouterr().err
    assert not out.exists()


def test_calibrate_result_keeps_every_point_and_the_medians(tiny_model):
    llm = LLM(model=tiny_model("llama"), dtype="float32", max_model_len=1024, num_kv_blocks=80,
              enable_prefix_caching=False)
    try:
        result = calibrate(llm, [768, 32, 32], repeats=5, warmup=1)
    finally:
        llm.shutdown()
    assert sorted(n for n, _ in result.points) == [32] * 5 + [768] * 5
    assert all(t > 0 for _, t in result.points)
    assert list(result.medians) == [32, 768]
    # Two sizes: nothing can be held out, so the line through both is kept.
    assert (result.model, result.held_out_error) == choose_model(result.medians)
    line = fit_line(result.medians.items())
    assert result.model.seconds_per_token == pytest.approx(line.seconds_per_token)
    assert set(result.held_out_error.values()) == {None}


def test_calibrate_fits_decode_steps_together_with_the_prefills(tiny_model):
    from engine.entrypoints.calibrate import decode_point

    llm = LLM(model=tiny_model("llama"), dtype="float32", max_model_len=1024, num_kv_blocks=80,
              enable_prefix_caching=False)
    shapes = [(1, 64), (4, 128), (1, 512)]
    try:
        result = calibrate(llm, [32, 256, 768], repeats=3, warmup=1, decode_shapes=shapes)
    finally:
        llm.shutdown()
    assert list(result.decode_medians) == shapes
    assert all(seconds > 0 for seconds in result.decode_medians.values())
    assert decode_point(4, 128, 0.1) == (4, 0, 4 * (128 + 4), 0.1)
    # One choice over the prefill and decode medians together.
    assert (result.model, result.held_out_error) == choose_model(result.medians,
                                                                 result.decode_medians)
    assert set(result.held_out_error) == {"line", "quadratic", "line+floor", "quadratic+floor"}


def test_the_attention_term_is_kept_only_if_it_predicts_held_out_sizes_better():
    sizes = [16, 64, 256, 512, 1024, 2048, 3072]
    curved = {n: 0.02 + 1e-3 * n + 3e-7 * n * n for n in sizes}
    model, errors = choose_model(curved)
    assert errors["quadratic"] < errors["line"]
    assert model.seconds_per_token_sq == pytest.approx(3e-7, rel=1e-3)
    # Probe: on straight data (with a little bumpiness) the line is kept.
    straight = {n: (0.02 + 1e-3 * n) * (1.01 if i % 2 else 0.99) for i, n in enumerate(sizes)}
    model, errors = choose_model(straight)
    assert model.seconds_per_token_sq == 0.0 and errors["line"] is not None
    assert model.floor_s == 0.0 and model.relative_error >= 0.05


def test_a_host_floor_is_kept_where_small_steps_all_take_the_launch_time():
    """GPU-shaped steps: nothing runs faster than the host launches its kernels (30 ms), above
    that compute grows with the tokens. A sum of terms fits that badly at small sizes."""
    sizes = [16, 64, 256, 1024, 2048, 4096, 8192]
    gpu = {n: max(0.03, 0.002 + 5e-5 * n + 1e-10 * n * n) for n in sizes}
    model, errors = choose_model(gpu)
    assert min(errors["line"], errors["quadratic"]) > 0.15  # probe: the terms alone cannot
    assert errors["quadratic+floor"] < 0.01
    assert model.floor_s == pytest.approx(0.03)
    for n in (16, 100, 3000, 8192):
        expected = max(0.03, 0.002 + 5e-5 * n + 1e-10 * n * n)
        assert model.predict(n) == pytest.approx(expected, rel=0.01)
    assert model.max_tokens_within(0.029) == 0  # below the floor nothing fits
