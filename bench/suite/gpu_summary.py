"""`python -m bench.suite.gpu_summary OUT_DIR [--device cuda] [--smoke] [--dry-run]`: the GPU
suite's summary (OUT_DIR/summary.md and suite.json). It lives in
engine/benchmarks/suite/summary.py (its docstring says what it reads); the suite's script runs
it as its last step."""

from __future__ import annotations

import sys

from engine.benchmarks.suite.summary import main

if __name__ == "__main__":
    sys.exit(main())
