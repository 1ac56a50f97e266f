"""C++ loops for the CPU, compiled by Inductor's toolchain and called through its thin binding.

Each loop is a ``CppFunction``: a ``static`` C++ function with its helpers, and its parameters.
Alone, it is compiled behind a generated ``extern "C" void kernel(...)`` entry (the name
Inductor's binding calls); several are compiled into one unit when one entry calls them in turn
(``kernels.cpu_decode_pass`` runs a whole decode step through the fused and bf16-weight loops).
``PRELUDE`` is what every unit starts with: Inductor's precompiled ``at::vec`` header, the float
vector type and its lane count, and a horizontal sum.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PRELUDE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
using Vec = at::vec::Vectorized<float>;
static constexpr int64_t kLanes = Vec::size();

static inline float hsum(Vec v) {
    return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}
"""


@dataclass(frozen=True)
class CppFunction:
    """``static void <name>(<params>)`` as ``definition`` writes it (with the helpers and
    constants it needs, each named for its loop so that units can hold several)."""

    name: str
    # (C++ type, name) in order: the entry's signature, and the binding's argument types.
    params: tuple[tuple[str, str], ...]
    definition: str

    @classmethod
    def parse(cls, name: str, definition: str) -> CppFunction:
        """The function ``name`` that ``definition`` defines, its parameters read from there."""
        found = re.search(rf"static void {name}\(([^)]*)\)", definition)
        if found is None:
            raise ValueError(f"no 'static void {name}(...)' in the definition")
        params = tuple(tuple(p.strip().rsplit(None, 1)) for p in found.group(1).split(","))
        return cls(name, params, definition)  # type: ignore[arg-type]

    @property
    def argtypes(self) -> list[str]:
        return [kind for kind, _ in self.params]

    def entry(self) -> str:
        """The ``extern "C" void kernel(...)`` that calls this function with its arguments."""
        signature = ", ".join(f"{kind} {name}" for kind, name in self.params)
        arguments = ", ".join(name for _, name in self.params)
        return f'\nextern "C" void kernel({signature})\n{{\n    {self.name}({arguments});\n}}\n'


def compile_unit(entry: CppFunction, parts: Sequence[str] = ()) -> Any:
    """The binding of ``entry`` compiled after ``PRELUDE`` and ``parts`` (other functions'
    definitions it calls): a Python callable taking its parameters, tensors for pointers.
    Inductor caches the build on disk by source: ~2 s the first time on a machine."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = PRELUDE + "".join(parts) + entry.definition + entry.entry()
    return CppPythonBindingsCodeCache.load_pybinding(entry.argtypes, source)
