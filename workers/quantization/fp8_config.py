"""Which of a model's modules carry FP8 weights, and in which layout.

``Fp8Config`` maps module names to ``Fp8Scheme``s the way the checkpoint's
``quantization_config`` says (targets, ignore lists), and hands each linear layer and each
mixture-of-experts layer its method.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from workers.quantization.fp8 import Fp8LinearMethod
from workers.quantization.fp8_moe import Fp8ExpertsMethod
from workers.quantization.fp8_scheme import Fp8Scheme

# Our fused layers and the checkpoint modules they stand for (workers.startup.weight_loader).
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_module_names(prefix: str) -> list[str]:
    """The checkpoint's module names behind our module ``prefix`` (a fused qkv_proj is the
    checkpoint's q_proj, k_proj and v_proj)."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_MODULES.get(last)
    if parts is None:
        return [prefix]
    return [f"{head}.{part}" if head else part for part in parts]


def name_matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` is what an ignore/target entry means: ``re:<regex>`` (matched from
    the start, as compressed-tensors does), the name itself, a dotted suffix of it
    (``lm_head``, ``mlp.down_proj``), or a module it sits in."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


@dataclass(frozen=True)
class SchemeGroup:
    """A scheme and the modules it covers (compressed-tensors' config_groups entry)."""

    scheme: Fp8Scheme
    # Module names or re: patterns; "Linear" covers every linear layer.
    targets: tuple[str, ...] = ("Linear",)

    def covers(self, name: str) -> bool:
        return any(t == "Linear" or name_matches(name, t) for t in self.targets)


@dataclass(frozen=True)
class Fp8Config:
    """The QuantizationConfig of FP8 weights (workers.quantization.QuantizationConfig)."""

    # The checkpoint's quant_method ("fp8", "compressed-tensors"), or "fp8" for --quantization.
    name: str
    groups: tuple[SchemeGroup, ...]
    ignore: tuple[str, ...] = ()
    # The raw quantization_config, kept for error messages and the log.
    source: dict[str, Any] = field(default_factory=dict, compare=False)

    def scheme_for(self, prefix: str) -> Fp8Scheme | None:
        """The scheme of our module ``prefix``; None where it keeps model-dtype weights. A fused
        module whose parts the checkpoint treats differently is refused."""
        names = checkpoint_module_names(prefix)
        found = [self._scheme_of(name) for name in names]
        if any(s != found[0] for s in found[1:]):
            detail = ", ".join(f"{n}: {s.describe() if s else 'not quantized'}"
                               for n, s in zip(names, found))
            raise ValueError(f"{self.name} quantization: the parts of the fused layer {prefix} "
                             f"are quantized differently ({detail}); they must agree")
        return found[0]

    def _scheme_of(self, name: str) -> Fp8Scheme | None:
        if any(name_matches(name, pattern) for pattern in self.ignore):
            return None
        for group in self.groups:
            if group.covers(name):
                return group.scheme
        return None

    def linear_method(self, prefix: str) -> Fp8LinearMethod | None:
        scheme = self.scheme_for(prefix)
        return None if scheme is None else Fp8LinearMethod(scheme, prefix)

    def experts_method(self, prefix: str) -> Fp8ExpertsMethod | None:
        # Experts are named <prefix>.experts.<e>.<gate|up|down>_proj in the checkpoint; the
        # first expert's projections stand for all of them.
        names = [f"{prefix}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        found = {self._scheme_of(name) for name in names}
        if len(found) > 1:
            raise ValueError(f"{self.name} quantization: the experts of {prefix} have "
                             f"projections quantized differently; they must agree")
        scheme = found.pop()
        return None if scheme is None else Fp8ExpertsMethod(scheme, prefix)
