"""Device and kernel-backend choices that cannot run here fail at engine construction, with an
error that names the problem (before any worker is spawned or weight loaded)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import ModelConfig
from kernels.backend import BACKEND_ENV, resolve_backend_name, resolve_fused_ops


def test_cuda_without_a_gpu_is_a_clear_error(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        LLM(model=tiny_model("llama"), device="cuda")


def test_more_ranks_than_gpus_is_a_clear_error(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs on this machine; "
                                         "1 is visible"):
        LLM(model=tiny_model("llama"), device="cuda", tensor_parallel_size=2)


def test_bfloat16_needs_an_ampere_gpu(tiny_model, monkeypatch):
    from engine.runtime.model_setup import resolve_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    cuda = torch.device("cuda", 0)
    # "auto" picks float16 on a T4 ...
    assert resolve_dtype("auto", cuda) == torch.float16
    # ... and an explicit bfloat16 says why it cannot run.
    with pytest.raises(ValueError, match="bfloat16 needs a GPU of compute capability 8.0 or "
                                         "newer; this one is 7.5: use --dtype float16"):
        resolve_dtype("bfloat16", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert resolve_dtype("auto", cuda) == torch.bfloat16


AVX2_CPUINFO = """processor	: 0
vendor_id	: GenuineIntel
flags		: fpu vme sse sse2 avx f16c avx2 fma bmi2 avx512f avx512bw
"""
AVX512_BF16_CPUINFO = AVX2_CPUINFO.replace("avx512bw", "avx512bw avx512_bf16")
AMX_CPUINFO = AVX2_CPUINFO.replace("avx512bw", "avx512bw amx_tile amx_bf16")


def test_auto_dtype_on_a_cpu_follows_native_bf16(monkeypatch, caplog):
    """`auto` on a CPU picks bf16 only where it runs natively: on an AVX2 CPU PyTorch's bf16
    matmul is ~100x slower than fp32 (and mkldnn's own check says yes for plain AVX-512)."""
    import engine.runtime.model_setup as setup

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert setup.cpu_native_bf16(AVX2_CPUINFO) == (
        False, "the CPU has no native bf16 (no AMX, no AVX512-BF16)")
    assert setup.cpu_native_bf16(AVX512_BF16_CPUINFO) == (True, "the CPU has avx512_bf16")
    assert setup.cpu_native_bf16(AMX_CPUINFO) == (True, "the CPU has amx_bf16")
    assert setup.cpu_native_bf16("Features\t: fp asimd bf16 i8mm\n")[0]

    cpu = torch.device("cpu")
    read_flags = setup.cpu_native_bf16
    for cpuinfo, expected in ((AVX2_CPUINFO, torch.float32), (AMX_CPUINFO, torch.bfloat16)):
        monkeypatch.setattr(setup, "cpu_native_bf16", lambda info=cpuinfo: read_flags(info))
        caplog.clear()
        with caplog.at_level("INFO", logger="engine.runtime.model_setup"):
            assert setup.resolve_dtype("auto", cpu) == expected
        # The server log says which and why.
        assert f"dtype auto -> {str(expected).removeprefix('torch.')}" in caplog.text
        assert ("no native bf16" in caplog.text) == (expected == torch.float32)


def test_unknown_device_and_backend_names(tiny_model):
    with pytest.raises(ValueError, match="device must be one of 'auto', 'cpu', 'cuda', got "
                                         "'tpu'"):
        LLM(model=tiny_model("llama"), device="tpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(model=tiny_model("llama"), attention_backend="flash")


def test_fused_ops_need_the_triton_backend(tiny_model):
    with pytest.raises(ValueError, match="fused_ops are Triton kernels; the attention backend "
                                         "here is 'torch'"):
        LLM(model=tiny_model("llama"), fused_ops=True)


def test_fused_ops_default_to_on_where_the_triton_kernels_run(monkeypatch):
    # "auto" (the default) follows the backend: on with Triton, off with PyTorch's layers.
    assert ModelConfig(model="unused", device="cpu").fused_ops == "auto"
    assert resolve_fused_ops("auto", "triton") is True
    assert resolve_fused_ops("auto", "torch") is False
    assert resolve_fused_ops("off", "triton") is False
    assert resolve_fused_ops("on", "triton") is True
    # The flag's earlier boolean form still means on / off.
    assert ModelConfig(model="unused", device="cpu", fused_ops=True).fused_ops == "on"
    assert ModelConfig(model="unused", device="cpu", fused_ops=False).fused_ops == "off"
    assert resolve_fused_ops(False, "triton") is False
    with pytest.raises(ValueError, match="fused_ops must be one of auto, on, off"):
        ModelConfig(model="unused", device="cpu", fused_ops="yes")
    with pytest.raises(ValueError, match="fused_ops are Triton kernels"):
        resolve_fused_ops("on", "torch")
    # Through the backend's resolution: the CPU default runs the PyTorch layers without error,
    # a CUDA device (or a forced Triton backend) the fused kernels.
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("cpu", "auto", "auto") == "torch"
    assert resolve_backend_name("cuda", "auto", "auto") == "triton"
    assert resolve_backend_name("cpu", "triton", "off") == "triton"


def test_forcing_triton_on_the_cpu_needs_the_interpreter(tiny_model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(model=tiny_model("llama"), attention_backend="triton")


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("cpu") == "torch"
    assert resolve_backend_name("cuda") == "triton"
    assert resolve_backend_name("cuda", "torch") == "torch"
    assert resolve_backend_name("cpu", "triton") == "triton"
    # The environment forces a backend where the caller left it to "auto" ...
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert resolve_backend_name("cpu") == "triton"
    # ... but an explicit request wins, and a bad value is named.
    assert resolve_backend_name("cpu", "torch") == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cudnn")
    with pytest.raises(ValueError, match=f"{BACKEND_ENV}='cudnn'"):
        resolve_backend_name("cpu")
