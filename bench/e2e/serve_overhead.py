"""A thin entry point: the benchmark is `sloserve bench serve` (engine/benchmarks/e2e/serve_overhead.py),
with the same parser; `python bench/e2e/serve_overhead.py` and `python -m bench.e2e.serve_overhead` still run it."""

from __future__ import annotations

from engine.benchmarks.e2e.serve_overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
