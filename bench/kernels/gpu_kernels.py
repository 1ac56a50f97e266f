"""`python -m bench.kernels.gpu_kernels`: the GPU kernel benchmark, also `sloserve bench kernels`.

The benchmark lives in engine/benchmarks/kernels/gpu_kernels.py (its docstring says what it
measures); this entry point keeps the command README and CONTRIBUTING document.
"""

from __future__ import annotations

import sys

from engine.benchmarks.kernels.gpu_kernels import main

if __name__ == "__main__":
    sys.exit(main())
