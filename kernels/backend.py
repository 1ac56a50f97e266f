"""Which kernels run: the PyTorch reference on CPU, Triton on CUDA, or either when forced.

``select_backend(device, requested)`` resolves a request ("auto", "torch" or "triton"; "auto"
defers to the ``SLOSERVE_ATTENTION_BACKEND`` environment variable, then to the device) into the
functions a model calls. Triton modules are imported only when chosen: importing one decorates
its kernels, and Triton decides then whether they run compiled or in its interpreter, so a CPU
process that forces Triton must have ``TRITON_INTERPRET=1`` set before that first import.

The fused RMSNorm (+ residual), rotary and SiLU-and-mul kernels (``fused_ops``) are on by
default wherever the Triton backend runs: ``fused_ops="auto"`` resolves to on with Triton and off
with the PyTorch backend, whose reference ops the CPU keeps. On an H100 ``bench/kernels/gpu_kernels.py``
measured the norm and rotary kernels 1.7-10.7x faster than the eager PyTorch layers,
which is what docs/design.md section 7 asks before a fused op is used. "on" insists (an error
without Triton), "off" keeps the PyTorch layers beside Triton attention.

The PyTorch backend on a CPU has fused ops of its own (``kernels.cpu_fused``: C++ loops for
add+RMSNorm, rotary and SiLU·mul, and a decode attention that reads the paged cache in place).
On the default model's decode forward over 512 tokens of context (2-core AVX-512 machine) the
layer ops took 34.4 -> 31.4 ms at one decode and 57.6 -> 54.4 ms at eight, the attention kernel
another 31.4 -> 27.6 and 54.4 -> 44.0. They serve float32 models of at least
``cpu_fused.MIN_HIDDEN_SIZE`` hidden units (``KernelBackend.fused_for``, asked by the model,
compiles them the first time it says yes; ``fused_paged_attention`` then replaces the model's
``paged_attention``); ``fused_ops="off"`` and ``SLOSERVE_CPU_FUSED_OPS=0`` keep the PyTorch
path, and "auto" and "on" (which still means Triton's) leave them on.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKEND_ENV = "SLOSERVE_ATTENTION_BACKEND"
BACKENDS = ("auto", "torch", "triton")
FUSED_OPS = ("auto", "on", "off")


@dataclass(frozen=True)
class KernelBackend:
    name: str
    # See kernels.attention for the contracts.
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # Fused replacements for workers.layers' RMSNorm arithmetic, apply_rotary and silu_and_mul
    # (same contracts), or None where the PyTorch layers are used as they are.
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None
    apply_rotary: Callable[..., torch.Tensor] | None = None
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Gemma's: GeGLU's activation, and its RMSNorm that scales in float32 before the cast.
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    rms_norm_float32_scale: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None
    # A mixture-of-experts layer's experts (kernels.triton_moe.fused_experts), or None where
    # workers.layers.moe computes them in PyTorch. Part of the Triton backend whether or not the
    # other fused ops are on: the PyTorch path reads per-expert counts on the host, which a CUDA
    # graph cannot capture.
    fused_moe: Callable[..., torch.Tensor] | None = None
    # Whether the fused ops above serve a model of this dtype and hidden size (asked once, when
    # the model is set up; it may compile them then). None: they serve every model.
    fused_for: Callable[[torch.dtype, int], bool] | None = None
    # The fused ops' paged attention (same contract), which replaces paged_attention in a model
    # they serve (the CPU's: its decodes in one compiled loop); None: paged_attention serves all.
    fused_paged_attention: Callable[..., torch.Tensor] | None = None


_CACHE: dict[tuple[str, bool, bool], KernelBackend] = {}


def fused_ops_setting(value: str | bool) -> str:
    """``value`` as one of FUSED_OPS; booleans (the flag's earlier form) mean "on" / "off"."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in FUSED_OPS:
        raise ValueError(f"fused_ops must be one of {', '.join(FUSED_OPS)} (or a bool), got "
                         f"{value!r}")
    return value


def resolve_fused_ops(fused_ops: str | bool, backend_name: str) -> bool:
    """Whether the fused kernels run with this backend ("torch" or "triton"): "auto" is on with
    Triton only; "on" without Triton is a ValueError."""
    setting = fused_ops_setting(fused_ops)
    if setting == "on" and backend_name != "triton":
        raise ValueError(f"fused_ops are Triton kernels; the attention backend here is "
                         f"{backend_name!r} (use attention_backend='triton', or run on CUDA)")
    return backend_name == "triton" and setting != "off"


def resolve_backend_name(device: torch.device | str, requested: str = "auto",
                         fused_ops: str | bool = "auto") -> str:
    """"torch" or "triton" for this device; ValueError for an unknown name, a Triton request
    that cannot run here, or fused ops "on" without Triton."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend: unknown {requested!r}; choose one of "
                         f"{', '.join(BACKENDS)}")
    device = torch.device(device)
    name = requested
    if name == "auto":
        name = os.environ.get(BACKEND_ENV, "auto") or "auto"
        if name not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={name!r} is not one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' on device {device.type!r} needs Triton's "
                         f"interpreter: set TRITON_INTERPRET=1 in the environment before start")
    resolve_fused_ops(fused_ops, name)
    return name


def select_backend(device: torch.device | str, requested: str = "auto",
                   fused_ops: str | bool = "auto") -> KernelBackend:
    name = resolve_backend_name(device, requested, fused_ops)
    # The CPU's own fused ops (kernels.cpu_fused) go with the PyTorch backend on a CPU.
    cpu_fused = (name == "torch" and torch.device(device).type == "cpu"
                 and fused_ops_setting(fused_ops) != "off")
    key = (name, resolve_fused_ops(fused_ops, name), cpu_fused)
    if key not in _CACHE:
        _CACHE[key] = _load(*key)
    return _CACHE[key]


def _load(name: str, fused_ops: bool, cpu_fused: bool) -> KernelBackend:
    if name == "torch":
        from kernels import torch_attention

        backend = KernelBackend("torch", torch_attention.write_kv_cache,
                                torch_attention.paged_attention)
        if not cpu_fused:
            return backend
        from kernels import cpu_fused as cpu

        return dataclasses.replace(backend, rms_norm=cpu.rms_norm,
                                   apply_rotary=cpu.apply_rotary,
                                   silu_and_mul=cpu.silu_and_mul, fused_for=cpu.serves,
                                   fused_paged_attention=cpu.paged_attention)
    cache = importlib.import_module("kernels.triton_cache")
    attention = importlib.import_module("kernels.triton_attention")
    moe = importlib.import_module("kernels.triton_moe")
    backend = KernelBackend("triton", cache.write_kv_cache, attention.paged_attention,
                            fused_moe=moe.fused_experts)
    if not fused_ops:
        return backend
    norm = importlib.import_module("kernels.triton_norm")
    rotary = importlib.import_module("kernels.triton_rotary")
    activation = importlib.import_module("kernels.triton_activation")
    return dataclasses.replace(backend, rms_norm=norm.rms_norm,
                               apply_rotary=rotary.apply_rotary,
                               silu_and_mul=activation.silu_and_mul,
                               gelu_tanh_and_mul=activation.gelu_tanh_and_mul,
                               rms_norm_float32_scale=functools.partial(
                                   norm.rms_norm, scale_in_float32=True))
