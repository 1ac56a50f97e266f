"""A thin entry point: the benchmark is `sloserve bench latency` (engine/benchmarks/e2e/latency.py),
with the same parser; `python bench/e2e/preempt_latency.py` and
`python -m bench.e2e.preempt_latency` still run it."""

from __future__ import annotations

from engine.benchmarks.e2e.latency import main

if __name__ == "__main__":
    raise SystemExit(main())
