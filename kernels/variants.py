"""Which compiled variant of a Triton kernel each launch uses, so startup can compile them all.

Triton compiles a kernel once per *variant*: its constexpr arguments and launch options (all
passed by keyword here), and a specialization of every runtime argument: its type, a pointer's
16-byte alignment, and an integer's value class (equal to 1, which becomes a constant, or
divisible by 16) unless the kernel lists it in ``do_not_specialize``. A launch that meets a new
variant compiles it on the spot, about a second on a GPU, while every request in flight waits.

Every Triton launch in ``kernels/`` goes through :func:`launch`. Inside :func:`recording` it also
notes the launch's variant: the startup warm-up (``workers.startup.kernel_warmup``) reports what it
compiled, and the tests compare that set with the variants serving launches over a sweep of
batches (tests/kernels/test_kernel_warmup.py), which is what proves that no compile is left for
serving.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# Open recordings (nested ones each see every launch).
_RECORDERS: list[set[Variant]] = []


@dataclass(frozen=True)
class Variant:
    kernel: str
    # Constexpr arguments and launch options (num_warps, ...), by name.
    constants: tuple[tuple[str, Any], ...]
    # Per runtime argument: its name, Triton type and specialization.
    signature: tuple[tuple[str, str, Any], ...]

    def constant(self, name: str) -> Any:
        return dict(self.constants)[name]


@dataclass(frozen=True)
class KernelWarmup:
    """What the startup warm-up (workers.startup.kernel_warmup) launched."""

    # Every variant it launched (compiled, unless Triton's cache already held it).
    variants: frozenset[Variant]
    seconds: float
    steps: int
    compiled: bool  # False under Triton's interpreter: nothing to compile, the steps just ran


@contextmanager
def recording() -> Iterator[set[Variant]]:
    """Collect the variant of every kernel launch made inside the block."""
    seen: set[Variant] = set()
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        # By identity: sets compare by value, and nested recordings may hold equal sets.
        del _RECORDERS[next(i for i, r in enumerate(_RECORDERS) if r is seen)]


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constants: Any) -> None:
    """``kernel[grid](*args, **constants)``: positional arguments are the runtime ones, keywords
    the constexprs and launch options."""
    if _RECORDERS:
        variant = variant_of(kernel, args, constants)
        for seen in _RECORDERS:
            seen.add(variant)
    _run(kernel, grid, args, constants)


def _run(kernel: Any, grid: tuple[int, ...], args: Sequence[Any],
         constants: dict[str, Any]) -> None:
    kernel[grid](*args, **constants)


def variant_of(kernel: Any, args: Sequence[Any], constants: dict[str, Any]) -> Variant:
    names: list[str] = list(kernel.arg_names)
    skip = _do_not_specialize(kernel, names)
    signature = tuple((name, *_specialization(value, name not in skip))
                      for name, value in zip(names, args))
    return Variant(kernel=_name(kernel), constants=tuple(sorted(constants.items())),
                   signature=signature)


def _name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", repr(kernel))


def _do_not_specialize(kernel: Any, names: list[str]) -> set[str]:
    # A compiled kernel (JITFunction) keeps the list as given; an interpreted one
    # (InterpretedFunction) keeps the decorator's keyword arguments.
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return {names[item] if isinstance(item, int) else item for item in listed}


def _specialization(value: Any, specialize: bool) -> tuple[str, Any]:
    """Triton's (type, specialization) of a runtime argument, from Triton itself where it
    exposes the function its launcher uses (it needs no GPU), else the same rules by hand."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        kind, spec = native_specialize_impl(BaseBackend, value, False, specialize, True)[:2]
    except Exception:  # noqa: BLE001 - a private API: another Triton may lack it or differ
        return _specialization_by_hand(value, specialize)
    return str(kind), spec


def _specialization_by_hand(value: Any, specialize: bool) -> tuple[str, Any]:
    if isinstance(value, bool):
        return "u1", None
    if isinstance(value, int):
        if specialize and value == 1:
            return "constexpr", 1
        kind = "i32" if -2**31 <= value < 2**31 else "i64"
        return kind, ("D" if value % 16 == 0 else "") if specialize else None
    if isinstance(value, float):
        return "fp32", None
    if isinstance(value, torch.Tensor):
        return f"*{value.dtype}", "D" if value.data_ptr() % 16 == 0 else ""
    return type(value).__name__, None
