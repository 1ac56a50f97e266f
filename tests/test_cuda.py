"""The engine end to end on NVIDIA GPUs: model, KV cache and sampling on the device, the Triton
kernels compiled, NCCL for the tensor all-reduces and the preemption vote on the CPU (gloo).

Skipped where no GPU is visible; the same scenarios run on the CPU in Triton's interpreter in
tests/test_triton_engine.py (and the kernels alone in tests/test_triton_kernels.py).

Triton decides once per process, when a kernel module is first imported, whether its kernels run
compiled or interpreted, and the interpreter tests import them with TRITON_INTERPRET=1 set. In a
session that collected those, these tests run in a child pytest without it
(test_the_gpu_tests_in_a_process_with_compiled_kernels)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_mid_forward_preemption import (  # noqa: F401 (the fixture)
    check_urgent_arrival_unwinds_long_prefill, model)
from tests.test_tp_engine import _run as run_tp
from tests.test_tp_preemption import check_tp2_remote_rank_unwinds_with_rank0

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU (torch.cuda.is_available() is False); the Triton kernels and the "
           "engine on them are tested in Triton's interpreter by test_triton_kernels.py, "
           "test_triton_fused.py and test_triton_engine.py")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _kernels_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import triton_attention

    return isinstance(triton_attention._paged_attention_kernel, InterpretedFunction)


@pytest.fixture(autouse=True)
def compiled_kernels(request):
    if request.node.name.startswith("test_the_gpu_tests_in_a_process"):
        return
    if _kernels_interpreted():
        pytest.skip("Triton's kernels run interpreted in this process (the interpreter tests "
                    "imported them first); test_the_gpu_tests_in_a_process_with_compiled_"
                    "kernels runs this test compiled")


@pytest.mark.timeout(1900)
def test_the_gpu_tests_in_a_process_with_compiled_kernels():
    if not _kernels_interpreted():
        pytest.skip("the kernels are compiled in this process: the tests run here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(Path(__file__)), "-k", "not in_a_process"],
                            cwd=Path(__file__).parents[1], env=env, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Probe: the child really ran GPU tests (exit 0 would also mean "all skipped").
    assert re.search(r"\b[1-9]\d* passed", result.stdout.splitlines()[-1]), result.stdout[-2000:]


LENGTHS = [5, 300, 17, 120, 1, 64, 250, 33]


def _prompts(vocab: int) -> list[dict]:
    import random

    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in LENGTHS]


def _generate(model_dir: str, params: SamplingParams = GREEDY, **engine_args):
    llm = LLM(model=model_dir, dtype="float32", block_size=16, max_num_batched_tokens=128,
              **engine_args)
    try:
        runner = llm.engine.executor.runner
        placement = (runner.kv_caches[0][0].device.type,
                     next(runner.model.parameters()).device.type, runner.model.kernels.name)
        outs = llm.generate(_prompts(llm.engine.vocab_size), params)
        return [o.token_ids for o in outs], placement
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fused_ops", [False, True], ids=["unfused", "fused-ops"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_on_the_gpu_equals_the_cpu(tiny_model, arch, fused_ops):
    model_dir = tiny_model(arch)
    want, cpu = _generate(model_dir)
    got, gpu = _generate(model_dir, device="cuda", fused_ops=fused_ops)
    assert got == want
    # Probe: the run really was on the GPU, on the compiled Triton kernels.
    assert cpu == ("cpu", "cpu", "torch") and gpu == ("cuda", "cuda", "triton")
    assert not _kernels_interpreted()


def test_pytorch_kernels_on_the_gpu_agree_with_triton(tiny_model):
    model_dir = tiny_model("llama")
    triton_tokens, _ = _generate(model_dir, device="cuda")
    torch_tokens, placement = _generate(model_dir, device="cuda", attention_backend="torch")
    assert placement == ("cuda", "cuda", "torch")
    assert torch_tokens == triton_tokens


def test_seeded_sampling_on_the_gpu_is_reproducible(tiny_model):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=11, max_tokens=16,
                            ignore_eos=True)
    first, _ = _generate(tiny_model("llama"), params, device="cuda")
    second, _ = _generate(tiny_model("llama"), params, device="cuda")
    assert first == second
    greedy, _ = _generate(tiny_model("llama"), dataclasses.replace(GREEDY, max_tokens=16),
                          device="cuda")
    assert first != greedy  # probe: it really sampled (same length, other tokens)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["pause", "suspend"])
def test_mid_forward_preemption_on_the_gpu(model, mode):  # noqa: F811 (the fixture)
    # The host runs ahead of the GPU and votes between layers; the unwound step's queued
    # kernels finish, nothing more is launched, and every output equals the CPU's.
    check_urgent_arrival_unwinds_long_prefill(model, mode, device="cuda")


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="TP=2 on GPUs needs two of them")


@two_gpus
def test_tp2_on_two_gpus_equals_tp1_on_the_cpu(tiny_model):
    model_dir = tiny_model("llama")
    want = run_tp(model_dir, tp=1)
    got = run_tp(model_dir, tp=2, device="cuda")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_preemptions for o in got) > 0  # probe: KV pressure preempted


@two_gpus
@pytest.mark.timeout(300)
def test_tp2_on_two_gpus_unwinds_together(tiny_model, monkeypatch, tmp_path):
    check_tp2_remote_rank_unwinds_with_rank0(tiny_model, monkeypatch, tmp_path, device="cuda")

