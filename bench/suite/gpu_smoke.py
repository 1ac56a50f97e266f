"""`python -m bench.suite.gpu_smoke`: the GPU suite's smoke step. It lives in
engine/benchmarks/suite/smoke.py (its docstring says what it checks); `sloserve bench suite`
runs it as the suite's first step."""

from __future__ import annotations

import sys

from engine.benchmarks.suite.smoke import main

if __name__ == "__main__":
    sys.exit(main())
