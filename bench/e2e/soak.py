"""A thin entry point: the benchmark is `sloserve bench soak` (engine/benchmarks/e2e/soak.py),
with the same parser; `python bench/e2e/soak.py` and `python -m bench.e2e.soak` still run it."""

from __future__ import annotations

from engine.benchmarks.e2e.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
