"""`python -m bench.suite.gpu_equality`: greedy equality against HF transformers, the GPU suite's
equality step. It lives in engine/benchmarks/suite/equality.py (its docstring says what it
compares)."""

from __future__ import annotations

import sys

from engine.benchmarks.suite.equality import main

if __name__ == "__main__":
    sys.exit(main())
