"""The engine end to end on NVIDIA GPUs: model, KV cache and sampling on the device, the Triton
kernels compiled, NCCL for the tensor all-reduces and the preemption vote on the CPU (gloo).

Every scenario is parametrized over the device, so the CPU runs them all in CI and a refactor
that breaks one fails there, not first on a GPU machine. On the CPU a scenario runs on the
PyTorch kernels, or on the Triton kernels in Triton's interpreter where it is about them (with
fewer and shorter prompts: the interpreter is slow); the "cuda" cases are skipped where no GPU is
visible.

Triton decides once per process, when a kernel module is first imported, whether its kernels run
compiled or interpreted (tests/utils/triton_device.py: interpreted unless TRITON_INTERPRET=0). In a
process that interprets them, the GPU cases run in a child pytest with compiled kernels
(test_the_gpu_tests_in_a_process_with_compiled_kernels); in one that compiles them, the CPU
cases that need the interpreter are skipped (the interpreting process ran them)."""

from __future__ import annotations

# Must come before the Triton kernels are first imported (decorated).
import tests.utils.triton_device  # noqa: F401,I001

import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.benchmarks.reference.greedy_divergence import (  # noqa: E402
    NEAR_TIE_MARGIN, assert_no_clear_divergence, compare_greedy, engine_top_two,
    fresh_engine_top_two)
from engine import LLM, SamplingParams  # noqa: E402
from tests.utils.mid_forward import (  # noqa: E402
    check_tp2_remote_rank_unwinds_with_rank0, check_urgent_arrival_unwinds_long_prefill)
from tests.utils.tp import _run as run_tp  # noqa: E402
from tests.utils.triton_device import kernels_interpreted  # noqa: E402
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV  # noqa: E402

# On a GPU, bench/suite/gpu_suite.sh's tests-cuda step runs the tests marked gpu.
pytestmark = pytest.mark.gpu
GPU_REASON = ("needs an NVIDIA GPU (torch.cuda.is_available() is False); the same scenario runs "
              "on the CPU in the 'device_cpu' case")
DEVICES = [pytest.param("cpu", id="device_cpu"),
           pytest.param("cuda", id="device_cuda", marks=pytest.mark.skipif(
               not torch.cuda.is_available(), reason=GPU_REASON))]
TWO_GPUS = [pytest.param("cpu", id="device_cpu"),
            pytest.param("cuda", id="device_cuda", marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="TP=2 on GPUs needs two of them"))]
# The kernels each device runs by default.
DEFAULT_KERNELS = {"cpu": "torch", "cuda": "triton"}
# The engine arguments of every reference run: the CPU, eager, PyTorch kernels. Left at "auto",
# a reference on a GPU machine would pick CUDA and capture graphs over Triton kernels, which a
# pytest process that interprets them cannot capture.
CPU_REFERENCE = {"device": "cpu", "enforce_eager": True}

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def compiled_kernels(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("device") != "cuda":
        return
    if kernels_interpreted():
        pytest.skip("Triton's kernels run interpreted in this process; test_the_gpu_tests_in_a_"
                    "process_with_compiled_kernels runs this test compiled")


def _triton_args(device: str) -> dict:
    """Engine arguments for the Triton kernels on ``device``: the default on a GPU, the
    interpreter on the CPU (skipped in a process whose kernels are compiled)."""
    if device == "cuda":
        return {"device": "cuda"}
    if not kernels_interpreted():
        pytest.skip("Triton on the CPU needs the interpreter, and this process compiled the "
                    "kernels (TRITON_INTERPRET=0); a process that interprets them runs this case")
    return {"device": "cpu", "attention_backend": "triton"}


@pytest.mark.timeout(1900)
def test_the_gpu_tests_in_a_process_with_compiled_kernels():
    if not torch.cuda.is_available():
        pytest.skip(GPU_REASON)
    if not kernels_interpreted():
        pytest.skip("the kernels are compiled in this process: the tests run here")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(Path(__file__)), "-k", "not device_cpu and not in_a_process"],
                            cwd=Path(__file__).parents[2], env=env, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Probe: the child really ran GPU tests (exit 0 would also mean "all skipped").
    assert re.search(r"\b[1-9]\d* passed", result.stdout.splitlines()[-1]), result.stdout[-2000:]


LENGTHS = [5, 300, 17, 120, 1, 64, 250, 33]
# In Triton's interpreter (the CPU cases on the Triton kernels): the same kinds of prompt (one
# spans several chunks, one is a single token), fewer and shorter.
INTERPRETED_LENGTHS = [5, 140, 1, 33]
INTERPRETED_MAX_TOKENS = 6


def _near_tie_tolerance(device: str) -> float:
    """On a GPU, argmaxes may flip where the reference's top two nearly tie (graphs replay other
    split plans and cuBLAS kernels than eager; engine/benchmarks/reference/greedy_divergence.py). On the CPU the runs
    compared are exact: no tolerance, and a divergence still reports its margin."""
    return NEAR_TIE_MARGIN if device == "cuda" else 0.0


def _assert_greedy_equal(prompts: list[dict], got: list[list[int]], want: list[list[int]],
                         top_two_after, device: str) -> None:
    near_ties = assert_no_clear_divergence(compare_greedy(
        [p["prompt_token_ids"] for p in prompts], got, want, top_two_after,
        tolerance=_near_tie_tolerance(device)))
    for tie in near_ties:  # shown with -rP, and in the report of a later failure
        print(f"accepted {tie.describe()}")


def _prompts(vocab: int, lengths: list[int]) -> list[dict]:
    import random

    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in lengths]


ENGINE_SHAPE = dict(dtype="float32", block_size=16, max_num_batched_tokens=128)


def _generate(model_dir: str, params: SamplingParams = GREEDY, interpreted: bool = False,
              **engine_args):
    """Tokens of the scenario's prompts, and where the run was: (KV cache device, weights
    device, kernels). ``interpreted``: the smaller scenario, for Triton's interpreter."""
    params = _scenario_params(params, interpreted)
    llm = LLM(model=model_dir, **ENGINE_SHAPE, **engine_args)
    try:
        runner = llm.engine.executor.runner
        placement = (runner.kv_caches[0][0].device.type,
                     next(runner.model.parameters()).device.type, runner.model.kernels.name)
        outs = llm.generate(_scenario_prompts(model_dir, interpreted), params)
        return [o.token_ids for o in outs], placement
    finally:
        llm.shutdown()


def _scenario_params(params: SamplingParams, interpreted: bool) -> SamplingParams:
    if interpreted:
        return msgspec.structs.replace(params, max_tokens=INTERPRETED_MAX_TOKENS)
    return params


def _scenario_prompts(model_dir: str, interpreted: bool) -> list[dict]:
    return _prompts(_vocab_size(model_dir), INTERPRETED_LENGTHS if interpreted else LENGTHS)


def _reference_top_two(model_dir: str):
    """The CPU reference's top two next tokens, from an engine built when asked."""
    return fresh_engine_top_two(model_dir, **ENGINE_SHAPE, **CPU_REFERENCE)


def _vocab_size(model_dir: str) -> int:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused_ops", [False, True], ids=["unfused", "fused-ops"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_on_the_gpu_equals_the_cpu(tiny_model, arch, fused_ops, device):
    model_dir = tiny_model(arch)
    # Fused ops are Triton kernels: on the CPU they run interpreted.
    args = _triton_args(device) if fused_ops else {"device": device}
    interpreted = args.get("attention_backend") == "triton"
    want, reference = _generate(model_dir, interpreted=interpreted, **CPU_REFERENCE)
    got, placement = _generate(model_dir, interpreted=interpreted, fused_ops=fused_ops, **args)
    # On a GPU the run replays CUDA graphs; the reference is eager on the CPU.
    _assert_greedy_equal(_scenario_prompts(model_dir, interpreted), got, want,
                         _reference_top_two(model_dir), device)
    # Probe: the run really was on the device, on the kernels the case is about.
    kernels = "triton" if fused_ops else DEFAULT_KERNELS[device]
    assert reference == ("cpu", "cpu", "torch") and placement == (device, device, kernels)
    if kernels == "triton":  # interpreted on the CPU, compiled on the GPU
        assert kernels_interpreted() == (device == "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_pytorch_kernels_on_the_gpu_agree_with_triton(tiny_model, device):
    model_dir = tiny_model("llama")
    args = _triton_args(device)
    interpreted = device == "cpu"
    triton_tokens, triton_placement = _generate(model_dir, interpreted=interpreted, **args)
    torch_tokens, placement = _generate(model_dir, interpreted=interpreted, device=device,
                                        attention_backend="torch")
    assert triton_placement == (device, device, "triton")
    assert placement == (device, device, "torch")
    # Other kernels sum in another order: on a GPU, a near-tie of the PyTorch run may flip.
    torch_top_two = fresh_engine_top_two(model_dir, **ENGINE_SHAPE, device=device,
                                         attention_backend="torch", enforce_eager=True)
    _assert_greedy_equal(_scenario_prompts(model_dir, interpreted), triton_tokens, torch_tokens,
                         torch_top_two, device)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_on_the_gpu_is_reproducible(tiny_model, device):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=11, max_tokens=16,
                            ignore_eos=True)
    first, placement = _generate(tiny_model("llama"), params, device=device)
    second, _ = _generate(tiny_model("llama"), params, device=device)
    assert first == second
    # SamplingParams is a msgspec Struct: copied with a change by msgspec, not dataclasses.
    greedy, _ = _generate(tiny_model("llama"), msgspec.structs.replace(GREEDY, max_tokens=16),
                          device=device)
    assert first != greedy  # probe: it really sampled (same length, other tokens)
    assert placement[:2] == (device, device)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graphs_equal_enforce_eager(tiny_model, device, monkeypatch):
    """On a GPU, decode-only steps replay whole CUDA graphs and steps with prefill tokens
    replay pieces holding the attention, one whole graph per step where no vote is cast, all
    captured at startup (workers.graphs.cuda_graphs, workers.graphs.piecewise_graphs; off with
    enforce_eager): the greedy tokens equal the eager run's. The CPU captures none, so there the
    same paths run on the CPU stand-in for graphs (with the PyTorch kernels, whose attention
    runs eager between the pieces).

    Graphs are captured for a context of max_model_len, so at small batches their split plan
    and cuBLAS kernels differ from eager's: on a GPU a divergence where the eager run's top
    two nearly tie is reported and accepted (engine/benchmarks/reference/greedy_divergence.py); on the CPU the two
    runs are exact."""
    if device == "cpu":
        monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    model_dir = tiny_model("llama")
    prompts = _scenario_prompts(model_dir, interpreted=False)
    tokens, replays = {}, {}
    # The graphs run first; the eager one stays up after its run to answer for divergences
    # (one engine on the device at a time: each sizes its KV pool from free memory).
    for enforce_eager in (False, True):
        llm = LLM(model=model_dir, **ENGINE_SHAPE, device=device, enforce_eager=enforce_eager)
        try:
            outs = llm.generate(prompts, GREEDY)
            tokens[enforce_eager] = [o.token_ids for o in outs]
            runner = llm.engine.executor.runner
            replays[enforce_eager] = (None if runner.graphs is None else
                                      (runner.graphs.replays, runner.piecewise.replays))
            if not enforce_eager and device != "cpu":
                # Probe: the Triton kernels' pieces hold the attention, and the steps too
                # small to be stopped (under --slo-preempt-min-tokens) replayed whole.
                assert runner.piecewise.holds_attention
                assert runner.piecewise.whole_replays > 0
            if enforce_eager:
                _assert_greedy_equal(prompts, tokens[False], tokens[True], engine_top_two(llm),
                                     device)
        finally:
            llm.shutdown()
    # Probe: both kinds of graph replayed steps, and none ran under enforce_eager.
    assert replays[True] is None
    assert replays[False] is not None and min(replays[False]) > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["pause", "suspend"])
def test_mid_forward_preemption_on_the_gpu(model, mode, device):  # noqa: F811 (the fixture)
    # The host runs ahead of the GPU and votes between layers; the unwound step's queued
    # kernels finish, nothing more is launched, and every output equals the CPU's.
    check_urgent_arrival_unwinds_long_prefill(model, mode, device=device)


@pytest.mark.parametrize("device", TWO_GPUS)
def test_tp2_on_two_gpus_equals_tp1_on_the_cpu(tiny_model, device):
    model_dir = tiny_model("llama")
    want = run_tp(model_dir, tp=1, device="cpu")  # the reference: never "auto"
    got = run_tp(model_dir, tp=2, device=device)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_kv_preemptions for o in got) > 0  # probe: KV pressure preempted


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", TWO_GPUS)
def test_tp2_on_two_gpus_unwinds_together(tiny_model, monkeypatch, tmp_path, device):
    check_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path, device=device)
